"""Remaining output length of a request that has already generated ``k`` tokens.

The length heads give a median and a p90 per request; read as a log-normal output length
(``mu = ln median``, ``sigma = (ln p90 - ln median) / 1.2816``), the tokens still to come
given that ``k`` were made without stopping are::

    mean:   E[L | L > k] - k = exp(mu + sigma²/2) · Q(z - sigma) / Q(z) - k,  z = (ln k - mu)/sigma
    median: exp(mu + sigma · Φ⁻¹(1 - Q(z)/2)) - k

(``Q`` the upper normal tail). Far in the tail (z > 8) the ratio of tails is replaced by its
Mills-ratio limit, ``E[L | L > k] ≈ k · z / (z - sigma)``, so the estimate never divides
zero by zero. At least one token always remains (the request has not stopped). This is the
same log-normal reading the engine's ``stop_length`` applies with a fixed sigma; here sigma
comes from each request's own p90.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

Z90 = 1.2815515655446004
MIN_SIGMA = 0.05
_TAIL_Z = 8.0
_NORMAL = NormalDist()


def _q(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def remaining_one(median: float, p90: float, generated: float, statistic: str = "mean") -> float:
    """Tokens still to come for one request and model (see the module docstring)."""
    median = max(float(median), 1.0)
    sigma = max((math.log(max(p90, median)) - math.log(median)) / Z90, MIN_SIGMA)
    mu = math.log(median)
    if generated < 1:
        total = math.exp(mu + 0.5 * sigma * sigma) if statistic == "mean" else median
        return max(1.0, total - max(generated, 0.0))
    z = (math.log(generated) - mu) / sigma
    if statistic == "mean":
        if z < _TAIL_Z:
            total = math.exp(mu + 0.5 * sigma * sigma) * _q(z - sigma) / _q(z)
        else:
            total = generated * z / (z - sigma)
    elif statistic == "median":
        q = _q(z)
        u = _NORMAL.inv_cdf(1.0 - 0.5 * q) if z < _TAIL_Z else z + math.log(2.0) / z
        total = math.exp(mu + sigma * u)
    else:
        raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
    return max(1.0, total - generated)


def remaining_tokens(median: np.ndarray, p90: np.ndarray, generated: float,
                     statistic: str = "mean") -> np.ndarray:
    """:func:`remaining_one` for each model's (median, p90)."""
    return np.array([remaining_one(m, p, generated, statistic)
                     for m, p in zip(np.atleast_1d(median), np.atleast_1d(p90), strict=True)])
