"""Built-in instance profiles: a named batch-time model with the scheduler config it ran under,
as :class:`~duetime.engine.spec.InstanceSpec` objects (no prices: those belong to a pool)."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import yaml

from duetime.engine.batch_time import model_from_dict
from duetime.engine.config import SchedulerConfig
from duetime.engine.spec import InstanceSpec


@cache
def _profiles() -> dict[str, InstanceSpec]:
    out: dict[str, InstanceSpec] = {}
    for res in sorted(files(__package__).iterdir(), key=lambda p: p.name):
        if not res.name.endswith(".yaml"):
            continue
        for name, d in yaml.safe_load(res.read_text()).items():
            out[name] = InstanceSpec(
                name, model_from_dict(d["batch_time"], f"{res.name}:{name}.batch_time"),
                SchedulerConfig(**d["config"]), description=d.get("description", ""))
    return out


def profile_names() -> list[str]:
    return sorted(_profiles())


def load_profile(name: str) -> InstanceSpec:
    """A built-in profile by name (e.g. ``qwen3-8b``); unknown names list the known ones."""
    try:
        return _profiles()[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; built-in profiles: "
                       f"{', '.join(profile_names())}") from None
