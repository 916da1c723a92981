"""Prompt-length buckets: the nearest power of two of the token count, from 16 to 131072.

Why powers of two with edges *between* them (2^(k±0.5)) rather than at them: long-context
workloads cut prompts at 4K, 8K, 16K, ... tokens (LAAR's contexts), and a count measured a few
tokens either side of 4096 must land in one bucket, not two. The SFS paper's bins (<=128,
128-512, 512-2k, 2k-8k, 8k-32k, >32k) are unions of these buckets.
"""

from __future__ import annotations

import math

MIN_EXP = 4    # bucket 0: up to 22 tokens (~16)
MAX_EXP = 17   # the last bucket: 92682 tokens and more (~131072)
N_BUCKETS = MAX_EXP - MIN_EXP + 1


def length_bucket(tokens: int) -> int:
    """0 .. N_BUCKETS-1: round(log2(tokens)) clipped to [MIN_EXP, MAX_EXP], minus MIN_EXP."""
    if tokens <= 1:
        return 0
    e = math.floor(math.log2(tokens) + 0.5)
    return min(max(e, MIN_EXP), MAX_EXP) - MIN_EXP


def bucket_label(bucket: int) -> str:
    """A human name: the power of two the bucket is centred on, e.g. ``~4096``."""
    return f"~{2 ** (bucket + MIN_EXP)}"
