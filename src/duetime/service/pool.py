"""Pool configs with embedded instances: the gateway's pool config, plus each ``emulate:``
block validated as the emulator's options (errors name the file, the field and the reason,
as the gateway's own do)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from duetime.emulator.options import EmulatorOptions
from duetime.gateway.config import ConfigError, Pool, format_errors
from duetime.gateway.config import load_pool as load_gateway_pool
from duetime.gateway.config import pool_from_dict as gateway_pool_from_dict
from duetime.gateway.config import pool_from_text as gateway_pool_from_text

DEMO_MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")


def embedded_options(pool: Pool) -> dict[str, EmulatorOptions]:
    """The emulator options of each embedded instance, by instance name; ConfigError if any
    ``emulate:`` block is not valid emulator options."""
    out = {}
    for i, inst in enumerate(pool.instances):
        if inst.emulate is None:
            continue
        try:
            out[inst.name] = EmulatorOptions.model_validate(inst.emulate)
        except ValidationError as e:
            raise ConfigError(format_errors(e, pool.source, f"instances[{i}].emulate")) from None
    return out


def _with_embedded_caching(pool: Pool) -> Pool:
    """An embedded instance caches prefixes as its emulator options say (on unless false, as
    vLLM): its spec says so too, so the gateway's replica of it caches (its estimated view of
    the cache: :mod:`duetime.gateway.state.shadow`)."""
    opts = embedded_options(pool)
    insts = []
    for inst in pool.instances:
        o = opts.get(inst.name)
        if o is not None and inst.config.enable_prefix_caching != o.enable_prefix_caching:
            cfg = replace(inst.config, enable_prefix_caching=o.enable_prefix_caching)
            inst = replace(inst, spec=replace(inst.spec, config=cfg))
        insts.append(inst)
    return replace(pool, instances=tuple(insts))


def pool_from_dict(data: Any, source: str = "pool") -> Pool:
    """:func:`duetime.gateway.pool_from_dict`, with the embedded instances' options checked
    (and their prefix caching in their specs)."""
    return _with_embedded_caching(gateway_pool_from_dict(data, source))


def load_pool(path: str | Path) -> Pool:
    """:func:`duetime.gateway.load_pool`, with the embedded instances' options checked (and
    their prefix caching in their specs)."""
    return _with_embedded_caching(load_gateway_pool(path))


def pool_from_text(text: str, source: str) -> Pool:
    """:func:`duetime.gateway.config.pool_from_text`, with the embedded instances' options
    checked (and their prefix caching in their specs)."""
    return _with_embedded_caching(gateway_pool_from_text(text, source))


# one replica's requests/s at 95% on time under sfs on the paper's workload, H100 timing:
# duetime.experiments.capacity.replica_capacity(load_workload("paper"), "sfs", requests=1500)
# (the `autoscale` experiment prints it); the demo pool's desired-replica signal sizes from it
DEMO_CAPACITY = {"qwen3-0.6b": 2.09, "qwen3-8b": 1.24, "qwen3-32b": 14.45}


def demo_pool(*, speed: float = 1.0, policy: str = "sfs", replicas: int = 1) -> Pool:
    """Three emulated instances (Qwen3 0.6B / 8B / 32B on H100 timing), the paper's prices and
    accuracies; ``replicas`` instances of each (``qwen3-8b.0``, ...) when more than one. Its
    desired-replica signal: duetime's autoscaler on :data:`DEMO_CAPACITY` (x ``speed``)."""
    return pool_from_dict({
        "policy": policy,
        "autoscale": {"capacity": {m: c * speed for m, c in DEMO_CAPACITY.items()}},
        "instances": [{"name": m, "model": m, "replicas": replicas,
                       "emulate": {"speed": speed, "seed": k * replicas}}
                      for k, m in enumerate(DEMO_MODELS)],
    }, "demo pool")
