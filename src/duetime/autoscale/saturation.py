"""``llm-d-saturation``: llm-d's SLO-aware autoscaling control law (llm-d
``docs/architecture/autoscaling/slo-aware-keda.md`` and its guide's ScaledObject, read at
llm-d commit a7922ed), per model:

- the signal, every 15 s: s_raw = max(P90 TTFT / TTFT SLO, P90 TPOT / TPOT SLO) over the last
  minute's requests (0 with no traffic), clamped at 2 and averaged over 45 s. Here each
  request has its own TTFT target, so the first term is the P90 of TTFT / target; the TPOT
  term applies where a TPOT SLO is given;
- the law (KEDA's formula, passed through as the desired count): with n replicas provisioned
  and r ready, above 0.55 d = n + ceil(n (s c / 0.55 - 1)), c = r / n when 0 < r < n (capacity
  already warming up is credited) else 1; below 0.40 d = n - floor(n (1 - s / 0.40)); between,
  n;
- through the HPA as configured there: scale-up stabilised over 30 s and limited to the larger
  of doubling and +4 pods per 60 s; scale-down stabilised over 180 s, one pod per 120 s.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from duetime.autoscale.hpa import Behavior, Hpa
from duetime.autoscale.status import PoolStatus
from duetime.policy.registry import Param

UP = Param("up", "up", float, 0.55, "scale up above this saturation", min=0.0, min_open=True)
DOWN = Param("down", "down", float, 0.40, "scale down below this saturation", min=0.0)
TPOT_SLO = Param("tpot_slo_ms", "tpot_slo_ms", float, 0.0,
                 "the TPOT SLO in the signal (0: TTFT only)", min=0.0)
CLAMP = 2.0
RATE_WINDOW_S = 60.0    # the P90s' histogram rates
SMOOTH_WINDOW_S = 45.0  # avg_over_time of the clamped signal
BEHAVIOR = Behavior(up_window_s=30.0, up_pods=4, up_period_s=60.0, down_window_s=180.0,
                    down_pods=1, down_period_s=120.0)


@dataclass(slots=True)
class LlmdSaturation:
    up: float = UP.default
    down: float = DOWN.default
    tpot_slo_ms: float = TPOT_SLO.default
    _samples: dict[str, deque] = field(default_factory=dict)
    _hpa: dict[str, Hpa] = field(default_factory=dict)

    name: ClassVar[str] = "llm-d-saturation"
    summary: ClassVar[str] = ("llm-d's SLO-aware KEDA law: P90 latency / SLO, smoothed; up "
                              "above 0.55 (credited for warming replicas), down below 0.40")
    params: ClassVar[tuple[Param, ...]] = (UP, DOWN, TPOT_SLO)

    def saturation(self, status: PoolStatus, model: str) -> float:
        """s_raw for ``model`` at the tick, clamped."""
        recent = status.recent_of(model)
        ttft, target = recent.first_tokens_since(status.t - RATE_WINDOW_S)
        s = float(np.quantile(ttft / target, 0.9)) if ttft.size else 0.0
        if self.tpot_slo_ms > 0:
            tpot = recent.tpot_since(status.t - RATE_WINDOW_S)
            if tpot.size:
                s = max(s, float(np.quantile(tpot, 0.9)) / (self.tpot_slo_ms / 1000.0))
        return min(s, CLAMP)

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        out = {}
        for m in status.models:
            samples = self._samples.setdefault(m, deque())
            samples.append((status.t, self.saturation(status, m)))
            while samples[0][0] <= status.t - SMOOTH_WINDOW_S:
                samples.popleft()
            s = sum(v for _, v in samples) / len(samples)
            n, r = status.provisioned(m), status.ready.get(m, 0)
            if s > self.up:
                c = r / n if 0 < r < n else 1.0
                d = n + math.ceil(n * (s * c / self.up - 1))
            elif s < self.down:
                d = n - math.floor(n * (1 - s / self.down))
            else:
                d = n
            hpa = self._hpa.setdefault(m, Hpa(behavior=BEHAVIOR))
            out[m] = hpa.scale(status.t, n, d)
        return out
