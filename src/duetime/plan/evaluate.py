"""Simulating a candidate pool with the router in the loop, and telling whether it meets the
plan's constraints — with a run long enough for the answer to be stable.

Every pool is simulated on the same request stream (common random numbers: the experiments'
stream for the rate, the request count and the seed), so two pools differ by what they are,
not by the draw. Attainment per class comes with a 95% interval from batch means (ten
consecutive batches of the class's requests in arrival order, Student's t); where a floor lies
inside a class's interval the pool is simulated again on a stream twice as long, up to
``max_requests``. That is how the plan knows a simulation was long enough: the decision it
takes from it does not change within the run's own noise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetime.engine.hardware import Option
from duetime.experiments.runner import Point, Runner
from duetime.plan.problem import PlanProblem
from duetime.policy import make_policy
from duetime.sim import ClusterSim, SimResult
from duetime.workload import RequestSet

Z_975 = 1.96
T_975_9 = 2.262  # Student's t, 97.5th percentile, 9 degrees of freedom (ten batches)
BATCHES = 10
SCREEN_MIN = 250  # requests of a screening run, at least
BAND = 0.03  # the widest half-width a decision waits on (see Evaluator._margins)

Pool = tuple[tuple[Option, int], ...]  # (deployment, replicas > 0), in the problem's order


def pool_of(counts: dict[Option, int], problem: PlanProblem) -> Pool:
    """A pool in canonical form: the problem's option order, no zero counts."""
    return tuple((o, counts[o]) for o in problem.options if counts.get(o, 0) > 0)


def pool_cost(pool: Pool, problem: PlanProblem) -> float:
    """USD per hour."""
    return sum(r * problem.price(o) for o, r in pool)


def pool_gpus(pool: Pool) -> int:
    return sum(r * o.tp for o, r in pool)


def pool_label(pool: Pool) -> str:
    return " + ".join(f"{r} x {o.name}" for o, r in pool) or "(empty)"


def batch_means(hit: np.ndarray) -> tuple[float, float]:
    """Mean and 95% half-width of a 0/1 series in time order, by batch means."""
    n = len(hit)
    if n == 0:
        return 1.0, 0.0
    if n < 2 * BATCHES:
        return float(hit.mean()), 1.0
    means = np.array([b.mean() for b in np.array_split(hit, BATCHES)])
    return float(hit.mean()), float(T_975_9 * means.std(ddof=1) / math.sqrt(BATCHES))


@dataclass(frozen=True, slots=True)
class Outcome:
    """A pool's simulated results."""

    pool: Pool
    cost: float
    on_time: dict[str, float]        # per class
    half_width: dict[str, float]     # per class, 95%, batch means
    class_requests: dict[str, int]
    on_time_all: float
    quality: float
    quality_half_width: float
    utility: float
    ontime_utility: float
    p90_ttft_s: float
    requests: int
    wall_s: float
    meets: bool
    why: str                         # "" when it meets; else the first constraint missed

    @property
    def worst_on_time(self) -> float:
        """The least on-time rate over the classes."""
        return min(self.on_time.values(), default=1.0)

    def as_dict(self) -> dict[str, Any]:
        return {"pool": {o.name: r for o, r in self.pool}, "cost_per_hour": round(self.cost, 4),
                "gpus": pool_gpus(self.pool),
                "on_time": {c: round(v, 4) for c, v in self.on_time.items()},
                "on_time_half_width": {c: round(v, 4) for c, v in self.half_width.items()},
                "on_time_all": round(self.on_time_all, 4), "quality": round(self.quality, 4),
                "quality_half_width": round(self.quality_half_width, 4),
                "utility": round(self.utility, 4),
                "ontime_utility": round(self.ontime_utility, 4),
                "p90_ttft_s": round(self.p90_ttft_s, 4), "requests": self.requests,
                "meets": self.meets, "why": self.why}


