"""Workload profiles: tasks, their length and quality distributions, models and prices.

A profile is an editable YAML file (``duetime/workload/profiles/*.yaml`` ship with duetime;
any path works). Errors name the file and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from duetime.engine.spec import InstanceSpec, resolve_spec


class ProfileError(ValueError):
    """A workload profile that cannot be used; the message names the file and field."""


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A clipped log-normal length distribution (median, log-space sigma, [min, max])."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.exp(rng.normal(math.log(self.median), self.sigma, n))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    name: str
    share: float
    prompt: LogNormal
    output: LogNormal
    output_scale: dict[str, float]
    accuracy: dict[str, float]
    target: TargetRule | None = None  # the class's own TTFT target rule (None: the workload's)


@dataclass(frozen=True, slots=True)
class TargetRule:
    """TTFT target = clip(queue + min(budget, clip_hi - queue), clip) with
    queue ~ U(queue_ms), budget = (base + per_token * prompt) * U(jitter) (released SFS code)."""

    queue_ms: tuple[float, float] = (1.0, 5.0)
    base_ms: float = 155.0
    per_prompt_token_ms: float = 0.035
    jitter: tuple[float, float] = (0.98, 1.02)
    clip_ms: tuple[float, float] = (150.0, 1120.0)

    def sample(self, rng: np.random.Generator, prompt_tokens: np.ndarray) -> np.ndarray:
        """Targets in seconds."""
        n = len(prompt_tokens)
        queue = rng.uniform(*self.queue_ms, n)
        budget = (self.base_ms + self.per_prompt_token_ms * prompt_tokens) * rng.uniform(
            *self.jitter, n)
        budget = np.minimum(budget, self.clip_ms[1] - queue)
        return np.clip(queue + budget, *self.clip_ms) / 1000.0


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    name: str
    lam: float
    models: dict[str, InstanceSpec]  # model name -> its instances' spec (with prices)
    tasks: dict[str, TaskSpec]
    quality_concentration: float
    target: TargetRule
    # model name -> instances of it in the pool (replicas; absent: one)
    replicas: Mapping[str, int] = field(default_factory=dict)

    @property
    def model_names(self) -> list[str]:
        return list(self.models)

    def instance_pairs(self) -> list[tuple[str, str]]:
        """The pool's (instance name, model name) pairs: a model of one replica is one
        instance of its own name; ``r`` replicas are ``model.0`` .. ``model.{r-1}``."""
        out = []
        for m in self.models:
            r = self.replicas.get(m, 1)
            out += [(m, m)] if r == 1 else [(f"{m}.{k}", m) for k in range(r)]
        return out

    def with_replicas(self, replicas: int | Mapping[str, int]) -> WorkloadProfile:
        """The same workload over a pool of ``replicas`` instances of every model (or per
        model, a mapping)."""
        per = ({m: int(replicas) for m in self.models} if isinstance(replicas, int)
               else {**self.replicas, **replicas})
        bad = {m: r for m, r in per.items() if m not in self.models or r < 1}
        if bad:
            raise ProfileError(f"replicas: need >= 1 of a model of the profile, got {bad}")
        return replace(self, replicas=per)

    @property
    def task_names(self) -> list[str]:
        return list(self.tasks)


# -- loading ------------------------------------------------------------------------------------

def _num(d: dict, key: str, where: str, *, lo: float | None = None) -> float:
    if key not in d:
        raise ProfileError(f"{where}.{key}: missing")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProfileError(f"{where}.{key}: must be a number, got {v!r}")
    if lo is not None and v < lo:
        raise ProfileError(f"{where}.{key}: must be >= {lo}, got {v!r}")
    return float(v)


def _lognormal(d: Any, where: str) -> LogNormal:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: must be a mapping with median, sigma, min, max")
    lo, hi = int(_num(d, "min", where, lo=1)), int(_num(d, "max", where, lo=1))
    if lo > hi:
        raise ProfileError(f"{where}: min {lo} > max {hi}")
    return LogNormal(_num(d, "median", where, lo=1), _num(d, "sigma", where, lo=0), lo, hi)


def _per_model(d: Any, models: list[str], where: str, default: float | None = None,
               lo: float = 0.0, hi: float | None = None) -> dict[str, float]:
    d = d or {}
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: must be a mapping of model -> number")
    extra = sorted(set(d) - set(models))
    if extra:
        raise ProfileError(f"{where}: unknown model(s) {extra}; the profile's models: {models}")
    out = {}
    for m in models:
        if m not in d:
            if default is None:
                raise ProfileError(f"{where}.{m}: missing")
            out[m] = default
            continue
        v = _num(d, m, where, lo=lo)
        if hi is not None and v > hi:
            raise ProfileError(f"{where}.{m}: must be <= {hi}, got {v}")
        out[m] = v
    return out


def _model(name: str, d: Any, where: str) -> InstanceSpec:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: must be a mapping")
    try:
        spec = resolve_spec(name, profile=d.get("profile"), batch_time=d.get("batch_time"),
                            config=d.get("config"), where=where)
    except ValueError as e:
        raise ProfileError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    price = d.get("price_usd_per_mtok")
    if not isinstance(price, dict):
        raise ProfileError(f"{where}.price_usd_per_mtok: must be a mapping with prompt, output")
    return spec.priced(_num(price, "prompt", f"{where}.price_usd_per_mtok", lo=0),
                       _num(price, "output", f"{where}.price_usd_per_mtok", lo=0))


TARGET_KEYS = ("queue_ms", "base_ms", "per_prompt_token_ms", "jitter", "clip_ms")


def _target_rule(tt: Any, base: TargetRule, where: str) -> TargetRule:
    """A TTFT target rule: the fields given, the rest from ``base`` (a class's rule overrides
    the workload's, field by field)."""
    if tt is None:
        return base
    if not isinstance(tt, dict):
        raise ProfileError(f"{where}: must be a mapping")
    unknown = sorted(set(tt) - set(TARGET_KEYS))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                           f"{', '.join(TARGET_KEYS)}")
    try:
        rule = TargetRule(
            tuple(float(x) for x in tt.get("queue_ms", base.queue_ms)),
            float(tt.get("base_ms", base.base_ms)),
            float(tt.get("per_prompt_token_ms", base.per_prompt_token_ms)),
            tuple(float(x) for x in tt.get("jitter", base.jitter)),
            tuple(float(x) for x in tt.get("clip_ms", base.clip_ms)))
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {e}") from None
    for name in ("queue_ms", "jitter", "clip_ms"):
        lo_hi = getattr(rule, name)
        if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
            raise ProfileError(f"{where}.{name}: want [low, high] with 0 <= low <= high, "
                               f"got {list(lo_hi)}")
    if rule.base_ms < 0 or rule.per_prompt_token_ms < 0:
        raise ProfileError(f"{where}: base_ms and per_prompt_token_ms must be >= 0")
    return rule


