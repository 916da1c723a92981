"""Retry-aware routing: llm-d session affinity, LAAR, and duetime's expected-TTCA router.

When a wrong answer triggers a retry, the time to a *correct* answer is what the user waits.
For a request ``x`` and model ``m`` with success probability Q(m, x) and latency L(m, x),
trying models in order of increasing L/Q minimises the expected time to the first success
(independent attempts); LAAR ranks by this ratio with a cheap latency proxy
(:class:`~duetime.estimate.laar.LaarLatency`), ``ttca`` with the engine's end-to-end forecast
(:meth:`~duetime.estimate.sfs.SfsEstimator.e2e`). Decoding is deterministic: a model that
failed a request fails it again, so already-attempted models are penalised (LAAR) or excluded
(ttca).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import MutableMapping

import numpy as np

from duetime.estimate import LaarLatency, SfsEstimator
from duetime.estimate.base import lora_kw
from duetime.policy.balancing import LoadAware
from duetime.policy.base import Candidate, Decision, Described, Policy, RoutingRequest
from duetime.policy.registry import (
    LOAD,
    OUTPUT_LENGTH,
    SEED,
    SESSIONS,
    SNAPSHOT,
    SUCCESS,
    Param,
)

ATTEMPTED_PENALTY = 100.0  # LAAR: cost multiplier for a model already tried for the request


class SessionAffinity(Policy):
    """llm-d session affinity: a session's first request as ``load-aware``; later ones (its
    retries) go to the same instance."""

    name = "session-affinity"
    summary = "a session's first request as load-aware; its later ones to the same instance"
    consumes = frozenset({LOAD, SESSIONS})

    def __init__(self, *, seed: int = 0,
                 bindings: MutableMapping[str, str] | None = None) -> None:
        """``bindings``: session -> instance name, provided by a caller that shares them (a
        gateway whose replicas share state); else the policy's own, bounded."""
        super().__init__(seed=seed)
        self._first = LoadAware(seed=seed)
        self.bindings: MutableMapping[str, str] = (
            bindings if bindings is not None else BoundedDict(MAX_SESSIONS))

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        bound = None if req.session is None else self.bindings.get(req.session)
        if bound is not None:
            names = [c.name for c in cands]
            if bound in names:
                return Decision(names.index(bound))
        d = self._first.choose(req, cands, now)
        if req.session is not None:
            self.bindings[req.session] = cands[d.index].name
        return d

    def _bound(self, req: RoutingRequest, cands: list[Candidate]) -> int | None:
        """The candidate the request's session is bound to, if it is one of them."""
        bound = None if req.session is None else self.bindings.get(req.session)
        names = [c.name for c in cands]
        return names.index(bound) if bound in names else None

    def peek(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        i = self._bound(req, cands)
        return Decision(i) if i is not None else self._first.preview(req, cands, now)

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        d = self._first.describe(req, cands, now, chosen)
        if self._bound(req, cands) == chosen:
            d.rule = f"the instance session {req.session!r} is bound to"
        else:
            d.rule = "a session's first request: " + d.rule
        return d


MAX_SESSIONS = 100_000  # sessions remembered (the least recently bound are forgotten first)


class BoundedDict(OrderedDict[str, str]):
    """A dict that forgets its oldest entries past ``limit`` (a gateway sees sessions
    without end; an unbounded map of them grows without end)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


ALPHA = Param("alpha", "alpha", float, 0.7, "laar's weight of the tokens queued at an instance",
              min=0.0)


class Laar(Policy):
    """LAAR: argmin L/Q with L = c(m)·(T(x) + alpha·R(m)) (:class:`LaarLatency`) and Q the
    predicted success probability; models already attempted pay ``ATTEMPTED_PENALTY``."""

    name = "laar"
    summary = ("LAAR: the least L/Q, L = c(m) (T(x) + alpha R(m)), Q the success probability; "
               "models already attempted pay a penalty")
    params = (SEED, ALPHA)
    consumes = frozenset({SNAPSHOT, SUCCESS, OUTPUT_LENGTH})

    def __init__(self, *, seed: int = 0, alpha: float = ALPHA.default) -> None:
        super().__init__(seed=seed)
        self.alpha = alpha
        self.latency = LaarLatency(alpha)

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        assert req.success is not None
        cost = np.empty(len(cands))
        for i, c in enumerate(cands):
            lat = self.latency.latency(c.view, req.prompt_tokens, float(req.output_tokens[i]))
            cost[i] = lat / max(float(req.success[i]), 1e-6)
            if c.model in req.attempted:
                cost[i] *= ATTEMPTED_PENALTY
        return Decision(self._argmax_random(-cost))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        assert req.success is not None
        lat = [self.latency.latency(c.view, req.prompt_tokens, float(req.output_tokens[i]))
               for i, c in enumerate(cands)]
        score = [x / max(float(q), 1e-6) * (ATTEMPTED_PENALTY if c.model in req.attempted
                                              else 1.0)
                 for x, q, c in zip(lat, req.success, cands, strict=True)]
        return Described({"latency_proxy": lat, "score": score}, "L/Q", "lower",
                         f"the least L/Q, L = c(m) (T(x) + {self.alpha:g} R(m)); models "
                         f"already attempted pay x{ATTEMPTED_PENALTY:g}")


class ExpectedTtca(Policy):
    """``ttca``: argmin over models not yet attempted of L/Q, with L the engine's end-to-end
    forecast (SFS replay until the request would finish) and Q the predicted success
    probability. With every model attempted, the fastest forecast."""

    name = "ttca"
    summary = ("the least expected time to a correct answer: L/Q over the models not yet "
               "attempted, L the engine's end-to-end forecast")
    consumes = frozenset({SNAPSHOT, SUCCESS, OUTPUT_LENGTH})

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.estimator = SfsEstimator()

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        assert req.success is not None
        lat = np.array([self.estimator.e2e(c.view, req.prompt_tokens, int(req.output_tokens[i]),
                                           now, hashes=req.prompt_hashes,
                                           **lora_kw(req.lora))
                        for i, c in enumerate(cands)])
        fresh = np.array([c.model not in req.attempted for c in cands])
        if not fresh.any():
            i = int(np.argmin(lat))
            return Decision(i, float(lat[i]))
        q = np.maximum(np.asarray(req.success, dtype=float), 1e-6)
        score = np.where(fresh, lat / q, np.inf)
        i = int(np.argmin(score))
        return Decision(i, float(lat[i]))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        assert req.success is not None
        lat = [self.estimator.e2e(c.view, req.prompt_tokens, int(req.output_tokens[i]), now,
                                  hashes=req.prompt_hashes, **lora_kw(req.lora))
               for i, c in enumerate(cands)]
        fresh = [c.model not in req.attempted for c in cands]
        score = [x / max(float(q), 1e-6) if f else None
                 for x, q, f in zip(lat, req.success, fresh, strict=True)]
        rule = ("the least expected time to a correct answer, L/Q, among the models not yet "
                "attempted (L: the engine's end-to-end forecast)" if any(fresh) else
                "every model attempted: the least end-to-end forecast")
        return Described({"forecast_e2e_s": lat, "score": score}, "L/Q", "lower", rule)
