"""Utility routers: latency-agnostic, and those that keep a forecast TTFT under the target
(SFS and its baselines with coarser estimators), plus the soft trade-off ``sfs-soft``."""

from __future__ import annotations

import numpy as np

from duetime.estimate.base import Estimator
from duetime.policy.base import Candidate, Decision, Policy, RoutingRequest, utility


class LatencyAgnostic(Policy):
    """argmax U = acc - lambda * cost."""

    name = "latency-agnostic"

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        return Decision(self._argmax_random(utility(req, cands, self.lam)))


class Feasible(Policy):
    """argmax U over instances whose forecast TTFT <= target; if none, the least forecast.

    With the SFS estimator this is ``sfs``; with the throughput or LPS estimators it is the
    paper's baselines ``throughput`` and ``lps``.
    """

    def __init__(self, estimator: Estimator, **kw) -> None:
        super().__init__(**kw)
        self.estimator = estimator
        self.name = estimator.name

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        u = utility(req, cands, self.lam)
        # Best utility first; forecast lazily until one meets the target.
        forecasts = np.full(len(cands), np.inf)
        for i in np.argsort(-u, kind="stable").tolist():
            forecasts[i] = self.estimator.ttft(cands[i].view, req.prompt_tokens, now)
            if forecasts[i] <= req.ttft_target:
                return Decision(i, float(forecasts[i]))
        i = int(np.argmin(forecasts))
        return Decision(i, float(forecasts[i]))


class SoftSfs(Policy):
    """argmax U - delta * forecast, forecast in microseconds (delta = 0: latency-agnostic)."""

    name = "sfs-soft"

    def __init__(self, estimator: Estimator, delta: float = 1e-6, **kw) -> None:
        super().__init__(**kw)
        self.estimator = estimator
        self.delta = delta

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        u = utility(req, cands, self.lam)
        f = np.array([self.estimator.ttft(c.view, req.prompt_tokens, now) for c in cands])
        score = u - self.delta * np.minimum(f, 1e6) * 1e6
        i = self._argmax_random(score)
        return Decision(i, float(f[i]))