def profile_from_dict(d: Any, source: str = "profile") -> WorkloadProfile:
    """Build a profile from its YAML/JSON form; errors start with ``source``."""
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: must be a mapping")
    models_d = d.get("models")
    if not isinstance(models_d, dict) or not models_d:
        raise ProfileError(f"{source}: models: must be a non-empty mapping")
    models = {str(m): _model(str(m), v, f"{source}: models.{m}") for m, v in models_d.items()}
    names = list(models)
    tasks_d = d.get("tasks")
    if not isinstance(tasks_d, dict) or not tasks_d:
        raise ProfileError(f"{source}: tasks: must be a non-empty mapping")
    tasks = {}
    for t, v in tasks_d.items():
        w = f"{source}: tasks.{t}"
        if not isinstance(v, dict):
            raise ProfileError(f"{w}: must be a mapping")
        tasks[str(t)] = TaskSpec(
            str(t), _num(v, "share", w, lo=0), _lognormal(v.get("prompt_tokens"),
                                                          f"{w}.prompt_tokens"),
            _lognormal(v.get("output_tokens"), f"{w}.output_tokens"),
            _per_model(v.get("output_scale"), names, f"{w}.output_scale", default=1.0),
            _per_model(v.get("accuracy"), names, f"{w}.accuracy", hi=1.0))
    if sum(t.share for t in tasks.values()) <= 0:
        raise ProfileError(f"{source}: tasks: the shares sum to 0")
    target = _target_rule(d.get("ttft_target"), TargetRule(), f"{source}: ttft_target")
    tasks = {t: replace(spec, target=_target_rule(tasks_d[t]["ttft_target"], target,
                                                  f"{source}: tasks.{t}.ttft_target"))
             if tasks_d[t].get("ttft_target") is not None else spec
             for t, spec in tasks.items()}
    replicas = {}
    for m, v in models_d.items():
        r = v.get("replicas", 1)
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ProfileError(f"{source}: models.{m}.replicas: must be an integer >= 1, "
                               f"got {r!r}")
        if r != 1:
            replicas[str(m)] = r
    return WorkloadProfile(str(d.get("name", source)), _num(d, "lambda", source, lo=0)
                           if "lambda" in d else 5.0e-4, models, tasks,
                           _num(d, "quality_concentration", source, lo=0.1)
                           if "quality_concentration" in d else 8.0, target, replicas)


def builtin_profiles() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in files(__package__).joinpath(
        "profiles").iterdir() if p.name.endswith(".yaml"))


def load_workload(name_or_path: str | Path) -> WorkloadProfile:
    """A built-in profile by name (``paper``, ``demo``) or a YAML file."""
    name = str(name_or_path)
    if name in builtin_profiles():
        text = files(__package__).joinpath("profiles", f"{name}.yaml").read_text()
        source = f"{name}.yaml"
    else:
        path = Path(name)
        try:
            text = path.read_text()
        except OSError as e:
            raise ProfileError(f"{name}: not a built-in workload ({', '.join(builtin_profiles())})"
                               f" nor a readable file ({e.strerror or e})") from None
        source = str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ProfileError(f"{source}: not valid YAML ({e})") from None
    return profile_from_dict(data, source)
