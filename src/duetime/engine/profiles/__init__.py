"""Built-in instance profiles: a named batch-time model with the scheduler config it ran under."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.resources import files

import yaml

from duetime.engine.batch_time import BatchTimeModel, model_from_dict
from duetime.engine.config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    model: BatchTimeModel
    config: SchedulerConfig


@cache
def _profiles() -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    for res in sorted(files(__package__).iterdir(), key=lambda p: p.name):
        if not res.name.endswith(".yaml"):
            continue
        for name, d in yaml.safe_load(res.read_text()).items():
            out[name] = Profile(name, d.get("description", ""),
                                model_from_dict(d["batch_time"], f"{res.name}:{name}.batch_time"),
                                SchedulerConfig(**d["config"]))
    return out


def profile_names() -> list[str]:
    return sorted(_profiles())


def load_profile(name: str) -> Profile:
    """A built-in profile by name (e.g. ``qwen3-8b``); unknown names list the known ones."""
    try:
        return _profiles()[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; built-in profiles: "
                       f"{', '.join(profile_names())}") from None
