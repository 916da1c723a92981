"""Paper-like synthetic snapshots, for benchmarks, demos and tests.

Prompt lengths follow the released SFS calibration mix (``docs/simulator.md``, "The papers'
parameters":
49.9% <= 128 tokens, 0.3% 128-512, 23.1% 512-2k, 13.6% 2k-8k, 12.9% 8k-32k, 0.2% > 32k),
log-uniform within a bin; output lengths are log-uniform on 100..1000 tokens (the paper's
"responses ~1e2..1e3"). Running requests are decoding at a uniform point of their output,
except the newest, which may be mid-prefill (as vLLM leaves a partly admitted prompt).
"""

from __future__ import annotations

import math
import random

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.snapshot import ResidentRequest, Snapshot

PROMPT_BINS: tuple[tuple[float, int, int], ...] = (
    (0.499, 8, 128), (0.003, 129, 512), (0.231, 513, 2048), (0.136, 2049, 8192),
    (0.129, 8193, 32768), (0.002, 32769, 65536))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def sample_prompt_tokens(rng: random.Random, max_tokens: int | None = None) -> int:
    """A prompt length from the released calibration mix."""
    u = rng.random() * sum(w for w, _, _ in PROMPT_BINS)
    lo, hi = PROMPT_BINS[-1][1:]
    for w, b_lo, b_hi in PROMPT_BINS:
        u -= w
        if u <= 0:
            lo, hi = b_lo, b_hi
            break
    p = _log_uniform(rng, lo, hi)
    return min(p, max_tokens) if max_tokens else p


def sample_output_tokens(rng: random.Random) -> int:
    return _log_uniform(rng, 100, 1000)


def paper_like_snapshot(rng: random.Random, model: BatchTimeModel, *, n_running: int = 200,
                        n_waiting: int = 20, config: SchedulerConfig | None = None,
                        time: float = 0.0) -> Snapshot:
    """A snapshot of a busy instance with paper-like request lengths."""
    cfg = config or SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256,
                                    max_model_len=131072, block_size=16,
                                    num_gpu_blocks=100_000)
    limit = cfg.max_model_len - 1001
    running = []
    for i in range(n_running):
        p = sample_prompt_tokens(rng, limit)
        t = sample_output_tokens(rng)
        if i == n_running - 1 and rng.random() < 0.5:  # newest: a partial prefill
            running.append(ResidentRequest(f"r{i}", p, rng.randint(0, p - 1), 0, t,
                                           time - rng.uniform(0, 1)))
            continue
        o = rng.randint(1, t - 1)
        running.append(ResidentRequest(f"r{i}", p, p + o - 1, o, t, time - rng.uniform(0, 60)))
    waiting = [ResidentRequest(f"w{i}", sample_prompt_tokens(rng, limit), 0, 0,
                               sample_output_tokens(rng), time - rng.uniform(0, 1))
               for i in range(n_waiting)]
    return Snapshot(cfg, model, time=time, running=running, waiting=waiting)
