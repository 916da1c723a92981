"""``throughput-planner``: NVIDIA Dynamo's planner in its throughput mode, aggregated serving
(ai-dynamo/dynamo ``components/src/dynamo/planner/core/throughput_scaling.py`` and the
planner docs): every adjustment interval (default 180 s), the next interval's request rate to
each model is forecast from the rates seen, and the model gets max(ceil(forecast rate / one
replica's rate at the SLO), 1) replicas — set directly, with no stabilisation window or step
limit, and not while an earlier scale-up is still starting (Dynamo ignores a decision while
the deployment is not ready).

One replica's rate at the SLO (``capacity``, requests/s per model) comes from a profile sweep,
as Dynamo's comes from its profiler: here the caller measures it (e.g. by simulating one
replica of the model on its share of the workload, :mod:`duetime.experiments`). Forecasts:
``constant`` (the last interval's rate; Dynamo's fallback and one of its predictors) or
``trend`` (the last rate plus the last change: a local linear trend, in the spirit of its
Kalman predictor); Dynamo's default ARIMA (``pmdarima``) is not reimplemented.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from duetime.autoscale.status import PoolStatus
from duetime.policy.registry import Param, PolicyError

INTERVAL = Param("adjustment_interval_s", "adjustment_interval_s", float, 180.0,
                 "seconds between decisions", min=0.0, min_open=True)
TREND = Param("trend", "trend", int, 0, "0: forecast the last rate; 1: the last rate plus "
              "its last change", min=0)


@dataclass(slots=True)
class ThroughputPlanner:
    capacity: Mapping[str, float] = field(default_factory=dict)
    adjustment_interval_s: float = INTERVAL.default
    trend: int = TREND.default
    _counts: dict[str, int] = field(default_factory=dict)
    _rates: dict[str, list[float]] = field(default_factory=dict)
    _since: float | None = None

    name: ClassVar[str] = "throughput-planner"
    summary: ClassVar[str] = ("Dynamo's planner, throughput mode: forecast rate / one "
                              "replica's rate at the SLO, every 180 s")
    params: ClassVar[tuple[Param, ...]] = (INTERVAL, TREND)
    needs_capacity: ClassVar[bool] = True

    def __post_init__(self) -> None:
        bad = {m: c for m, c in self.capacity.items() if not c > 0}
        if bad:
            raise PolicyError(f"throughput-planner: capacity must be > 0 requests/s, got {bad}")

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        if self._since is None:
            self._since = status.t - status.interval_s
        for m, n in status.routed.items():
            self._counts[m] = self._counts.get(m, 0) + n
        span = status.t - self._since
        if span < self.adjustment_interval_s - 1e-9:
            return {}
        out = {}
        for m in status.models:
            rate = self._counts.get(m, 0) / span
            seen = self._rates.setdefault(m, [])
            seen.append(rate)
            forecast = rate
            if self.trend and len(seen) >= 2:
                forecast = max(0.0, rate + (seen[-1] - seen[-2]))
            if status.starting.get(m, 0):
                continue  # a scale-up still in flight: the decision is ignored
            cap = self.capacity.get(m)
            if cap is None:
                continue
            out[m] = max(math.ceil(forecast / cap - 1e-9), 1)
        self._counts, self._since = {}, status.t
        return out
