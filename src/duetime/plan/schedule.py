"""Plans for a rate that changes: a pool per interval of a day (or of a trace), priced with
the time a new replica takes to load, against the static pool sized for the peak.

Each interval gets the cheapest pool for its rate, rounded *up* to a level of a geometric grid
(``step``: 10% apart by default), so that intervals of similar rates share one search and no
interval is planned for less than it gets; a level takes a higher level's pool where that one
is cheaper (it meets the higher rate, so the lower one too). A replica added at an interval's start is paid for
from ``scale_up_delay_s`` before it (loading the model and warming up: a plan provisions
ahead, as a forecast-driven autoscaler would); one removed stops costing when its interval
ends (drained). The transitions themselves are not simulated: each interval's attainment is
its pool's at a steady rate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from duetime.experiments.fanout import Fanout
from duetime.plan.evaluate import Evaluator, Outcome, pool_cost, pool_gpus
from duetime.plan.problem import PlanError, PlanProblem
from duetime.plan.rates import Interval, level
from duetime.plan.search import SearchResult, objective_key, search


@dataclass
class ScheduleResult:
    intervals: list[Interval]
    pools: list[Outcome | None]         # per interval (None: no pool meets it)
    levels: dict[float, SearchResult]   # per rate level searched
    peak: SearchResult                  # the static pool, planned for the peak interval's rate
    delay_s: float

    def _totals(self, what) -> tuple[float, float]:
        run = added = 0.0
        # the first interval's pool is running when the schedule starts, as the static one is
        first = next((o for o in self.pools if o is not None), None)
        prev: dict = {} if first is None else dict(first.pool)
        for iv, o in zip(self.intervals, self.pools, strict=True):
            if o is None:
                continue
            run += what(o.pool) * iv.duration_s / 3600
            now = dict(o.pool)
            up = tuple((opt, now[opt] - prev.get(opt, 0)) for opt in now
                       if now[opt] > prev.get(opt, 0))
            added += what(up) * self.delay_s / 3600
            prev = now
        return run, added

    def gpu_hours(self) -> float:
        run, added = self._totals(pool_gpus)
        return run + added

    def cost(self, problem: PlanProblem) -> float:
        run, added = self._totals(lambda pool: pool_cost(pool, problem))
        return run + added

    @property
    def hours(self) -> float:
        return sum(iv.duration_s for iv in self.intervals) / 3600

    def static_gpu_hours(self) -> float | None:
        best = self.peak.best
        return None if best is None else pool_gpus(best.pool) * self.hours


STEP = 0.1  # rate levels 10% apart


def search_level(problem: PlanProblem, rate: float) -> SearchResult:
    """The plan for one rate level (a module-level function: fan-outs pickle it)."""
    at = replace(problem, rate=rate)
    return search(at, Evaluator(at))


def plan_schedule(problem: PlanProblem, *, step: float = STEP, progress=None,
                  fanout: Fanout | None = None) -> ScheduleResult:
    """The cheapest pool for every interval's rate level (``problem.intervals``), and the
    static peak pool. The levels are searched independently: ``fanout`` runs them in other
    processes or on Ray (the same results as here, serially)."""
    intervals = list(problem.intervals)
    if not intervals:
        raise PlanError("plan_schedule: the problem has no intervals (a rate schedule)")
    delay_s = problem.scale_up_delay_s
    rates = sorted({level(iv.rate, step) for iv in intervals})
    found = (fanout or Fanout()).map(search_level, [(problem, lv) for lv in rates])
    levels: dict[float, SearchResult] = dict(zip(rates, found, strict=True))
    if progress is not None:
        for lv, r in levels.items():
            progress(f"{lv:.3g} q/s: " + ("no pool" if r.best is None else
                                          f"{r.best.cost:.2f} USD/h, "
                                          f"{pool_gpus(r.best.pool)} GPUs"))
    # a pool that meets a higher rate meets a lower one: each level takes the best pool found
    # for it or any level above it (the searches' noise can make a higher level's cheaper)
    chosen: dict[float, Outcome | None] = {}
    best: Outcome | None = None
    for lv in sorted(levels, reverse=True):
        found = levels[lv].best
        if found is not None and (best is None or objective_key(problem, found.pool)
                                  <= objective_key(problem, best.pool)):
            best = found
        chosen[lv] = best
    peak_rate = max(iv.rate for iv in intervals)
    peak = levels[level(peak_rate, step)]
    pools = [chosen[level(iv.rate, step)] for iv in intervals]
    return ScheduleResult(intervals, pools, levels, peak, delay_s)
