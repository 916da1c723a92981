"""A cheap estimate of when a new request would get its first token at an engine, kept for a
whole pool in one array, so that a router can rank hundreds of replicas with one vector
expression instead of a forecast (or a Python call) per replica.

Why an estimate and not the replay: a forecast (:mod:`duetime.engine.forecasting`) costs tens
of microseconds per instance, far too much to make for every replica of a model in a pool of
hundreds. The estimate is the replay's arithmetic without its rules: the prefill work ahead
of the probe (every prompt token not yet computed, with its attention cost, which is the same
however it is chunked: the tokens at positions c+1..P cost Σ t), the probe's own prefill, and
the decode steps of the running requests it overlaps (each runs until its predicted stop,
the same remaining-length rule as the replay's), in as many steps as the token budget needs.
It ignores what the replay adds beyond that (preemption, the queue's decodes once admitted,
the seat limit), so it is mostly a little below the forecast; it is used to *order* replicas
(which to forecast first), never as the decision's forecast.

An engine keeps its summary in a row of a :class:`LoadBoard` (``Engine.publish_load``),
refreshed by the engine itself whenever its state changes: the board is always current, and a
router reads it without touching the engines. The row holds what the estimate needs that does
not depend on the probe; :meth:`LoadBoard.estimates` adds the probe.
"""

from __future__ import annotations

import math

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine._jit import njit
from duetime.engine.remaining import DEFAULT_SIGMA, stop_length

DECODE_STEPS = 8  # decode cost kept for 1..DECODE_STEPS steps ahead (beyond: pro rata)
# row fields: the clock; prefill tokens ahead; their fixed cost (s: attention, squares and
# lengths); decoding requests; the batch-time weights the probe's part needs (w0, per prefill
# token, pre², attention, length, length²); token budget; chunk cap; then the running decodes'
# cost (s) over 1..DECODE_STEPS steps
CLOCK, AHEAD, AHEAD_S, NDEC, W0, WPRE, WSQ, WATTN, WLEN, WLSQ, BUDGET, CAP = range(12)
DEC = 12
ROW_SIZE = DEC + DECODE_STEPS


@njit(cache=True, nogil=True)
def summarize(req, pred, run, wq, st, clock, cfg, w, row):  # pragma: no cover - jit
    """Write an engine's summary into ``row`` (see the module doc for the fields)."""
    row[CLOCK] = clock[0]
    row[W0], row[WPRE], row[WSQ], row[WATTN] = w[0], w[2], w[3], w[4]
    row[WLEN], row[WLSQ] = w[6], w[7]
    row[BUDGET], row[CAP] = cfg[kn.BUDGET], cfg[kn.CAP]
    ahead = 0
    fixed = 0.0
    ndec = 0
    for s in range(DECODE_STEPS):
        row[DEC + s] = 0.0
    # the decodes that outlast the horizon (most) are summed in closed form below: how many,
    # and the sums of their lengths and squared lengths
    n_long = 0
    s1 = 0
    s2 = 0
    n = wq.shape[0]
    nrun = st[kn.NRUN]
    for k in range(nrun + st[kn.WC]):
        r = run[k] if k < nrun else wq[(st[kn.WH] + k - nrun) % n]
        prompt, out, comp = req[r, kn.PROMPT], req[r, kn.OUTPUT], req[r, kn.COMP]
        if k < nrun and out >= 1 and comp >= prompt + out - 1:  # decoding: one token a step
            ndec += 1
            left = stop_length(pred[r], out, DEFAULT_SIGMA) - out
            if left >= DECODE_STEPS:
                n_long += 1
                s1 += comp
                s2 += comp * comp
                continue
            acc = 0.0
            for s in range(DECODE_STEPS):
                if s >= left:
                    row[DEC + s] += acc
                    continue
                c = comp + s
                acc += w[1] + w[5] * c + w[6] * (c + 1) + w[7] * (c + 1) * (c + 1)
                row[DEC + s] += acc
            continue
        todo = prompt + max(out - 1, 0) - comp  # prompt (and recomputed output) tokens left
        if todo <= 0:
            continue
        ahead += todo
        total = comp + todo
        fixed += (w[4] * (todo * comp + todo * (todo + 1) / 2) + w[3] * todo * todo
                  + w[6] * total + w[7] * total * total)
    if n_long:
        # step j's cost of a decode at length x = comp + j is a + b x + c x^2, with
        # a = w1 + w6 + w7, b = w5 + w6 + 2 w7, c = w7 (the per-request sums above, summed
        # over the requests first)
        a = w[1] + w[6] + w[7]
        b = w[5] + w[6] + 2.0 * w[7]
        f1, f2 = float(s1), float(s2)
        acc = 0.0
        for j in range(DECODE_STEPS):
            acc += (n_long * a + b * (f1 + n_long * j)
                    + w[7] * (f2 + 2.0 * j * f1 + n_long * j * j))
            row[DEC + j] += acc
    row[AHEAD] = ahead
    row[AHEAD_S] = fixed
    row[NDEC] = ndec


@njit(cache=True, nogil=True)
def run_until_publishing(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb,
                         rk, adapters, t_limit, stop_on_finish, noise, pred,
                         row):  # pragma: no cover - jit
    """:func:`scheduler_kernel.run_until`, then the engine's summary into ``row``: one call where
    two cost a second dispatch (the simulator makes one per busy engine and arrival)."""
    code, detail = kn.run_until(req, stamps, run, wq, st, clock, cfg, w, work, out, pool,
                                kmap, rb, rk, None, adapters, t_limit, stop_on_finish, noise)
    summarize(req, pred, run, wq, st, clock, cfg, w, row)
    return code, detail


@njit(cache=True, nogil=True)
def estimate_rows(rows, index, prompt_tokens, now, out):  # pragma: no cover - jit
    """``out[k]``: the estimate for the engine of ``rows[index[k]]`` (see
    :meth:`LoadBoard.estimates`)."""
    p = float(prompt_tokens)
    for k in range(index.shape[0]):
        b = rows[index[k]]
        ahead = b[AHEAD] + p
        steps = max(math.ceil(ahead / max(b[BUDGET] - b[NDEC], 1.0)), math.ceil(p / b[CAP]))
        decode = b[DEC + min(steps, DECODE_STEPS) - 1] * max(steps / DECODE_STEPS, 1.0)
        probe = (b[WATTN] * (p * (p + 1) / 2) + b[WSQ] * p * p + b[WLEN] * p
                 + b[WLSQ] * p * p)
        out[k] = (max(b[CLOCK], now) - now + steps * b[W0] + b[WPRE] * ahead + b[AHEAD_S]
                  + probe + decode)


class LoadBoard:
    """The summaries of a pool's engines, one row each (``rows``), kept current by the engines
    (:meth:`attach`)."""

    def __init__(self, size: int) -> None:
        self.rows = np.zeros((size, ROW_SIZE))

    def attach(self, engine, index: int) -> None:
        """Make ``engine`` keep its summary in row ``index``."""
        engine.publish_load(self.rows[index])

    def estimates(self, index: np.ndarray, prompt_tokens: int, now: float) -> np.ndarray:
        """For the engines of rows ``index``: the estimated time (from ``now``, s) until a
        request of ``prompt_tokens`` added now gets its first token."""
        out = np.empty(len(index))
        estimate_rows(self.rows, index, prompt_tokens, now, out)
        return out
