"""Remaining output length of a request that has already generated ``k`` tokens.

The length heads give a median and a p90 per request; read as a log-normal output length
(``mu = ln median``, ``sigma = (ln p90 - ln median) / 1.2816``), the tokens still to come follow
the one remaining-length rule of :mod:`duetime.engine.remaining` (the conditional mean or median
given that ``k`` tokens were made without stopping; at least one token always remains). The
engine's ``stop_length`` applies the same rule with a fixed sigma; here sigma comes from each
request's own p90.
"""

from __future__ import annotations

import math

import numpy as np

from duetime.engine.remaining import remaining_after

Z90 = 1.2815515655446004
MIN_SIGMA = 0.05


def remaining_one(median: float, p90: float, generated: float, statistic: str = "mean") -> float:
    """Tokens still to come for one request and model (see the module docstring)."""
    median = max(float(median), 1.0)
    sigma = max((math.log(max(p90, median)) - math.log(median)) / Z90, MIN_SIGMA)
    return remaining_after(median, sigma, float(generated), statistic)


def remaining_tokens(median: np.ndarray, p90: np.ndarray, generated: float,
                     statistic: str = "mean") -> np.ndarray:
    """:func:`remaining_one` for each model's (median, p90)."""
    return np.array([remaining_one(m, p, generated, statistic)
                     for m, p in zip(np.atleast_1d(median), np.atleast_1d(p90), strict=True)])
