"""What an instance of a model is, in one vocabulary for every part of duetime.

An :class:`InstanceSpec` is a model served by an engine with a known timing: its batch-time
model, its scheduler limits, its prices, and the time a request spends outside the engine loop
before its first token is back. The built-in profiles (``duetime profiles``), the workload
profiles of the simulator, the KV-lookup pool and the gateway's pool config all produce one;
:func:`resolve_spec` reads the common YAML form (a ``profile`` name, overridden by
``batch_time`` and ``config`` field by field).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from duetime.engine.batch_time import BatchTimeModel, model_from_dict
from duetime.engine.config import SchedulerConfig
from duetime.engine.frontend import FrontendModel


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """A model's instance: timing, limits, prices (USD per million tokens) and overhead."""

    name: str
    batch_time: BatchTimeModel
    config: SchedulerConfig
    price_prompt: float = 0.0
    price_output: float = 0.0
    request_overhead_s: float = 0.0
    description: str = ""
    # the serving frontend's costs (vLLM's API server: engine/frontend.py); None: not modelled
    frontend: FrontendModel | None = None
    # a profile derived for hardware nobody measured (engine/derive.py): the measured profile it
    # was scaled from; "" for a measured one
    derived_from: str = ""

    def cost(self, prompt_tokens, output_tokens):
        """Cost in micro-dollars (USD per million tokens x tokens)."""
        return self.price_prompt * prompt_tokens + self.price_output * output_tokens

    def scaled(self, speed: float) -> InstanceSpec:
        """The same instance ``speed`` times faster (its batch-time model's coefficients /
        ``speed``)."""
        return self if speed == 1.0 else replace(self, batch_time=self.batch_time.scaled(speed))

    def renamed(self, name: str) -> InstanceSpec:
        return replace(self, name=name)

    def priced(self, prompt: float, output: float) -> InstanceSpec:
        return replace(self, price_prompt=prompt, price_output=output)


def resolve_spec(name: str, *, profile: str | None = None,
                 batch_time: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, where: str = "",
                 load: Callable[[str], InstanceSpec] | None = None) -> InstanceSpec:
    """An instance spec from its YAML parts: a built-in ``profile`` (``load`` reads it; default
    :func:`duetime.engine.profiles.load_profile`), then ``batch_time`` replacing its model and
    ``config`` replacing its limits field by field. Raises ValueError naming ``where``."""
    prefix = f"{where}: " if where else ""
    model = cfg = None
    description = derived_from = ""
    if profile is not None:
        if load is None:
            from duetime.engine.profiles import load_profile as load
        try:
            base = load(profile)
        except KeyError as e:
            raise ValueError(f"{prefix}{e.args[0]}") from None
        model, cfg, description = base.batch_time, base.config, base.description
        derived_from = base.derived_from
    if batch_time is not None:
        model = model_from_dict(batch_time, f"{where}.batch_time" if where else "batch_time")
        derived_from = ""  # the user's own batch-time model: measured, not derived
    if config is not None:
        if not isinstance(config, Mapping):
            raise ValueError(f"{prefix}config: must be a mapping of scheduler limits")
        try:
            cfg = SchedulerConfig(**{**(cfg.to_dict() if cfg else {}), **config})
        except TypeError as e:
            raise ValueError(f"{prefix}config: {e}") from None
    if model is None or cfg is None:
        from duetime.engine.profiles import profile_names
        raise ValueError(f"{prefix}needs profile (a built-in engine profile: "
                         f"{', '.join(profile_names())}) or both batch_time and config (the "
                         "instance's batch-time model and scheduler config)")
    return InstanceSpec(name, model, cfg, description=description, derived_from=derived_from)
