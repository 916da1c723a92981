"""The options of an emulated instance, as a pool config's ``emulate:`` block gives them (the
service that embeds emulators validates them with this model)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from duetime.emulator.core import FAULT_KINDS, Emulator, Faults, LoraModule
from duetime.engine.spec import InstanceSpec


class EmulatorOptions(BaseModel):
    """``emulate: {speed, seed, output_median, fail_rate, fail_kinds,
    enable_prefix_caching}`` (prefix caching on unless false, as in vLLM)."""

    model_config = ConfigDict(extra="forbid")
    speed: float = Field(1.0, gt=0)
    seed: int = 0
    output_median: float = Field(200.0, gt=0)
    fail_rate: float = Field(0.0, ge=0, le=1)
    fail_kinds: list[str] = ["5xx"]
    enable_prefix_caching: bool = True

    @field_validator("fail_kinds")
    @classmethod
    def _kinds(cls, v: list[str]) -> list[str]:
        bad = [k for k in v if k not in FAULT_KINDS]
        if bad or not v:
            raise ValueError(f"must be among {', '.join(FAULT_KINDS)}, got {v}")
        return v

    def emulator(self, spec: InstanceSpec, model_name: str,
                 adapters: Sequence[str] = ()) -> Emulator:
        """An emulator of ``spec`` (its unscaled timing; ``speed`` applies here) serving
        ``model_name`` and, with the config's ``max_loras``, the LoRA ``adapters`` (as if
        started with ``--lora-modules NAME=/adapters/NAME``; loaded in order: ids 1, 2, ...)."""
        return Emulator(spec.batch_time, spec.config, model_name=model_name, speed=self.speed,
                        seed=self.seed, output_median=self.output_median,
                        faults=Faults(self.fail_rate, tuple(self.fail_kinds)),
                        enable_prefix_caching=self.enable_prefix_caching,
                        frontend=spec.frontend, max_loras=spec.config.max_loras,
                        lora_modules=[LoraModule(a, f"/adapters/{a}") for a in adapters])
