"""Finding the cheapest pool that meets a plan's constraints, without enumerating.

The space: for each model, one deployment (GPU and tensor-parallel size) or none, and a replica
count up to ``max_replicas``; pools are walked in order of cost (or of GPUs: ``objective``;
best first from the empty pool, each step one replica more), so the first pool that meets the
constraints is the cheapest that does. A pool is simulated only when the bounds (:mod:`duetime.plan.bounds`) let
it through: every class's idle attainment and the quality bound at least their floors, and a
split of the traffic over its deployments that saturates none of them (each deployment's
capacity from its profile, Mélange's program relaxed) and meets the quality floor. The bounds
hold for any router, so the search returns what exhaustive enumeration returns
(:func:`enumerate_grid` simulates every pool of the space: the reference it is tested against).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from duetime.experiments.fanout import Fanout
from duetime.plan.bounds import (
    class_attainment_bound,
    feasible_split,
    on_time_idle,
    quality_bound,
    work_seconds,
)
from duetime.plan.evaluate import Evaluator, Outcome, Pool, pool_cost, pool_gpus
from duetime.plan.problem import PlanProblem


@dataclass
class SearchResult:
    best: Outcome | None
    simulations: int
    pools_considered: int
    pruned: dict[str, int]
    wall_s: float
    outcomes: list[Outcome] = field(default_factory=list)


class Space:
    """The search space of a problem: per model its deployments, replicas 1..max."""

    def __init__(self, problem: PlanProblem) -> None:
        self.problem = problem
        self.models = problem.models
        self.choices = {m: [o for o in problem.options if o.model == m] for m in self.models}

    def pool(self, state: tuple[tuple[int, int], ...]) -> Pool:
        """State: per model (deployment index, replicas); replicas 0 = absent."""
        counts = {self.choices[m][k]: r for m, (k, r) in zip(self.models, state, strict=True)
                  if r > 0}
        return tuple((o, counts[o]) for o in self.problem.options if o in counts)

    def start(self) -> tuple[tuple[int, int], ...]:
        return tuple((0, 0) for _ in self.models)

    def successors(self, state):
        top = self.problem.max_replicas
        for i, (k, r) in enumerate(state):
            if r == 0:
                for kk in range(len(self.choices[self.models[i]])):
                    yield (*state[:i], (kk, 1), *state[i + 1:])
            elif r < top:
                yield (*state[:i], (k, r + 1), *state[i + 1:])

    def all_states(self):
        per = [[(0, 0)] + [(k, r) for k in range(len(self.choices[m]))
                           for r in range(1, self.problem.max_replicas + 1)]
               for m in self.models]
        for state in itertools.product(*per):
            if any(r for _, r in state):
                yield state


class Bounds:
    """The bounds of :mod:`duetime.plan.bounds` on the plan's stream, per pool."""

    def __init__(self, ev: Evaluator) -> None:
        p = ev.problem
        self.problem = p
        reqs = self.requests = ev.requests()
        self.idle = {o: on_time_idle(p.specs[o].batch_time, p.specs[o].config, reqs)
                     for o in p.options}
        self.floors = np.array([p.constraints.on_time[c] for c in p.classes])
        self.columns = {m: k for k, m in enumerate(reqs.models)}
        n_c = len(p.classes)
        counts = np.bincount(reqs.task, minlength=n_c).astype(float)
        self.class_rate = p.rate * counts / counts.sum()
        # per deployment: each class's mean engine-seconds a request and mean quality
        self.work, self.quality = {}, {}
        for o in p.options:
            col = self.columns[o.model]
            w = work_seconds(p.specs[o].batch_time, p.specs[o].config, reqs.prompt,
                             reqs.output[:, col])
            self.work[o] = np.bincount(reqs.task, weights=w, minlength=n_c) / np.maximum(counts, 1)
            self.quality[o] = (np.bincount(reqs.task, weights=reqs.quality[:, col],
                                           minlength=n_c) / np.maximum(counts, 1))

    def why_not(self, pool: Pool) -> str:
        """The first bound the pool fails ("" if it passes them all)."""
        p = self.problem
        rows = np.array([self.idle[o] for o, _ in pool])
        att = class_attainment_bound(rows, self.requests.task, len(p.classes))
        if (att < self.floors).any():
            return "idle attainment"
        if p.constraints.quality is not None:
            cols = sorted({self.columns[o.model] for o, _ in pool})
            if quality_bound(self.requests.quality, cols) < p.constraints.quality:
                return "quality"
        work = np.array([self.work[o] for o, _ in pool]).T
        quality = np.array([self.quality[o] for o, _ in pool]).T
        if not feasible_split(self.class_rate, work, np.array([r for _, r in pool]),
                              quality, p.constraints.quality):
            return "saturation"
        return ""


