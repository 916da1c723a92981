"""Metric formulas (``docs/simulator.md``, "Metrics").

* TTFT = first token - arrival at the router; on time = TTFT <= target.
* utility = realised quality - lambda * realised cost (micro-dollars);
* OnTimeUtility = mean over all requests of utility x 1{on time};
* AUC of OnTimeUtility over a sweep of arrival rates (trapezoid rule over the rates);
* forecast MAPE = mean |forecast - realised TTFT| / realised TTFT;
* cache hit rate (with prefix caching) = prompt tokens found cached / prompt tokens looked up,
  over every instance of the pool (vLLM's prefix_cache_hits / prefix_cache_queries).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from duetime.sim.cluster import SimResult


def summarize(res: SimResult) -> dict[str, Any]:
    """One row of headline numbers for a run."""
    ttft = res.ttft
    on_time = ttft <= res.requests.target
    util = res.quality - res.lam * res.cost
    out: dict[str, Any] = {
        "requests": len(ttft),
        "mean_ttft_s": float(np.mean(ttft)),
        "p50_ttft_s": float(np.percentile(ttft, 50)),
        "p95_ttft_s": float(np.percentile(ttft, 95)),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "on_time": float(np.mean(on_time)),
        "utility": float(np.mean(util)),
        "ontime_utility": float(np.mean(util * on_time)),
        "mean_quality": float(np.mean(res.quality)),
        "mean_cost_micro_usd": float(np.mean(res.cost)),
    }
    mape = forecast_mape(res.forecast, ttft)
    if mape is not None:
        out["forecast_mape"] = mape
    hit = res.cache_hit_rate
    if hit is not None:
        out["cache_hit_rate"] = hit
    return out


def forecast_mape(forecast: np.ndarray, ttft: np.ndarray) -> float | None:
    """MAPE over the requests that have a finite forecast (None if none has)."""
    ok = np.isfinite(forecast) & (ttft > 0)
    if not ok.any():
        return None
    return float(np.mean(np.abs(forecast[ok] - ttft[ok]) / ttft[ok]))


def auc(rates: list[float] | np.ndarray, values: list[float] | np.ndarray) -> float:
    """Area under a metric-vs-rate curve (trapezoid rule, rates sorted)."""
    r = np.asarray(rates, dtype=float)
    v = np.asarray(values, dtype=float)
    order = np.argsort(r)
    r, v = r[order], v[order]
    return float(np.sum((r[1:] - r[:-1]) * (v[1:] + v[:-1]) / 2.0))


def routing_share(res: SimResult) -> dict[str, dict[str, float]]:
    """Share of each task's requests sent to each model: {task: {model: fraction}}."""
    tasks, models = res.requests.tasks, res.requests.models
    model = res.model
    out: dict[str, dict[str, float]] = {}
    for ti, t in enumerate(tasks):
        mine = res.requests.task == ti
        n = int(mine.sum())
        out[t] = {m: (float(np.sum(model[mine] == mi)) / n if n else 0.0)
                  for mi, m in enumerate(models)}
    return out
