"""``queue-threshold``: the vLLM production stack's KEDA rule — scale a model's replicas on
the requests waiting at them (``vllm:num_requests_waiting`` summed over the model's pods),
with a target of 5 waiting per replica, through the HPA's arithmetic
(:mod:`duetime.autoscale.hpa`, Kubernetes' default behaviour): desired = ceil(total waiting
/ threshold), at least the minimum (vllm-project/production-stack's KEDA tutorial and docs:
``vllm:num_requests_waiting``, threshold 5, ``AverageValue``, polling every 15 s). The
published query is not summed over pods, which KEDA refuses once there are two; summed
here, as the rule means."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from duetime.autoscale.hpa import TOLERANCE, Behavior, Hpa
from duetime.autoscale.status import PoolStatus
from duetime.policy.registry import Param

THRESHOLD = Param("threshold", "threshold", float, 5.0,
                  "requests waiting per replica the HPA aims at", min=0.0, min_open=True)
STABILIZATION = Param("scale_down_stabilization_s", "stabilization_s", float,
                      Behavior().down_window_s,
                      "a scale-down takes the highest count wanted over this window", min=0.0)


@dataclass(slots=True)
class QueueThreshold:
    threshold: float = THRESHOLD.default
    stabilization_s: float = STABILIZATION.default
    _hpa: dict[str, Hpa] = field(default_factory=dict)

    name: ClassVar[str] = "queue-threshold"
    summary: ClassVar[str] = ("the vLLM production stack's KEDA rule: replicas = ceil(requests "
                              "waiting / threshold), through the HPA")
    params: ClassVar[tuple[Param, ...]] = (THRESHOLD, STABILIZATION)

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        out = {}
        for m in status.models:
            # an external metric with an average-value target: the HPA divides the total by
            # the target (its ratio is total / (target x the deployment's replicas))
            current = status.provisioned(m)
            hpa = self._hpa.setdefault(m, Hpa(TOLERANCE,
                                              Behavior(down_window_s=self.stabilization_s)))
            ratio = status.waiting.get(m, 0) / (self.threshold * max(current, 1))
            out[m] = hpa.recommend(status.t, current, ratio)
        return out
