"""Utility routers: latency-agnostic, and those that keep a forecast TTFT under the target
(SFS and its baselines with coarser estimators), plus the soft trade-off ``sfs-soft``."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from duetime.estimate import LpsEstimator, SfsEstimator, ThroughputEstimator
from duetime.estimate.base import Estimator, lora_kw
from duetime.policy.base import (
    Candidate,
    Decision,
    Described,
    Policy,
    RoutingRequest,
    utility,
    views_of,
)
from duetime.policy.registry import (
    LAMBDA,
    OUTPUT_LENGTH,
    QUALITY,
    SEED,
    SNAPSHOT,
    STATS,
    Param,
)
from duetime.policy.tiers import least_and_ties, tier_runs

UTILITY_INPUTS = frozenset({QUALITY, OUTPUT_LENGTH})


class LatencyAgnostic(Policy):
    """argmax U = acc - lambda * cost."""

    name = "latency-agnostic"
    summary = "the best utility U = quality - lambda x cost, whatever the latency"
    params = (LAMBDA, SEED)
    consumes = UTILITY_INPUTS

    def __init__(self, *, lam: float = LAMBDA.default, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.lam = lam

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        return Decision(self._argmax_random(utility(req, cands, self.lam)))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        return Described({"utility": utility(req, cands, self.lam).tolist()}, "utility",
                         "higher", f"the best utility U = quality - {self.lam:g} x cost "
                         "(micro-USD), whatever the latency")


RANKED = Param("ranked", "ranked", int, 1, "1: a tier of replicas (equal utility) is "
               "forecast only at its replica with the least wait estimate, where the "
               "instances keep the pool's estimates (the simulator); 0, or without "
               "estimates: the least forecast among all of them", min=0)
REPLICA_SAMPLE = Param("replica_sample", "replica_sample", int, 0, "replicas of equal "
                       "utility forecast (drawn at random; more only while none meets the "
                       "target) before the least feasible forecast among them is taken; 0: "
                       "all of them", min=0)


class Feasible(Policy):
    """argmax U over instances whose forecast TTFT <= target; if none, the least forecast.

    With the SFS estimator this is ``sfs``; with the throughput or LPS estimators it is the
    paper's baselines ``throughput`` and ``lps``.

    Forecasts are made lazily, best utility first, tier by tier: a tier is the candidates of
    one utility (replicas of a model at one price). A tier of one is taken if its forecast
    meets the target, as the paper's router does. A tier of replicas is chosen from by one of
    three rules:

    * ``ranked`` (the default where the instances keep the pool's wait estimates,
      :mod:`duetime.engine.wait_estimate`: the simulator): the replica with the least
      estimate stands for the tier, one forecast; if it misses the target the tier does.
    * the least forecast (``ranked`` 0, and wherever there are no estimates: the gateway):
      the least forecast that meets the target among all the replicas; forecasts are made in
      the order of a lower bound and skipped where the bound already loses.
    * a sample (``replica_sample`` d > 0): the least forecast that meets the target among d
      drawn at random (the power of d choices), the rest forecast in that random order only
      while none meets the target.

    Taking the first replica by position instead packed it to the edge of the target before
    the next got anything, so that every forecast error became a miss. On the paper's
    workload at 90 instances (30 replicas of each model) and ~90% load, sfs was on time for
    78.8% by position; ranked gives 99.5%, the least forecast 96.9%: a tier whose least
    loaded replica misses the target hands the request to the next model instead of packing
    another replica to the edge of the target (docs/simulator.md, "Replicas";
    ``benchmarks/decision_cost.py``).
    """

    params = (LAMBDA, SEED, REPLICA_SAMPLE)
    consumes = UTILITY_INPUTS | {SNAPSHOT}

    def __init__(self, estimator: Estimator, *, lam: float = LAMBDA.default,
                 seed: int = 0, replica_sample: int = REPLICA_SAMPLE.default,
                 ranked: int = RANKED.default) -> None:
        super().__init__(seed=seed)
        self.lam = lam
        self.estimator = estimator
        self.replica_sample = replica_sample
        self.ranked = bool(ranked)

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        u = utility(req, cands, self.lam)
        # best utility first; tiers: runs of equal utility in that order
        order, ends = tier_runs(u)
        forecasts = np.full(len(cands), np.inf)
        bounds = np.full(len(cands), -np.inf)  # lower bounds of forecasts not made
        k = 0
        for j in ends.tolist():
            best = (self._first_fit(req, cands, int(order[k]), forecasts, now) if j - k == 1
                    else self._least_fit(req, cands, order[k:j], forecasts, bounds, now))
            if best >= 0:
                return Decision(best, float(forecasts[best]))
            k = j
        i = int(np.argmin(forecasts))
        # nothing meets the target: the least forecast, the skipped ones included where
        # their bound could beat it
        for s in np.flatnonzero(bounds < forecasts[i]).tolist():
            if np.isinf(forecasts[s]):
                forecasts[s] = self._forecast(req, cands[s], now)
                if forecasts[s] < forecasts[i]:
                    i = s
        return Decision(i, float(forecasts[i]))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        """Every candidate's forecast (the policy itself forecasts lazily, best utility
        first, and may have skipped some: the same estimator on the same state gives the
        numbers it would have made)."""
        f = [self._forecast(req, c, now) for c in cands]
        ok = [x <= req.ttft_target for x in f]
        rule = (f"the best utility (U = quality - {self.lam:g} x cost) among the instances "
                f"whose {self.estimator.name} forecast meets the target" if ok[chosen] else
                f"no {self.estimator.name} forecast meets the target: the least forecast")
        return Described({"forecast_ttft_s": f, "feasible": ok,
                          "utility": utility(req, cands, self.lam).tolist()},
                         "utility", "higher", rule)

    @property
    def uses_load_board(self) -> bool:
        """Whether it ranks replicas by a pool's wait estimates (a simulator then keeps its
        engines' summaries on a board: :mod:`duetime.engine.wait_estimate`)."""
        return (self.ranked and self.replica_sample == 0
                and hasattr(self.estimator, "wait_estimates"))

    def _forecast(self, req: RoutingRequest, cand: Candidate, now: float) -> float:
        return self.estimator.ttft(cand.view, req.prompt_tokens, now, hashes=req.prompt_hashes,
                                   **lora_kw(req.lora))

    def _first_fit(self, req: RoutingRequest, cands: list[Candidate], i: int,
                   forecasts: np.ndarray, now: float) -> int:
        forecasts[i] = self._forecast(req, cands[i], now)
        return i if forecasts[i] <= req.ttft_target else -1

    def _least_fit(self, req: RoutingRequest, cands: list[Candidate], tier: np.ndarray,
                   forecasts: np.ndarray, bounds: np.ndarray, now: float) -> int:
        """The least forecast meeting the target in a tier of replicas (-1 if none). With
        ``replica_sample`` 0 the candidates are forecast in the order of a cheap lower bound
        of their forecast (where the estimator has one), and those whose bound cannot beat
        the best so far, or the target, are not forecast at all: the same choice as
        forecasting every one (up to ties), at the cost of a few."""
        target = req.ttft_target
        if req.lora and self.replica_sample == 0:
            return self._adapter_fit(req, cands, tier, forecasts, now)
        if self.replica_sample == 0 and self.ranked:
            best = self._ranked_fit(req, cands, tier, forecasts, bounds, now)
            if best is not None:
                return best
        tier = self.rng.permutation(tier).tolist()  # (random among equals)
        bound = getattr(self.estimator, "ttft_lower_bound", None)
        if self.replica_sample == 0 and bound is not None:
            for i in tier:
                bounds[i] = bound(cands[i].view, req.prompt_tokens, now)
            tier.sort(key=lambda i: bounds[i])
        best = -1
        for m, i in enumerate(tier):
            if self.replica_sample == 0 and (
                    bounds[i] > target or (best >= 0 and bounds[i] >= forecasts[best])):
                break  # (sorted: no later one can win either)
            forecasts[i] = f = self._forecast(req, cands[i], now)
            bounds[i] = -np.inf
            if f <= target and (best < 0 or f < forecasts[best]):
                best = i
            if best >= 0 and 0 < self.replica_sample <= m + 1:
                break
        return best


    def _adapter_fit(self, req: RoutingRequest, cands: list[Candidate], tier: np.ndarray,
                     forecasts: np.ndarray, now: float) -> int:
        """A request on a LoRA adapter, among replicas: the least forecast meeting the target
        among those where its adapter already has requests (it takes no adapter slot there:
        ``max_loras`` slots left for other adapters keep them on time later), else among all;
        -1 if none meets it. Every replica is forecast (the lower bounds know nothing of the
        cap)."""
        target = req.ttft_target
        best = best_live = -1
        for i in self.rng.permutation(tier).tolist():  # (random among equals)
            forecasts[i] = f = self._forecast(req, cands[i], now)
            if f > target:
                continue
            if best < 0 or f < forecasts[best]:
                best = i
            live = getattr(cands[i].view, "lora_adapters", None)
            if live is not None and req.lora in live[0] and (
                    best_live < 0 or f < forecasts[best_live]):
                best_live = i
        return best_live if best_live >= 0 else best

    def _ranked_fit(self, req: RoutingRequest, cands: list[Candidate], tier: np.ndarray,
                    forecasts: np.ndarray, bounds: np.ndarray, now: float) -> int | None:
        """The tier's replica with the least wait estimate stands for the tier: it is taken
        if its forecast meets the target (-1 if not; ``None`` without estimates). The other
        replicas are not forecast at all, not even when no tier meets the target."""
        wait = getattr(self.estimator, "wait_estimates", None)
        if req.lora:  # (the estimates do not know the max_loras cap: all are forecast)
            return None
        est = None if wait is None else wait(views_of(cands), tier, req.prompt_tokens, now)
        if est is None:
            return None
        bounds[tier] = np.inf  # (none of them is looked at again)
        least, ties = least_and_ties(est)
        i = int(tier[least if ties == 1 else self._argmax_random(-est)])
        forecasts[i] = f = self._forecast(req, cands[i], now)
        return i if f <= req.ttft_target else -1


