"""``duetime``: duetime's own autoscaler — it sizes each model for the traffic the router will
send it by the time a new replica would serve, and adds a replica as soon as the engines
forecast that a typical request would be late, before the on-time rate falls.

Per model, every tick:

- the rate the router sends it, per tick, averaged over the last ``window`` ticks, with its
  trend (least squares over the window) extrapolated to when a new replica would serve
  (``scale_up_delay_s`` after the window's middle) — only a trend the Poisson noise does not
  explain (slope ≥ 2 standard errors), and no higher than the highest tick in the window: the
  demand the replicas asked for now must meet. A tick whose count is a step up from the
  window's mean (twice it and 4 Poisson deviations above) starts a new level: the demand is
  that tick's rate and the older ticks are dropped;
- replicas = ceil(demand / (one replica's rate at the SLO x ``utilization``)); one replica's
  rate at the SLO (``capacity``) comes from a profile sweep, as the throughput planner's;
- the engines' forecast (``PoolStatus.forecast_ratio``: a typical request's forecast TTFT at
  the best serving replica over its target): above ``late`` (1.0), one replica more (unless
  one is starting) — whatever the rate says, the next requests would be late;
- down only after the demand has stayed below the smaller count for ``hold_s``, one replica
  per tick (a replica costs ``scale_up_delay_s`` to bring back).

A model with neither a capacity nor a table gets only the forecasts' rule: a replica more
when a typical request would be late, never fewer (without a capacity nothing says how many
replicas the rate needs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from duetime.autoscale.status import PoolStatus
from duetime.policy.registry import Param, PolicyError

UTILIZATION = Param("utilization", "utilization", float, 0.85,
                    "the share of a replica's rate at the SLO it is sized for", min=0.0,
                    min_open=True)
WINDOW = Param("window", "window", int, 4, "ticks the rate and its trend are read over", min=1)
LATE = Param("late", "late", float, 1.0, "forecast TTFT / target above which a replica is "
             "added at once", min=0.0, min_open=True)
HOLD = Param("hold_s", "hold_s", float, 120.0, "seconds the demand must stay low before a "
             "replica is let go", min=0.0)


STEP_Z = 4.0     # a tick's count this many Poisson deviations above the window's mean ...
STEP_RATIO = 2.0  # ... and at least this many times it is a step up
TREND_T = 2.0    # a trend counts when its slope is this many standard errors above 0


def _stepped_up(before: float, last: float) -> bool:
    """Whether a tick's count ``last`` is a step up from the mean count ``before`` (not the
    noise of a Poisson stream at that mean)."""
    return last > STEP_RATIO * before and last - before > STEP_Z * math.sqrt(max(before, 1.0))


@dataclass(slots=True)
class ForecastAutoscaler:
    capacity: Mapping[str, float] = field(default_factory=dict)
    # the planner's table (``duetime plan`` at rate levels, the router in the loop): (total
    # rate, replicas per model) rising; where given, the pool is the table's row for the
    # forecast total rate instead of model-by-model capacities
    table: Sequence[tuple[float, Mapping[str, int]]] = ()
    utilization: float = UTILIZATION.default
    window: int = WINDOW.default
    late: float = LATE.default
    hold_s: float = HOLD.default
    _rates: dict[str, deque] = field(default_factory=dict)
    _low_since: dict[str, float] = field(default_factory=dict)

    name: ClassVar[str] = "duetime"
    summary: ClassVar[str] = ("duetime's: each model sized for the rate the router will send "
                              "it when a new replica serves; a replica more as soon as the "
                              "engines forecast a typical request late")
    params: ClassVar[tuple[Param, ...]] = (UTILIZATION, WINDOW, LATE, HOLD)
    needs_capacity: ClassVar[bool] = False  # (without one: the forecasts' rule alone)

    def __post_init__(self) -> None:
        bad = {m: c for m, c in self.capacity.items() if not c > 0}
        if bad:
            raise PolicyError(f"duetime autoscaler: capacity must be > 0 requests/s, got {bad}")
        rates = [r for r, _ in self.table]
        if rates != sorted(rates):
            raise PolicyError("duetime autoscaler: the table's rates must rise")

    def demand(self, status: PoolStatus, model: str) -> float:
        """The rate (requests/s) the model will get when a replica asked for now serves."""
        rates = self._rates.setdefault(model, deque(maxlen=self.window))
        rates.append(status.routed.get(model, 0) / status.interval_s)
        r = np.asarray(rates)
        if r.size >= 2 and _stepped_up(r[:-1].mean() * status.interval_s,
                                       r[-1] * status.interval_s):
            while len(rates) > 1:  # (a new level: the older ticks no longer tell it)
                rates.popleft()
            return float(r[-1])
        now = float(r.mean())
        if r.size < 3:
            return now
        x = np.arange(r.size, dtype=float) * status.interval_s
        slope, icpt = np.polyfit(x, r, 1)
        resid = r - (icpt + slope * x)
        se = math.sqrt(float(resid @ resid) / (r.size - 2) / float(((x - x.mean()) ** 2).sum()))
        if slope <= 0 or slope < TREND_T * se:  # (no trend the noise does not explain)
            return now
        ahead = status.scale_up_delay_s + x[-1] / 2  # from the window's middle
        # (no higher than a tick the window saw: a trend fit over a ramp's knee overshoots)
        return min(now + float(slope) * ahead, float(r.max()))

    def planned(self, status: PoolStatus) -> Mapping[str, int] | None:
        """The table's pool for the forecast total rate (None without a table)."""
        if not self.table:
            return None
        total = sum(self.demand(status, m) for m in status.models)  # (the rows meet the SLO)
        for rate, pool in self.table:
            if rate >= total:
                return pool
        return self.table[-1][1]

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        out = {}
        plan = self.planned(status)
        for m in status.models:
            have = status.provisioned(m)
            cap = self.capacity.get(m)
            if plan is not None:
                want = max(1, int(plan.get(m, 0)))
            elif cap is not None:
                demand = self.demand(status, m)
                want = max(1, math.ceil(demand / (cap * self.utilization) - 1e-9))
            else:  # (no capacity known: only the forecasts' rule; never fewer)
                want = max(1, have)
            ratio = status.forecast_ratio.get(m)
            if ratio is not None and ratio > self.late and not status.starting.get(m, 0):
                want = max(want, have + 1)  # (one at a time: the next waits for it to serve)
            if want >= have:
                self._low_since.pop(m, None)
                out[m] = want
                continue
            since = self._low_since.setdefault(m, status.t)
            out[m] = have - 1 if status.t - since >= self.hold_s else have
        return out
