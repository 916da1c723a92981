"""The Kubernetes Horizontal Pod Autoscaler's arithmetic, which KEDA's ScaledObjects drive:
the rules that reimplemented autoscalers (queue-threshold, llm-d's) scale through
(kubernetes ``pkg/controller/podautoscaler``; the defaults are Kubernetes').

For a metric with an average-value target the HPA wants ceil(replicas x ratio), ratio =
metric per replica / target, and keeps the count while the ratio is within a tolerance of 1
(0.1). ``behavior`` shapes the change: a scale-up takes the *least* recommendation over its
stabilisation window (default 0 s) and adds at most the larger of doubling and ``up_pods``
within ``up_period_s`` (default 4 pods / 15 s); a scale-down takes the *greatest*
recommendation over its window (default 300 s) and removes at most ``down_pods`` (default: all)
within ``down_period_s``."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class Behavior:
    up_window_s: float = 0.0
    up_pods: int = 4
    up_period_s: float = 15.0
    down_window_s: float = 300.0
    down_pods: int | None = None   # None: 100% per period
    down_period_s: float = 15.0


@dataclass(slots=True)
class Hpa:
    """One deployment's HPA (one model's replicas)."""

    tolerance: float = TOLERANCE
    behavior: Behavior = Behavior()
    _wanted: deque = field(default_factory=deque)   # (t, recommendation)
    _counts: deque = field(default_factory=deque)   # (t, replicas set)

    def recommend(self, t: float, current: int, ratio: float) -> int:
        """The replica count for ``ratio`` (metric per replica / target)."""
        if current <= 0:
            raw = 1 if ratio > 0 else 0
        elif abs(ratio - 1.0) <= self.tolerance:
            raw = current
        else:
            raw = math.ceil(current * ratio - 1e-9)
        return self.scale(t, current, raw)

    def scale(self, t: float, current: int, raw: int) -> int:
        """A desired count ``raw`` through the stabilisation windows and the rate limits."""
        b = self.behavior
        self._wanted.append((t, raw))
        horizon = max(b.up_window_s, b.down_window_s)
        while self._wanted and self._wanted[0][0] < t - horizon:
            self._wanted.popleft()
        if raw > current:
            want = min(w for s, w in self._wanted if s >= t - b.up_window_s)
            want = max(want, current)
            base = self._count_at(t - b.up_period_s, current)
            want = min(want, max(2 * base, base + b.up_pods))
        elif raw < current:
            want = max(w for s, w in self._wanted if s >= t - b.down_window_s)
            want = min(want, current)
            if b.down_pods is not None:
                base = self._count_at(t - b.down_period_s, current)
                want = max(want, base - b.down_pods)
        else:
            want = current
        self._counts.append((t, want))
        while len(self._counts) > 1 and self._counts[1][0] <= t - 3600:
            self._counts.popleft()
        return want

    def _count_at(self, t: float, default: int) -> int:
        """The count the HPA had set at ``t`` (the start of a rate-limit period)."""
        got = default
        for s, n in self._counts:
            if s > t:
                break
            got = n
        return got
