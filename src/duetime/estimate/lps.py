"""The LPS estimator: a limited-processor-sharing queue from time-averaged rates only.

Up to ``k`` requests are served at once; with arrival rate alpha and service capacity mu
(rho = alpha/mu < 1) the SFS paper approximates the expected wait as (alpha/mu)^k / (mu - alpha)
and adds the mean service time to the first token. It needs no view inside the engine: alpha,
the mean first-token and end-to-end latencies come from time-averaged observations
(``InstanceStats``); the capacity is mu = k / mean end-to-end latency. The paper observed
k ~ 25 on Qwen3-0.6B; ``k`` is a parameter (fit it from a calibration run's time-average
parallelism).
"""

from __future__ import annotations

from duetime.estimate.base import InstanceView

SATURATED_S = 60.0  # the forecast of an instance whose arrivals exceed its capacity


class LpsEstimator:
    name = "lps"

    def __init__(self, k: float = 25.0, default_service_s: float = 0.1) -> None:
        self.k = k
        self.default_service_s = default_service_s

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float) -> float:
        s = view.stats
        service = s.mean_ttft or self.default_service_s
        alpha, e2e = s.arrival_rate, s.mean_e2e
        if alpha <= 0 or e2e <= 0:
            return service
        mu = self.k / e2e
        if alpha >= mu:
            return SATURATED_S
        return (alpha / mu) ** self.k / (mu - alpha) + service