class Sfs(Feasible):
    name = "sfs"
    summary = ("the best utility among the instances whose TTFT forecast (the engine's replay "
               "from a snapshot) meets the target; if none, the least forecast")
    params = (LAMBDA, SEED, REPLICA_SAMPLE, RANKED)

    def __init__(self, *, lam: float = LAMBDA.default, seed: int = 0,
                 replica_sample: int = REPLICA_SAMPLE.default,
                 ranked: int = RANKED.default) -> None:
        super().__init__(SfsEstimator(), lam=lam, seed=seed, replica_sample=replica_sample,
                         ranked=ranked)


class Throughput(Feasible):
    name = "throughput"
    summary = ("as sfs, the forecast = (queued prefill tokens + the prompt) / prefill rate + a "
               "decode step")

    def __init__(self, *, lam: float = LAMBDA.default, seed: int = 0,
                 replica_sample: int = REPLICA_SAMPLE.default) -> None:
        super().__init__(ThroughputEstimator(), lam=lam, seed=seed,
                         replica_sample=replica_sample)


LPS_K = Param("k", "k", float, None, "the queue's concurrency (default: fitted from the "
              "instance's config and mean lengths)", min=0.0, min_open=True)


class Lps(Feasible):
    name = "lps"
    summary = ("as sfs, the forecast = a limited-processor-sharing wait from time-averaged "
               "rates + service")
    params = (LAMBDA, SEED, REPLICA_SAMPLE, LPS_K)
    consumes = Feasible.consumes | {STATS}

    def __init__(self, *, lam: float = LAMBDA.default, seed: int = 0,
                 replica_sample: int = REPLICA_SAMPLE.default, k: float | None = None) -> None:
        super().__init__(LpsEstimator(k=k), lam=lam, seed=seed, replica_sample=replica_sample)


