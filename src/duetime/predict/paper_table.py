"""The SFS paper's per-(task, model) accuracy table, shipped as ``paper_accuracy.yaml``."""

from __future__ import annotations

from functools import cache
from importlib import resources

import yaml


@cache
def paper_accuracy() -> dict[str, dict[str, float]]:
    """``{task: {model: accuracy}}`` (read once)."""
    text = resources.files("duetime.predict").joinpath("paper_accuracy.yaml").read_text(
        encoding="utf-8")
    by_model = yaml.safe_load(text)["accuracy"]
    out: dict[str, dict[str, float]] = {}
    for model, tasks in by_model.items():
        for task, acc in tasks.items():
            out.setdefault(task, {})[model] = float(acc)
    return out
