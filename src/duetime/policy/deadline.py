"""Completion deadlines under length uncertainty: ``sfs-deadline``.

A request may carry an end-to-end deadline and a time-per-output-token target beside its TTFT
target (:class:`~duetime.policy.base.RoutingRequest`: ``deadline``, ``tpot_target``). Its
output length is uncertain: the predictor gives a median and, where it can, a 90th percentile
per model (``output_tokens``, ``output_p90``). ``sfs-deadline`` takes the length at
probability ``q`` of a log-normal through those two (the length model the predictor's heads
describe: a median and a spread), forecasts the request's finish there on each candidate with
the engine (:meth:`~duetime.estimate.sfs.SfsEstimator.finishes`: one base trajectory answers
its first token and its finish), and chooses the best utility among the candidates whose
forecasts meet the TTFT target, finish by the deadline and decode within the TPOT target: with
a log-normal length, finishing by the deadline at the q-length is finishing by it with
probability at least q (a finish is monotone in the length). None does: the least finish.

The replay's decode speeds up as the batch it starts beside drains; a pool under steady load
refills it (the requests routed there meanwhile join). So by default (``steady``) the time per
output token over the finish is at least that of the next ``STEADY_TOKENS`` tokens: on the
``deadlines`` experiment's pool with exact lengths the drained forecast's finish was short by
9.8% at the median (82% at p90) at 5 q/s, the steady one by 5.0% (63%)
(``benchmarks/finish_forecast_error.py``), and sfs-deadline's OnTimeUtility-by-deadline AUC
rose from 2.49 to 2.64 (docs/simulator.md, "Completion deadlines").

Candidates are forecast best utility first and the first that qualifies is taken, so a
decision costs what ``sfs``'s lazy search does when the best model qualifies — one finish
forecast per candidate looked at; more only when the better ones do not. Replicas of equal
utility are looked at in the order of the pool's wait estimates where the instances keep them
(the simulator: as ``sfs``'s ``ranked`` rule orders them), else at random.
Without a p90 (``output_p90`` None) the q-length is the median: the "median length plugged
into a finish forecast" baseline of issue 36.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from duetime.estimate import SfsEstimator
from duetime.policy.base import (
    Candidate,
    Decision,
    Described,
    Policy,
    RoutingRequest,
    utility,
    views_of,
)
from duetime.policy.latency import UTILITY_INPUTS
from duetime.policy.registry import LAMBDA, SEED, SNAPSHOT, Param, PolicyError

Q = Param("q", "q", float, 0.9, "the probability of finishing by the deadline a candidate "
          "must reach: its finish is forecast at the output length of that quantile (a "
          "log-normal through the predicted median and p90)", min=0.0, min_open=True)
STEADY = Param("steady", "steady", int, 1, "1: the decode is forecast not to speed up as "
               "the batch drains (the time per token is at least that of the next "
               "STEADY_TOKENS tokens: arrivals refill the batch); 0: the replay's draining "
               "batch as it is", min=0)
STEADY_TOKENS = 16
Z90 = NormalDist().inv_cdf(0.9)


def length_quantile(median: np.ndarray, p90: np.ndarray | None, q: float) -> np.ndarray:
    """Output tokens at probability ``q`` of a log-normal with this median and 90th
    percentile, per candidate (at least 1; the median where no spread is known)."""
    med = np.maximum(np.asarray(median, dtype=float), 1.0)
    if p90 is None or q == 0.5:
        return np.maximum(1, np.ceil(med)).astype(np.int64)
    sigma = np.log(np.maximum(np.asarray(p90, dtype=float), med) / med) / Z90
    z = NormalDist().inv_cdf(min(q, 1 - 1e-9))
    return np.maximum(1, np.ceil(med * np.exp(sigma * z))).astype(np.int64)


class DeadlineSfs(Policy):
    """argmax U over the instances whose finish at the q-length meets the deadline (and whose
    TTFT and time per output token meet theirs); if none, the least finish (module doc)."""

    name = "sfs-deadline"
    summary = ("the best utility among instances whose forecast finish at the q-quantile "
               "output length meets the deadline (and TTFT and TPOT targets); if none, the "
               "least finish")
    params = (LAMBDA, SEED, Q, STEADY)
    consumes = UTILITY_INPUTS | {SNAPSHOT}

    def __init__(self, *, lam: float = LAMBDA.default, seed: int = 0,
                 q: float = Q.default, steady: int = STEADY.default) -> None:
        super().__init__(seed=seed)
        if not 0.0 < q < 1.0:
            raise PolicyError(f"policy.q: must be a probability in (0, 1), got {q}")
        if steady not in (0, 1):
            raise PolicyError(f"policy.steady: must be 0 or 1, got {steady}")
        self.lam = lam
        self.q = q
        self.steady = bool(steady)
        self.estimator = SfsEstimator()

    def _forecast(self, req: RoutingRequest, cand: Candidate, n: int,
                  now: float) -> tuple[float, float, float]:
        """(TTFT, finish, time per output token) on one candidate for ``n`` output tokens."""
        ttft = self.estimator.ttft(cand.view, req.prompt_tokens, now, hashes=req.prompt_hashes)
        k = min(n, STEADY_TOKENS + 1)
        first, near, end = self.estimator.finishes(cand.view, req.prompt_tokens, [1, k, n], now)
        tpot = (end - first) / (n - 1) if n > 1 else 0.0
        if self.steady and k > 1:
            tpot = max(tpot, (near - first) / (k - 1))
            end = first + tpot * (n - 1)
        return float(ttft), float(end), float(tpot)

    def _meets(self, req: RoutingRequest, f: tuple[float, float, float]) -> bool:
        ttft, end, tpot = f
        return bool(ttft <= req.ttft_target and end <= req.deadline
                    and tpot <= req.tpot_target)

    # (it orders replicas by the pool's wait estimates: a simulator keeps them on a board)
    uses_load_board = True

    def _order(self, req: RoutingRequest, cands: list[Candidate], u: np.ndarray,
               now: float) -> list[int]:
        """Best utility first; among equals the least wait estimate first (where the views
        keep the pool's estimates), else at random."""
        wait = self.estimator.wait_estimates(views_of(cands), range(len(cands)),
                                             req.prompt_tokens, now)
        tie = self.rng.random(len(cands)) if wait is None else wait
        return sorted(range(len(cands)), key=lambda i: (-u[i], tie[i]))

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        u = utility(req, cands, self.lam)
        lengths = length_quantile(req.output_tokens, req.output_p90, self.q)
        order = self._order(req, cands, u, now)
        best, best_end = -1, math.inf
        forecasts: dict[int, tuple[float, float, float]] = {}
        for i in order:
            f = forecasts[i] = self._forecast(req, cands[i], int(lengths[i]), now)
            if self._meets(req, f):
                return Decision(i, f[0])
            if f[1] < best_end or best < 0:
                best, best_end = i, f[1]
        return Decision(best, forecasts[best][0])

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        u = utility(req, cands, self.lam)
        lengths = length_quantile(req.output_tokens, req.output_p90, self.q)
        got = [self._forecast(req, c, int(n), now) for c, n in zip(cands, lengths,
                                                                     strict=True)]
        ok = [self._meets(req, f) for f in got]
        rule = ("the best utility among those whose finish at the "
                f"{self.q:g}-quantile length meets the deadline" if ok[chosen] else
                "none meets the deadline and targets: the least finish")
        return Described({"forecast_ttft_s": [f[0] for f in got],
                          "forecast_finish_s": [f[1] for f in got],
                          "forecast_tpot_s": [f[2] for f in got],
                          "output_tokens_q": lengths.tolist(), "feasible": ok,
                          "utility": u.tolist()}, "utility", "higher", rule)