DELTA = Param("delta", "delta", float, 1.0e-6, "weight of the TTFT forecast, per microsecond "
              "(0: latency-agnostic)", min=0.0)


class SoftSfs(Policy):
    """argmax U - delta * forecast, forecast in microseconds (delta = 0: latency-agnostic)."""

    name = "sfs-soft"
    summary = "the best U - delta x TTFT forecast (microseconds)"
    params: ClassVar[tuple[Param, ...]] = (LAMBDA, SEED, DELTA)
    consumes = UTILITY_INPUTS | {SNAPSHOT}

    def __init__(self, estimator: Estimator | None = None, *, lam: float = LAMBDA.default,
                 seed: int = 0, delta: float = DELTA.default) -> None:
        super().__init__(seed=seed)
        self.lam = lam
        self.estimator = estimator or SfsEstimator()
        self.delta = delta

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        u = utility(req, cands, self.lam)
        f = np.array([self.estimator.ttft(c.view, req.prompt_tokens, now,
                                          hashes=req.prompt_hashes, **lora_kw(req.lora))
                      for c in cands])
        score = u - self.delta * np.minimum(f, 1e6) * 1e6
        i = self._argmax_random(score)
        return Decision(i, float(f[i]))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        u = utility(req, cands, self.lam)
        f = np.array([self.estimator.ttft(c.view, req.prompt_tokens, now,
                                          hashes=req.prompt_hashes, **lora_kw(req.lora))
                      for c in cands])
        score = u - self.delta * np.minimum(f, 1e6) * 1e6
        return Described({"forecast_ttft_s": f.tolist(), "utility": u.tolist(),
                          "score": score.tolist()}, "U - delta x TTFT", "higher",
                         f"the best U - {self.delta:g} x forecast TTFT (microseconds)")
