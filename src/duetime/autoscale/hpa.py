"""The Kubernetes Horizontal Pod Autoscaler's arithmetic, which KEDA's ScaledObjects drive:
the rules that reimplemented autoscalers (queue-threshold, llm-d's) scale through.

For a metric with an average-value target, the HPA wants ceil(current replicas x ratio),
ratio = metric per replica / target, and leaves the count alone while the ratio is within a
tolerance of 1 (default 0.1). Scale-downs are stabilised: the count is the highest wanted over
the last ``scale_down_stabilization_s`` (default 300 s); scale-ups are not, but are limited per
15 s period to the larger of doubling and adding 4 replicas (the HPA's default behaviour)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

TOLERANCE = 0.1
SCALE_DOWN_STABILIZATION_S = 300.0
SCALE_UP_PERIOD_S = 15.0


@dataclass(slots=True)
class Hpa:
    """One deployment's HPA (one model's replicas)."""

    tolerance: float = TOLERANCE
    scale_down_stabilization_s: float = SCALE_DOWN_STABILIZATION_S
    _wanted: deque = field(default_factory=deque)  # (t, count wanted) within the window

    def recommend(self, t: float, current: int, ratio: float, interval_s: float) -> int:
        """The replica count for ``ratio`` (metric per replica / target) with ``current``
        replicas, after the tolerance, the scale-up limit and the scale-down window."""
        if current <= 0:
            want = 1 if ratio > 0 else 0
        elif abs(ratio - 1.0) <= self.tolerance:
            want = current
        else:
            want = math.ceil(current * ratio - 1e-9)
        periods = max(1, math.ceil(interval_s / SCALE_UP_PERIOD_S - 1e-9))
        up_limit = current
        for _ in range(periods):
            up_limit = max(2 * up_limit, up_limit + 4)
        want = min(want, up_limit)
        self._wanted.append((t, want))
        while self._wanted and self._wanted[0][0] < t - self.scale_down_stabilization_s:
            self._wanted.popleft()
        if want < current:  # the highest recommendation in the window, never above current
            want = min(current, max(w for _, w in self._wanted))
        return want
