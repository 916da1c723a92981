"""The prefill-throughput estimator (the SFS paper's baseline): queued prefill tokens divided
by a profiled prefill rate, plus a mean decode-step time for the first token."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.estimate.base import InstanceView, PromptHashes, with_gateway


@lru_cache(maxsize=64)
def profile_rates(model: BatchTimeModel, config: SchedulerConfig, *, chunk: int = 2048,
                  decoders: int = 32, context: int = 1000) -> tuple[float, float]:
    """(prefill tokens/s, mean decode-step seconds) as offline profiling would measure them:
    a prefill-only batch of ``chunk`` fresh tokens, and a decode batch of ``decoders`` requests
    at ``context`` tokens."""
    chunk = min(chunk, config.max_num_batched_tokens)
    pre = model.duration(0, chunk, chunk * chunk, chunk * (chunk + 1) // 2, 0, chunk,
                         chunk * chunk)
    n, c = decoders, context
    dec = model.duration(n, 0, 0, 0, n * c, n * (c + 1), n * (c + 1) ** 2)
    return chunk / pre, dec


class ThroughputEstimator:
    """Rates are profiled from the instance's (calibrated) batch-time model, see
    :func:`profile_rates`."""

    name = "throughput"

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float, *,
             hashes: PromptHashes | None = None, lora: int = 0) -> float:
        snap = view.snapshot()
        prefill_rate, decode_step_s = profile_rates(snap.model, snap.config)
        queued = 0
        for tab in (snap.running_table, snap.waiting_table):
            todo = tab.prompt + tab.output - tab.computed
            queued += int(np.where(todo > 1, todo, 0).sum())  # decoders have 1 left: not prefill
        return with_gateway(view, (queued + prompt_tokens) / prefill_rate + decode_step_s
                            + max(0.0, snap.time - now) + view.request_overhead_s)
