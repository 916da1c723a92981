"""Experiment ``lora``: many fine-tunes on one pool. Replicas of one base model (the paper
profile's ``qwen3-8b``) serve ``adapters`` LoRA adapters each (every adapter on every replica,
as ``--lora-modules`` loads them), at most ``max_loras`` of them in one step (vLLM's cap: a
waiting request whose adapter would exceed it is skipped while later ones pass it,
``docs/scheduling-rules.md``). Requests name an adapter drawn with Zipf popularity (``ZIPF_S``)
and have the paper's lengths and TTFT targets.

Routers: ``sfs`` (its forecast replays the cap: a request for an adapter that would be
skipped on one replica goes to another where it runs now), ``lora-affinity`` (llm-d's
lora-affinity scorer with its queue and kv-cache-utilization scorers, weights 1:1:1),
``load-aware`` and ``round-robin``. Loads are fractions of the pool's capacity without
adapters (``CAPACITY_QPS`` per replica, the highest rate at which ``round-robin`` keeps 95% of
requests on time on the base model alone in this experiment's pool: 14 q/s over the 4
replicas, 0.963 on time, 16 q/s 0.937; 1,500 requests, seed 0).

Settings: (adapters, max_loras) in :data:`SETTINGS`; ``summary.json``:
``sfs_gain_vs_lora_affinity`` (OnTimeUtility AUC over the loads, sfs / lora-affinity - 1, per
setting and over all), p90 TTFT per router, load and setting, and whether sfs's p90 TTFT is no
worse than lora-affinity's wherever both are on time for at least 90% of requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.experiments.runner import Point, Runner, run_points
from duetime.metrics import auc
from duetime.workload import (
    RequestSet,
    WorkloadProfile,
    load_workload,
    make_arrivals,
    sample_requests,
)

BASE = "qwen3-8b"
REPLICAS = 4
CAPACITY_QPS = 3.5  # per replica, without adapters (module doc)
LOADS = (0.3, 0.5, 0.7, 0.9)
QUICK_LOADS = (0.3, 0.7)
SETTINGS = ((8, 2), (8, 8), (64, 4), (64, 8))  # (adapters, max_loras)
QUICK_SETTINGS = ((8, 2), (64, 8))
ROUTERS = ("sfs", "lora-affinity", "load-aware", "round-robin")
ZIPF_S = 1.0
REQUESTS = 3000
QUICK_REQUESTS = 400
COLUMNS = ["adapters", "max_loras", "load", "router", "on_time", "ontime_utility",
           "p50_ttft_s", "p90_ttft_s", "p99_ttft_s"]


def lora_profile(paper: WorkloadProfile, max_loras: int, replicas: int) -> WorkloadProfile:
    """The paper's profile cut to its ``BASE`` model, ``replicas`` replicas of it, each with
    ``max_loras`` (vLLM's ``--enable-lora --max-loras``)."""
    spec = paper.models[BASE]
    spec = replace(spec, config=replace(spec.config, max_loras=max_loras))
    tasks = {name: replace(t, output_scale={BASE: t.output_scale[BASE]},
                           accuracy={BASE: t.accuracy[BASE]})
             for name, t in paper.tasks.items()}
    return replace(paper, name=f"{paper.name}-lora", models={BASE: spec}, tasks=tasks,
                   replicas={BASE: replicas})


def zipf_adapters(n: int, adapters: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Adapter ids 1..``adapters`` for ``n`` requests, P(k) ∝ k^-s (id 1 the most popular)."""
    p = 1.0 / np.arange(1, adapters + 1) ** s
    return rng.choice(np.arange(1, adapters + 1), size=n, p=p / p.sum()).astype(np.int64)


def lora_stream(profile: WorkloadProfile, rate: float, n: int, adapters: int,
                seed: int) -> RequestSet:
    """``n`` Poisson requests at ``rate`` with the profile's lengths and targets, each naming
    an adapter (seeded by the seed, the rate, ``n`` and ``adapters``: every router and
    ``max_loras`` of a point sees the same requests)."""
    rng = np.random.default_rng([seed, int(rate * 1000), n, adapters, 35])
    times = make_arrivals("poisson", rate).times(n, rng)
    rs = sample_requests(profile, times, rng)
    return replace(rs, adapter=zipf_adapters(n, adapters, ZIPF_S, rng))


def run_lora(out: Path, quick: bool, seed: int, log: Callable[[str], None], fanout: Fanout
             ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The runs, ``summary.json``'s content and the report's sections."""
    paper = load_workload("paper")
    loads = QUICK_LOADS if quick else LOADS
    settings = QUICK_SETTINGS if quick else SETTINGS
    n = QUICK_REQUESTS if quick else REQUESTS
    jobs, meta = [], []
    for adapters, max_loras in settings:
        prof = lora_profile(paper, max_loras, REPLICAS)
        runner = Runner(prof, seed=seed)
        for load in loads:
            rate = round(load * CAPACITY_QPS * REPLICAS, 6)
            stream = lora_stream(prof, rate, n, adapters, seed)
            for router in ROUTERS:
                p = Point(router, rate, n,
                          label=f"{adapters} adapters, max_loras {max_loras}, load {load:g}: "
                          f"{router}")
                runner.set_stream(p, stream)
                jobs.append((runner.portable(p), p))
                meta.append((adapters, max_loras, load, router))
    rows: list[dict[str, Any]] = []
    for (adapters, max_loras, load, router), (row, res) in zip(meta, run_points(
            jobs, fanout, progress=log, keep=lambda p: True), strict=True):
        row.update(router=router, adapters=adapters, max_loras=max_loras, load=load,
                   p90_ttft_s=float(np.percentile(res.ttft, 90)))
        rows.append(row)
    return rows, _summary(rows, settings, loads, n), _sections(out, rows, settings, n)


def _auc(rows: list[dict[str, Any]], router: str) -> float:
    mine = sorted((x for x in rows if x["router"] == router), key=lambda x: x["load"])
    if len(mine) < 2:
        return mine[0]["ontime_utility"] if mine else 0.0
    return auc([x["load"] for x in mine], [x["ontime_utility"] for x in mine])


def _summary(rows: list[dict[str, Any]], settings: tuple, loads: tuple, n: int
             ) -> dict[str, Any]:
    per: dict[str, Any] = {}
    aucs = {r: 0.0 for r in ROUTERS}
    p90_ok = True
    for adapters, max_loras in settings:
        key = f"{adapters} adapters, max_loras {max_loras}"
        mine = [x for x in rows if x["adapters"] == adapters and x["max_loras"] == max_loras]
        a = {r: _auc(mine, r) for r in ROUTERS}
        for r in ROUTERS:
            aucs[r] += a[r]
        both = []
        for load in loads:
            s = next(x for x in mine if x["router"] == "sfs" and x["load"] == load)
            la = next(x for x in mine if x["router"] == "lora-affinity" and x["load"] == load)
            if s["on_time"] >= 0.9 and la["on_time"] >= 0.9:
                both.append(load)
                p90_ok &= s["p90_ttft_s"] <= la["p90_ttft_s"] + 1e-12
        per[key] = {
            "ontime_utility_auc": a,
            "sfs_gain_vs_lora_affinity": a["sfs"] / a["lora-affinity"] - 1.0
            if a["lora-affinity"] > 0 else None,
            "p90_ttft_s": {r: {f"{load:g}": x["p90_ttft_s"] for x in mine
                               for load in loads if x["router"] == r and x["load"] == load}
                           for r in ROUTERS},
            "loads_both_on_time_90": both}
    return {
        "base_model": BASE, "replicas": REPLICAS, "capacity_qps_per_replica": CAPACITY_QPS,
        "loads": list(loads), "settings": [list(s) for s in settings], "zipf_s": ZIPF_S,
        "requests": n, "routers": list(ROUTERS),
        "ontime_utility_auc": aucs,
        "sfs_gain_vs_lora_affinity": aucs["sfs"] / aucs["lora-affinity"] - 1.0
        if aucs["lora-affinity"] > 0 else None,
        "sfs_p90_no_worse_where_both_on_time": p90_ok,
        "by_setting": per}


def _sections(out: Path, rows: list[dict[str, Any]], settings: tuple, n: int) -> list[str]:
    panels = [(f"{a} adapters, max_loras {k}",
               [x for x in rows if x["adapters"] == a and x["max_loras"] == k])
              for a, k in settings]
    for key, label in (("ontime_utility", "OnTimeUtility"), ("p90_ttft_s", "p90 TTFT (s)")):
        rp.panels_plot(out / f"lora_{key}.png", panels, "load", key,
                       title=f"{label} against load", xlabel="load (of the pool's capacity "
                       "without adapters)", ylabel=label)
    return [
        "## Many adapters on one pool\n\n"
        f"{REPLICAS} replicas of `{BASE}`; requests name adapters with Zipf({ZIPF_S:g}) "
        f"popularity; {n} requests per run; load as a fraction of {CAPACITY_QPS:g} q/s per "
        "replica (module doc of `duetime.experiments.lora`).\n\n" + rp.md_table(rows, COLUMNS),
        "![OnTimeUtility](lora_ontime_utility.png)\n\n![p90 TTFT](lora_p90_ttft_s.png)\n"]
