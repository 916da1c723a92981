"""How long a request that has already produced tokens will still run: the one remaining-length
rule of duetime, used by the engine's forecasts and by the request predictors.

An output length is read as a log-normal with median ``m`` (``mu = ln m``) and log-space spread
``sigma``. Given that ``k`` tokens were made without stopping, its expected total is::

    E[L | L > k] = exp(mu + sigma²/2) · Q(z - sigma) / Q(z),   z = (ln k - mu) / sigma

(``Q`` the upper normal tail). Far in the tail (z >= 25, where the tails underflow) the ratio is
replaced by its Mills-ratio limit, ``E[L | L > k] ≈ k · z / (z - sigma)``. The median of the
conditional length (for the predictors' ``median`` statistic) is
``exp(mu + sigma · Φ⁻¹(1 - Q(z)/2))``.

The engine applies it with the prediction as the median and a fixed ``sigma`` (0.5) to requests
that have outlived their predicted length: a forecast must not treat such a request as finished,
it is still in the batch (:func:`stop_length`: with sigma = 0.5 a request that just reached its
prediction is expected to run ~0.57x the prediction more, and the expected remainder grows
slowly with how far past the prediction it is, never below one token). The predictors apply it
with a sigma per request, from their p90 head (:mod:`duetime.predict.remaining`).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from duetime.engine._jit import njit

DEFAULT_SIGMA = 0.5
TAIL_Z = 25.0
MEDIAN_TAIL_Z = 8.0
_NORMAL = NormalDist()


@njit(cache=True, nogil=True)
def tail_mean(median: float, sigma: float, k: float) -> float:  # pragma: no cover - jit
    """E[L | L > k] for L log-normal with this median and sigma (k >= 1, sigma > 0)."""
    mu = math.log(median)
    z = (math.log(k) - mu) / sigma
    if z >= TAIL_Z:
        return k * z / (z - sigma)
    r2 = math.sqrt(2.0)
    return math.exp(mu + 0.5 * sigma * sigma) * (math.erfc((z - sigma) / r2)
                                                 / math.erfc(z / r2))


@njit(cache=True, nogil=True)
def stop_length(predicted: int, produced: int, sigma: float = DEFAULT_SIGMA) -> int:
    """The output length a forecast assumes a request stops at.

    ``predicted`` is the predicted total output length, ``produced`` the tokens already made.
    (Compiled: the replay kernel applies it to every resident request.)
    """
    if produced < predicted:
        return predicted
    if produced < 1 or sigma <= 0:
        return produced + 1
    return produced + max(1, math.ceil(tail_mean(predicted, sigma, produced) - produced))


def remaining_after(median: float, sigma: float, generated: float,
                    statistic: str = "mean") -> float:
    """Tokens still to come of a request ``generated`` tokens in, whose output length is
    log-normal with this median and sigma: the conditional ``mean`` or ``median``; at least 1
    (the request has not stopped)."""
    if statistic not in ("mean", "median"):
        raise ValueError(f"statistic must be 'mean' or 'median', got {statistic!r}")
    mu = math.log(median)
    if generated < 1:
        total = math.exp(mu + 0.5 * sigma * sigma) if statistic == "mean" else median
        return max(1.0, total - max(generated, 0.0))
    if statistic == "mean":
        total = tail_mean(median, sigma, generated)
    else:
        z = (math.log(generated) - mu) / sigma
        if z < MEDIAN_TAIL_Z:
            u = _NORMAL.inv_cdf(1.0 - 0.25 * math.erfc(z / math.sqrt(2.0)))
        else:  # 1 - Q(z)/2 rounds to 1: the quantile's asymptote
            u = z + math.log(2.0) / z
        total = math.exp(mu + sigma * u)
    return max(1.0, total - generated)
