"""Metric formulas (``docs/simulator.md``, "Metrics").

* TTFT = first token - arrival at the router; on time = TTFT <= target.
* utility = realised quality - lambda * realised cost (micro-dollars);
* OnTimeUtility = mean over all requests of utility x 1{on time};
* AUC of OnTimeUtility over a sweep of arrival rates (trapezoid rule over the rates);
* forecast MAPE = mean |forecast - realised TTFT| / realised TTFT;
* with completion deadlines (a request set's ``deadline``): on deadline = finish - arrival <=
  deadline; OnTimeUtility by deadline = mean of utility x 1{on deadline} (requests without a
  deadline are on deadline); with TPOT targets (``tpot``): a request's TPOT = (finish - first
  token) / (output tokens - 1), attained when <= its target, over the requests with a target
  and more than one output token;
* with the admission queue (``ClusterSim(admission=...)``): the share of requests that waited
  in it and the p90 of the time waited (0 for those that did not);
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
    if res.requests.deadline is not None:
        met = deadline_met(res)
        out["on_deadline"] = float(np.mean(met))
        out["deadline_utility"] = float(np.mean(util * met))
        out["p90_e2e_s"] = float(np.percentile(res.finish - res.requests.arrival, 90))
    if res.requests.tpot is not None:
        has, met = tpot_met(res)
        out["tpot_attainment"] = float(np.mean(met[has])) if has.any() else 1.0
    if res.queue_s is not None:
        out["queued"] = float(np.mean(res.queue_s > 0))
        out["p90_queue_s"] = float(np.percentile(res.queue_s, 90))
    hit = res.cache_hit_rate
    if hit is not None:
        out["cache_hit_rate"] = hit
    return out


def deadline_met(res: SimResult) -> np.ndarray:
    """Per request: finished by its deadline (True where it has none)."""
    deadline = res.requests.deadline
    if deadline is None:
        return np.ones(len(res.finish), dtype=bool)
    return (res.finish - res.requests.arrival) <= deadline


def tpot_met(res: SimResult) -> tuple[np.ndarray, np.ndarray]:
    """Per request: whether it has a TPOT target to meet (a finite target and more than one
    output token), and whether its time per output token met it."""
    target = res.requests.tpot
    n = res.output_tokens
    if target is None:
        return np.zeros(len(n), dtype=bool), np.ones(len(n), dtype=bool)
    has = np.isfinite(target) & (n > 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = (res.finish - res.first_token) / np.maximum(n - 1, 1)
    return has, tpot <= target


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
