"""Profiles for hardware nobody measured: a measured profile's batch-time terms scaled to
another GPU, tensor-parallel size or model, and the KV cache the new deployment holds.

Each coefficient of a batch-time model bounds one kind of work (``BatchTimeModel.term_kinds``),
and each kind scales by what limits it on a GPU:

- ``compute`` (per token: the weights' matrix products) by the model's active parameters over
  the GPUs' dense BF16 FLOP/s;
- ``attention`` (per token pair) by layers x query heads x head dim over the FLOP/s;
- ``kv`` (per cached token read) by the KV bytes per token over the memory bandwidth;
- ``step`` (a step's fixed cost) split in two: a host part (the scheduler, the kernel
  launches: :data:`STEP_HOST_S`, unchanged by the GPU) and one read of the active weights,
  which scales by bytes over bandwidth.

Tensor parallelism multiplies FLOP/s and bandwidth by the GPU count; its all-reduces are not
modelled (the measured 32B profile on two H100 carries them in its terms). The KV cache is what
vLLM would allocate: :data:`MEMORY_UTILIZATION` of the GPUs' memory less the weights, in blocks
of the reference's block size; activations and CUDA graphs are not subtracted (nor were they in
the measured profiles' block counts). A KV cache that cannot hold one ``max_model_len``
sequence gets ``max_model_len`` lowered to what it holds, as an operator must for vLLM to
start. A derived profile is labelled as such (``InstanceSpec.derived_from``) everywhere it is
listed. ``benchmarks/derived_profiles.py`` measures what this gets right and wrong on the
measured H100 profiles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from duetime.engine.config import NULL_BLOCKS
from duetime.engine.hardware import ModelArch, Option, gpu, model_arch
from duetime.engine.spec import InstanceSpec

MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
# the host part of a step's fixed cost: the measured qwen3-0.6b profile's c0 (2.58 ms) less
# one read of its active weights at an H100's bandwidth (1.19 GB / 3.35 TB/s = 0.36 ms)
STEP_HOST_S = 2.2e-3
KINDS = ("step", "compute", "attention", "kv")


def kv_blocks(arch: ModelArch, option: Option, block_size: int) -> int:
    """The KV blocks vLLM would allocate for ``arch`` on ``option``'s GPUs (the null block
    included, as ``num_gpu_blocks`` counts it); ValueError if the weights do not fit."""
    g = gpu(option.gpu)
    room = MEMORY_UTILIZATION * g.memory_bytes * option.tp - arch.weight_bytes
    if room <= 0:
        raise ValueError(f"{option.name}: the weights ({arch.weight_bytes / 1e9:.1f} GB) do not "
                         f"fit {MEMORY_UTILIZATION:g} x {option.tp} x {g.memory_gb:g} GB; more "
                         "GPUs (a larger tensor-parallel size) or a larger GPU")
    return int(room // (arch.kv_bytes_per_token * block_size))


def scale_factors(ref: Option, target: Option) -> dict[str, float]:
    """Per term kind, target's work time over the reference's (``step``: its weights' read)."""
    ra, ta = model_arch(ref.model), model_arch(target.model)
    rg, tg = gpu(ref.gpu), gpu(target.gpu)
    flops = (rg.flops * ref.tp) / (tg.flops * target.tp)
    bandwidth = (rg.bandwidth * ref.tp) / (tg.bandwidth * target.tp)
    return {"compute": ta.active_params / ra.active_params * flops,
            "attention": ta.attention_width / ra.attention_width * flops,
            "kv": ta.kv_bytes_per_token / ra.kv_bytes_per_token * bandwidth,
            "step": ta.active_params / ra.active_params * bandwidth}


def derive(ref: InstanceSpec, ref_option: Option, target: Option) -> InstanceSpec:
    """``ref`` (measured on ``ref_option``) scaled to ``target``: see the module doc."""
    factors = scale_factors(ref_option, target)
    model = ref.batch_time
    coefficients: Mapping[str, float] = model.coefficients
    scaled = {}
    for name, value in coefficients.items():
        kind = model.term_kinds[name]
        if kind == "step":
            host = min(STEP_HOST_S, value)
            scaled[name] = host + (value - host) * factors["step"]
        else:
            scaled[name] = value * factors[kind]
    cfg = ref.config
    blocks = kv_blocks(model_arch(target.model), target, cfg.block_size)
    if blocks <= NULL_BLOCKS + 1:
        raise ValueError(f"{target.name}: room for {blocks} KV blocks only")
    holds = (blocks - NULL_BLOCKS) * cfg.block_size
    cfg = replace(cfg, num_gpu_blocks=blocks, max_model_len=min(cfg.max_model_len, holds))
    g = gpu(target.gpu)
    where = f"{target.tp} x {g.description}" if target.tp > 1 else f"one {g.description}"
    return replace(ref, name=target.name, batch_time=type(model)(**scaled), config=cfg,
                   description=f"{target.model} on {where}, derived from {ref.name} "
                               f"(measured on {ref_option.name})",
                   derived_from=ref.name)