def objective_key(problem: PlanProblem, pool: Pool) -> tuple[float, float]:
    """What the search minimises: cost then GPUs (``objective: cost``), or GPUs then cost.
    Both grow with every replica added, so the walk from the empty pool is in this order."""
    cost, gpus = pool_cost(pool, problem), float(pool_gpus(pool))
    return (gpus, cost) if problem.objective == "gpus" else (cost, gpus)


def search(problem: PlanProblem, ev: Evaluator | None = None,
           fanout: Fanout | None = None) -> SearchResult:
    """The cheapest pool that meets the constraints (see the module doc). With a ``fanout``,
    the pools the walk would simulate next are simulated at once (other processes, or Ray)
    and the first, in the walk's order, that meets is the answer: the pool a serial search
    finds, with a few simulations more (those started ahead of it)."""
    t0 = time.perf_counter()
    ev = ev or Evaluator(problem)
    fanout = fanout or Fanout()
    counts = {"considered": 0}
    pruned = {"budget": 0, "idle attainment": 0, "quality": 0, "saturation": 0}
    walk = _walk(problem, Bounds(ev), counts, pruned)
    best = None
    if fanout.serial:
        best = next((o for o in map(ev.evaluate, walk) if o.meets), None)
    else:
        with fanout.pool() as workers:
            for o, sims, wall in workers.imap(evaluate_elsewhere,
                                              ((problem, pool) for pool in walk)):
                ev.outcomes[o.pool] = o
                ev.simulations += sims
                ev.sim_wall_s += wall
                if o.meets:
                    best = o
                    break
    return SearchResult(best, ev.simulations, counts["considered"], pruned,
                        time.perf_counter() - t0, list(ev.outcomes.values()))


def _walk(problem: PlanProblem, bounds: Bounds, counts: dict[str, int],
          pruned: dict[str, int]) -> Iterator[Pool]:
    """The pools to simulate, cheapest first (by the objective), those the bounds rule out
    counted in ``pruned`` and skipped."""
    space = Space(problem)
    budget = problem.constraints.budget
    start = space.start()
    heap: list[tuple[tuple[float, float], tuple]] = [((0.0, 0.0), start)]
    seen = {start}
    while heap:
        _, state = heapq.heappop(heap)
        pool = space.pool(state)
        if budget is not None and pool_cost(pool, problem) > budget:
            pruned["budget"] += 1  # (and every pool above it: they cost more)
            continue
        for nxt in space.successors(state):
            if nxt not in seen:
                seen.add(nxt)
                heapq.heappush(heap, (objective_key(problem, space.pool(nxt)), nxt))
        if pool:
            counts["considered"] += 1
            why = bounds.why_not(pool)
            if why:
                pruned[why] += 1
            else:
                yield pool


def evaluate_elsewhere(problem: PlanProblem, pool: Pool) -> tuple[Outcome, int, float]:
    """A pool's outcome on a fresh evaluator (the same outcome: every evaluator of a problem
    simulates on the same stream), its simulation runs and their wall time (a module-level
    function: fan-outs pickle it)."""
    ev = Evaluator(problem)
    o = ev.evaluate(pool)
    return o, ev.simulations, ev.sim_wall_s


def enumerate_grid(problem: PlanProblem, ev: Evaluator | None = None,
                   fanout: Fanout | None = None) -> SearchResult:
    """Every pool of the space simulated (where ``fanout`` says); the best (by the objective)
    that meets the constraints."""
    t0 = time.perf_counter()
    ev = ev or Evaluator(problem)
    fanout = fanout or Fanout()
    pools = [Space(problem).pool(s) for s in Space(problem).all_states()]
    if fanout.serial:
        outs = [ev.evaluate(p) for p in pools]
    else:
        outs = []
        for o, sims, wall in fanout.map(evaluate_elsewhere, [(problem, p) for p in pools]):
            ev.outcomes[o.pool] = o
            ev.simulations += sims
            ev.sim_wall_s += wall
            outs.append(o)
    ok = [o for o in outs if o.meets]
    best = min(ok, key=lambda o: (objective_key(problem, o.pool),
                                  [(x.name, r) for x, r in o.pool])) if ok else None
    return SearchResult(best, ev.simulations, len(outs), {}, time.perf_counter() - t0, outs)
