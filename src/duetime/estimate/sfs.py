"""SFS: replay the instance's scheduler forward from its snapshot (the engine's forecast)."""

from __future__ import annotations

from duetime.engine.forecasting import ForecastError, forecast
from duetime.estimate.base import InstanceView


class SfsEstimator:
    name = "sfs"

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float) -> float:
        snap = view.snapshot()
        try:
            est = forecast(snap, prompt_tokens).estimate_s
        except ForecastError:
            return float("inf")  # the probe cannot be served there (too long, KV too small)
        return est + (snap.time - now) + view.request_overhead_s
