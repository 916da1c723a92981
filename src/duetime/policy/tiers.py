"""A decision's tiers, and the least of a tier's estimates, in one compiled call each.

The feasible routers (:class:`~duetime.policy.latency.Feasible`) look at candidates best
utility first, a tier (a run of equal utility: replicas of one model at one price) at a time,
and in a tier of replicas forecast the one with the least wait estimate. Written with numpy
(a stable argsort, ``diff``, ``flatnonzero``, fancy indexing, ``tolist``) that bookkeeping
cost ~13 us a decision over 90 candidates, more than the forecast it chooses
(``benchmarks/simulate_speed.py``'s pool table); here it is two calls of ~1 us. The results
are those of the numpy expressions they replace (tested side by side), ties included.
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit


@njit(cache=True, nogil=True)
def tier_runs(u):  # pragma: no cover - jit
    """(order, ends): the candidates by utility ``u``, best first (a stable sort: equal
    utilities keep their positions' order), and where each run of equal utility in that
    order ends (exclusive), as ``np.argsort(-u, kind="stable")`` and the run ends of
    ``np.diff(u[order]) != 0``."""
    order = np.argsort(-u, kind="mergesort")
    n = order.shape[0]
    ends = np.empty(max(n, 1), dtype=np.int64)
    m = 0
    for k in range(1, n):
        if u[order[k]] != u[order[k - 1]]:
            ends[m] = k
            m += 1
    ends[m] = n
    return order, ends[:m + 1]


@njit(cache=True, nogil=True)
def least_and_ties(x):  # pragma: no cover - jit
    """(the position of the least of ``x``, how many equal it): as ``x.argmin()`` and
    ``(x == x.min()).sum()``; (0, 0) if ``x`` holds a NaN (the caller's numpy path then
    decides, as it always has)."""
    best = 0
    ties = 1
    for k in range(x.shape[0]):
        if np.isnan(x[k]):
            return 0, 0
    for k in range(1, x.shape[0]):
        if x[k] < x[best]:
            best = k
            ties = 1
        elif x[k] == x[best]:
            ties += 1
    return best, ties



def warm_up_tiers() -> None:
    """Load (or compile) these kernels for the argument types the routers pass (float
    utilities and estimates), so that a server's first request or a simulation's first
    decision does not pay it (see :func:`duetime.engine.warmup.warm_up`)."""
    u = np.array([0.5, 0.5, 0.25])
    tier_runs(u)
    least_and_ties(u)
