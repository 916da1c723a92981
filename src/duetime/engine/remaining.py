"""How long a request that has outlived its predicted length will still run.

A forecast must not treat a running request that already produced its predicted output length
as finished: it is still in the batch. The rule here treats the prediction as the *median* of a
log-normal output length with log-space spread ``sigma`` and takes the conditional mean given the
tokens already produced::

    E[L | L > k] = exp(mu + sigma²/2) · Q(z - sigma) / Q(z),   mu = ln(predicted),
                   z = (ln k - mu) / sigma,                      Q = upper normal tail

and the stop length is ``k + max(1, ceil(E[L | L > k] - k))``. With sigma = 0.5 a request that
just reached its prediction is expected to run ~0.57x the prediction more, and the expected
remainder grows slowly with how far past the prediction it is (a long tail), never below one
token. Requests that have not reached their prediction keep it.
"""

from __future__ import annotations

import math

from duetime.engine._jit import njit

DEFAULT_SIGMA = 0.5


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
    mu = math.log(predicted)
    # Beyond z ~ 25 both tails underflow; such a request is 2.7e5x past its prediction.
    z = min((math.log(produced) - mu) / sigma, 25.0)
    r2 = math.sqrt(2.0)
    tail_ratio = math.erfc((z - sigma) / r2) / math.erfc(z / r2)
    mean = math.exp(mu + 0.5 * sigma * sigma) * tail_ratio
    return produced + max(1, math.ceil(mean - produced))
