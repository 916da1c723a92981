"""SFS: replay the instance's scheduler forward from its snapshot (the engine's forecast)."""

from __future__ import annotations

from duetime.engine.forecasting import ForecastError, forecast
from duetime.estimate.base import InstanceView


class SfsEstimator:
    name = "sfs"

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float) -> float:
        """Seconds from ``now`` to a new request's first token (inf if it cannot be served
        there: too long, KV too small)."""
        snap = view.snapshot()
        try:
            est = forecast(snap, prompt_tokens).estimate_s
        except ForecastError:
            return float("inf")
        return est + (snap.time - now) + view.request_overhead_s

    def e2e(self, view: InstanceView, prompt_tokens: int, output_tokens: int,
            now: float) -> float:
        """Seconds from ``now`` until a new request of ``output_tokens`` output tokens finishes
        (the replay until its end; inf if it cannot be served there). Like the TTCA router has
        always done, it counts engine time only (no request overhead)."""
        snap = view.snapshot()
        try:
            return forecast(snap, prompt_tokens, output_tokens,
                            until="finish").estimate_s + (snap.time - now)
        except ForecastError:
            return float("inf")
