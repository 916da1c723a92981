"""Built-in instance profiles: a named batch-time model with the scheduler config it ran under,
as :class:`~duetime.engine.spec.InstanceSpec` objects (no prices: those belong to a pool).

The measured ones (``*.yaml`` here) name the hardware they were measured on; any other
deployment of a model with a measured profile, ``MODEL@GPU[xN]`` (e.g. ``qwen3-8b@l40s``,
``qwen3-32b@a100-80gbx4``), is *derived* from it (:mod:`duetime.engine.derive`) and says so.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import yaml

from duetime.engine.batch_time import model_from_dict
from duetime.engine.config import SchedulerConfig
from duetime.engine.derive import derive, kv_blocks
from duetime.engine.hardware import Option, gpu, gpu_names, model_arch
from duetime.engine.spec import InstanceSpec

_DATA = ("gpus.yaml", "models.yaml")  # the hardware catalogue (engine/hardware.py), not profiles


@cache
def _measured() -> tuple[dict[str, InstanceSpec], dict[str, tuple[str, str, int]]]:
    out: dict[str, InstanceSpec] = {}
    hardware: dict[str, tuple[str, str, int]] = {}
    for res in sorted(files(__package__).iterdir(), key=lambda p: p.name):
        if not res.name.endswith(".yaml") or res.name in _DATA:
            continue
        for name, d in yaml.safe_load(res.read_text()).items():
            out[name] = InstanceSpec(
                name, model_from_dict(d["batch_time"], f"{res.name}:{name}.batch_time"),
                SchedulerConfig(**d["config"]), description=d.get("description", ""))
            if "hardware" in d:
                hw = d["hardware"]
                hardware[name] = (hw["model"], hw["gpu"], int(hw.get("tp", 1)))
    return out, hardware


def profile_names() -> list[str]:
    """The measured profiles' names."""
    return sorted(_measured()[0])


def measured_option(name: str) -> Option | None:
    """The hardware a measured profile was measured on (None if it does not say)."""
    hw = _measured()[1].get(name)
    return None if hw is None else Option(*hw)


def derived_profile_names(tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[str]:
    """For each model with a measured profile and each catalogue GPU, the smallest
    tensor-parallel size in ``tps`` its weights fit (a derived profile's name), unless that
    deployment is the measured one."""
    measured = {measured_option(n) for n in profile_names()}
    out = []
    for model in sorted({o.model for o in measured if o is not None}):
        arch = model_arch(model)
        for g in gpu_names():
            for tp in tps:
                opt = Option(model, g, tp)
                try:
                    kv_blocks(arch, opt, 16)
                except ValueError:
                    continue
                if opt not in measured:
                    out.append(opt.name)
                break
    return out


def load_profile(name: str) -> InstanceSpec:
    """A profile by name: a measured one (e.g. ``qwen3-8b``), or ``MODEL@GPU[xN]``: the
    measured one of that deployment, else one derived from the model's measured profile.
    Unknown names list the known ones (KeyError); a deployment whose weights do not fit its
    GPUs says so (ValueError)."""
    measured, _ = _measured()
    if name in measured:
        return measured[name]
    if "@" not in name:
        raise KeyError(f"unknown engine profile {name!r}; built-in profiles: "
                       f"{', '.join(profile_names())} (or MODEL@GPU[xN] for one derived on "
                       "other hardware, e.g. qwen3-8b@l40s)")
    try:
        target = Option.parse(name)
        gpu(target.gpu), model_arch(target.model)
    except (KeyError, ValueError) as e:
        raise KeyError(f"profile {name!r}: {e.args[0]}") from None
    refs = [(n, measured_option(n)) for n in profile_names()]
    refs = [(n, o) for n, o in refs if o is not None and o.model == target.model]
    if not refs:
        raise KeyError(f"profile {name!r}: no measured profile of {target.model} to derive "
                       "from (duetime calibrate measures one)")
    for n, o in refs:
        if o == target:
            return measured[n]
    # the nearest measurement: the same GPU, then the same tensor-parallel size
    n, o = min(refs, key=lambda r: (r[1].gpu != target.gpu, abs(r[1].tp - target.tp), r[0]))
    return derive(measured[n], o, target)