@dataclass
class Evaluator:
    """Simulates pools of a :class:`PlanProblem`; remembers every outcome (the frontier)."""

    problem: PlanProblem
    runner: Runner = field(init=False)
    outcomes: dict[Pool, Outcome] = field(default_factory=dict)
    simulations: int = 0
    sim_wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.runner = Runner(self.problem.workload, seed=self.problem.seed)

    def requests(self, n: int | None = None, rate: float | None = None) -> RequestSet:
        p = self.problem
        return self.runner.requests(Point(p.router, rate or p.rate, n or p.requests))

    def simulate(self, pool: Pool, requests: RequestSet) -> SimResult:
        p = self.problem
        pairs, specs = [], {}
        for opt, r in pool:
            for k in range(r):
                name = f"{opt.name}.{k}"
                pairs.append((name, opt.model))
                specs[name] = p.specs[opt]
        policy = make_policy(p.router, p.params, defaults={
            "lambda": p.workload.lam, "seed": p.seed, "delta": 1e-6})
        sim = ClusterSim(p.workload, policy, instances=pairs, instance_specs=specs, seed=p.seed)
        t0 = time.perf_counter()
        res = sim.run(requests)
        self.sim_wall_s += time.perf_counter() - t0
        self.simulations += 1
        return res

    def outcome(self, pool: Pool, res: SimResult) -> Outcome:
        p = self.problem
        c = p.constraints
        ttft = res.ttft
        hit = ttft <= res.requests.target
        on_time, half, counts = {}, {}, {}
        for k, name in enumerate(p.classes):
            mine = hit[res.requests.task == k]
            on_time[name], half[name] = batch_means(mine)
            counts[name] = len(mine)
        quality, quality_hw = batch_means(res.quality)
        util = res.quality - res.lam * res.cost
        cost = pool_cost(pool, p)
        why = ""
        for name in p.classes:
            if on_time[name] < c.on_time[name]:
                why = f"{name} on time {on_time[name]:.3f} < {c.on_time[name]:g}"
                break
        if not why and c.quality is not None and quality < c.quality:
            why = f"quality {quality:.3f} < {c.quality:g}"
        if not why and c.budget is not None and cost > c.budget:
            why = f"cost {cost:.2f} > budget {c.budget:g}"
        return Outcome(pool, cost, on_time, half, counts, float(hit.mean()), quality, quality_hw,
                       float(util.mean()), float((util * hit).mean()),
                       float(np.quantile(ttft, 0.9)), len(ttft), res.wall_s, not why, why)

    def _margins(self, o: Outcome) -> list[tuple[float, float]]:
        """(estimate - floor, half-width) of every constrained quantity. The half-width is the
        batch means' capped at :data:`BAND` (an overloaded pool falls behind through the run:
        its batch means trend, and their spread says nothing of its noise), but never below
        a binomial interval of the class's requests (a short run's own noise)."""
        c = self.problem.constraints
        out = []
        for k in o.on_time:
            if c.on_time[k] > 0:
                p, n = o.on_time[k], max(o.class_requests[k], 1)
                binomial = Z_975 * math.sqrt(max(p * (1 - p), 1 / n) / n)
                out.append((p - c.on_time[k], max(binomial, min(o.half_width[k], BAND))))
        if c.quality is not None:
            out.append((o.quality - c.quality, min(o.quality_half_width, BAND)))
        return out

    def undecided(self, o: Outcome) -> bool:
        """Whether a floor lies within an interval (the answer is in the noise)."""
        return any(abs(m) < h for m, h in self._margins(o))

    def clearly_fails(self, o: Outcome) -> bool:
        """Whether some interval lies wholly below its floor."""
        return any(m + h < 0 for m, h in self._margins(o))

    def evaluate(self, pool: Pool) -> Outcome:
        """The pool simulated on the plan's stream (remembered). First a screening run of a
        quarter of the requests: a pool whose attainment is clearly below a floor there is
        not run further (an overloaded pool only falls further behind). Otherwise the full
        run, and runs twice as long while the decision is in the noise (the module doc)."""
        got = self.outcomes.get(pool)
        if got is not None:
            return got
        full = self.problem.requests
        n = max(SCREEN_MIN, full // 4)
        while True:
            o = self.outcome(pool, self.simulate(pool, self.requests(n)))
            if n < full:
                if self.clearly_fails(o):
                    break
                n = full
                continue
            if self.clearly_fails(o) or not self.undecided(o) \
                    or n >= self.problem.max_requests:
                break
            n = min(2 * n, self.problem.max_requests)
        self.outcomes[pool] = o
        return o
