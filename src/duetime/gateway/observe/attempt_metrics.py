"""The attempts in Prometheus: the attempt-lifecycle subscriber that keeps the ``duetime_*``
series about attempts (decisions, retries, in-flight gauges, TTFT and its target, forecast
errors, upstream errors, the TPOT target) up to date (the registry:
:mod:`duetime.gateway.prometheus`)."""

from __future__ import annotations

import math

from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.lifecycle import Attempt, Outcome, Subscriber


class AttemptMetrics(Subscriber):
    """Counts each attempt's events in the gateway's metrics."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.m = metrics

    def on_dispatch(self, a: Attempt) -> None:
        m, inst, f = self.m, a.inst, a.flight
        if a.number > 1:
            m.retries.inc()
        if a.failing_open:
            m.fail_open.labels(inst.name).inc()
        m.decisions.labels(inst.name, inst.model).inc()
        m.state_source.labels(inst.name, a.state_source).inc()
        m.prompt_tokens.labels(inst.name).inc(f.prompt_tokens)
        if inst.prefix_index is not None:
            m.cached_tokens.labels(inst.name, inst.cache_source).inc(f.cached_tokens)
        m.in_flight.labels(inst.name).inc()

    def on_first_token(self, a: Attempt) -> None:
        m, name, f = self.m, a.inst.name, a.flight
        assert f.first_token is not None
        if f.raw_forecast is not None:  # (the instance's correction learned from it)
            m.ttft_correction.labels(name).set(a.inst.ttft_correction.factor)
        ttft = f.first_token - a.arrival
        m.ttft.labels(name).observe(ttft)
        m.target.labels(name, "on_time" if ttft <= a.target_s else "late").inc()
        if f.forecast is not None and math.isfinite(f.forecast):
            observed = f.first_token - f.dispatched
            m.forecast_error.labels(name).observe(observed - f.forecast)
            m.forecast_error_sum.labels(name).inc(observed - f.forecast)
            if f.forecast > 0:
                m.forecast_ratio.labels(name).observe(observed / f.forecast)

    def on_end(self, a: Attempt) -> None:
        m, name, f = self.m, a.inst.name, a.flight
        m.in_flight.labels(name).dec()
        if a.outcome is Outcome.FAILED and a.failure is not None:
            m.upstream_errors.labels(name, a.failure[0]).inc()
        # the x-slo-tpot-ms target: the mean time per output token after the first
        if (a.tpot_target_s is not None and a.outcome in (Outcome.OK, Outcome.BROKEN)
                and f.first_token is not None and f.tokens >= 2 and a.ended is not None):
            tpot = (a.ended - f.first_token) / (f.tokens - 1)
            m.tpot_target.labels("on_time" if tpot <= a.tpot_target_s else "late").inc()
