"""Retry-aware routing: llm-d session affinity, LAAR, and duetime's expected-TTCA router.

When a wrong answer triggers a retry, the time to a *correct* answer is what the user waits.
For a request ``x`` and model ``m`` with success probability Q(m, x) and latency L(m, x),
trying models in order of increasing L/Q minimises the expected time to the first success
(independent attempts); LAAR ranks by this ratio with a cheap latency proxy, ``ttca`` with the
engine's end-to-end forecast. Decoding is deterministic: a model that failed a request fails it
again, so already-attempted models are penalised (LAAR) or excluded (ttca).
"""

from __future__ import annotations

import numpy as np

from duetime.engine.forecasting import ForecastError, forecast
from duetime.estimate.throughput import profile_rates
from duetime.policy.balancing import LoadAware
from duetime.policy.base import Candidate, Decision, Policy, RoutingRequest

ATTEMPTED_PENALTY = 100.0  # LAAR: cost multiplier for a model already tried for the request


def queued_tokens(view) -> int:
    """Tokens being processed or waiting at an instance: remaining prefill of every resident
    request plus the predicted remaining outputs (from its snapshot)."""
    snap = view.snapshot()
    total = 0
    for tab in (snap.running_table, snap.waiting_table):
        total += int((tab.prompt + tab.output - tab.computed).sum())
        total += int(np.maximum(tab.predicted - tab.output, 0).sum())
    return total


class SessionAffinity(Policy):
    """llm-d session affinity: a session's first request as ``load-aware``; later ones (its
    retries) go to the same instance."""

    name = "session-affinity"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._first = LoadAware(**kw)
        self._bound: dict[str, str] = {}

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        if req.session is not None and req.session in self._bound:
            names = [c.name for c in cands]
            if self._bound[req.session] in names:
                return Decision(names.index(self._bound[req.session]))
        d = self._first.choose(req, cands, now)
        if req.session is not None:
            self._bound[req.session] = cands[d.index].name
        return d


class Laar(Policy):
    """LAAR: argmin L/Q with L = c(m)·(T(x) + alpha·R(m)).

    c(m): seconds per token from the instance's offline profile (its prefill rate: long-context
    requests are prefill-bound); T(x): the request's tokens (prompt + predicted output);
    R(m): tokens queued or in process at m; Q: the predicted success probability
    (``RoutingRequest.quality``); models already attempted pay ``ATTEMPTED_PENALTY``.
    """

    name = "laar"

    def __init__(self, alpha: float = 0.7, **kw) -> None:
        super().__init__(**kw)
        self.alpha = alpha

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        cost = np.empty(len(cands))
        for i, c in enumerate(cands):
            snap = c.view.snapshot()
            per_token = 1.0 / profile_rates(snap.model, snap.config)[0]
            t_x = req.prompt_tokens + float(req.output_tokens[i])
            lat = per_token * (t_x + self.alpha * queued_tokens(c.view))
            cost[i] = lat / max(float(req.quality[i]), 1e-6)
            if c.model in req.attempted:
                cost[i] *= ATTEMPTED_PENALTY
        return Decision(self._argmax_random(-cost))


class ExpectedTtca(Policy):
    """``ttca``: argmin over models not yet attempted of L/Q, with L the engine's end-to-end
    forecast (SFS replay until the request would finish) and Q the predicted success
    probability. With every model attempted, the fastest forecast."""

    name = "ttca"

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        lat = np.empty(len(cands))
        for i, c in enumerate(cands):
            snap = c.view.snapshot()
            try:
                lat[i] = forecast(snap, req.prompt_tokens, int(req.output_tokens[i]),
                                  until="finish").estimate_s + (snap.time - now)
            except ForecastError:
                lat[i] = np.inf
        fresh = np.array([c.model not in req.attempted for c in cands])
        if not fresh.any():
            i = int(np.argmin(lat))
            return Decision(i, float(lat[i]))
        q = np.maximum(np.asarray(req.quality, dtype=float), 1e-6)
        score = np.where(fresh, lat / q, np.inf)
        i = int(np.argmin(score))
        return Decision(i, float(lat[i]))
