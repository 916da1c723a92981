"""Experiment ``scale``: routing at cluster scale. The paper's workload on pools of 3, 30, 90
and 300 instances (1, 10, 30 and 100 replicas of each of its three models), every pool at the
same load per instance, for ``sfs`` and the baselines: does a bigger pool do at least as well,
and what does a decision cost?

The load is a fraction of the three-instance pool's capacity, taken as 9.5 q/s (the highest
rate of the paper's load sweep, where its routers' attainment falls), scaled with the number of
replicas: at 0.9, 8.55 q/s over 3 instances and 855 q/s over 300. Each pool gets the same
number of requests per instance, so every run covers about the same simulated time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.experiments.runner import Point, Runner, run_points
from duetime.workload import load_workload

CAPACITY_QPS = 9.5  # the three-instance pool's, per replica set (see the module doc)
LOADS = (0.7, 0.9)
REPLICAS = (1, 10, 30, 100)
QUICK_REPLICAS = (1, 10, 30)
ROUTERS = ("sfs", "round-robin", "shortest-queue", "load-aware", "latency-agnostic")
PER_INSTANCE = 150  # requests per instance and run
QUICK_PER_INSTANCE = 50
COLUMNS = ["instances", "load", "router", "rate", "on_time", "ontime_utility", "p99_ttft_s",
           "decision_us_p50", "decision_us_mean", "realtime_factor"]


def run_scale(out: Path, quick: bool, seed: int, log: Callable[[str], None],
              fanout: Fanout) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The runs, ``summary.json``'s content and the report's sections. (Decision times are
    measured in whatever process runs a point: beside other points when fanned out.)"""
    base = load_workload("paper")
    replicas = QUICK_REPLICAS if quick else REPLICAS
    per = QUICK_PER_INSTANCE if quick else PER_INSTANCE
    jobs, settings = [], []
    for r in replicas:
        prof = base.with_replicas(r)
        size = len(prof.instance_pairs())
        runner = Runner(prof, seed=seed)
        for load in LOADS:
            rate = round(load * CAPACITY_QPS * r, 6)
            for router in ROUTERS:
                jobs.append((runner, Point(router, rate, per * size,
                                           label=f"{size} instances, load {load:g}: {router}")))
                settings.append((size, r, load, router))
    rows: list[dict[str, Any]] = []
    for (size, r, load, router), (row, res) in zip(settings, run_points(
            jobs, fanout, progress=log, keep=lambda p: True), strict=True):
        o = res.overhead_s * 1e6 if res.overhead_s is not None else np.zeros(1)
        row.update(router=router, instances=size, replicas=r, load=load,
                   p99_ttft_s=float(np.percentile(res.ttft, 99)),
                   decision_us_p50=float(np.median(o)),
                   decision_us_mean=float(o.mean()),
                   realtime_factor=row["simulated_s"] / max(row["wall_s"], 1e-9))
        rows.append(row)
    return rows, _summary(rows, replicas, per), _sections(out, rows, per)


def _pick(rows: list[dict[str, Any]], router: str, load: float, key: str) -> dict[str, float]:
    return {str(x["instances"]): x[key] for x in rows
            if x["router"] == router and x["load"] == load}


def _summary(rows: list[dict[str, Any]], replicas: tuple[int, ...], per: int
             ) -> dict[str, Any]:
    by_load = {f"{load:g}": _pick(rows, "sfs", load, "on_time") for load in LOADS}
    otu = {f"{load:g}": _pick(rows, "sfs", load, "ontime_utility") for load in LOADS}
    small = str(min(int(k) for k in by_load[f"{LOADS[0]:g}"]))
    return {
        "capacity_qps_per_replica_set": CAPACITY_QPS, "loads": list(LOADS),
        "replicas": list(replicas), "requests_per_instance": per, "routers": list(ROUTERS),
        # per load, per pool size (instances)
        "sfs_on_time": by_load, "sfs_ontime_utility": otu,
        # sfs's decision time at the higher load, per pool size
        "decision_us_p50": _pick(rows, "sfs", LOADS[-1], "decision_us_p50"),
        "realtime_factor": _pick(rows, "sfs", LOADS[-1], "realtime_factor"),
        # at equal load per instance, no bigger pool below the three-instance one
        "sfs_bigger_pools_no_worse": all(
            v[size] >= v[small] - 1e-12 for d in (by_load, otu) for v in d.values()
            for size in v),
    }


def _sections(out: Path, rows: list[dict[str, Any]], per: int) -> list[str]:
    panels = [(f"load {load:g}", [x for x in rows if x["load"] == load]) for load in LOADS]
    for key, label in (("on_time", "on time"), ("ontime_utility", "OnTimeUtility"),
                       ("p99_ttft_s", "p99 TTFT (s)")):
        rp.panels_plot(out / f"scale_{key}.png", panels, "instances", key,
                       title=f"{label} against pool size (same load per instance)",
                       xlabel="instances", ylabel=label)
    sfs = [x for x in rows if x["router"] == "sfs"]
    rp.panels_plot(out / "scale_decision_us.png",
                   [(f"load {load:g}", [x for x in sfs if x["load"] == load]) for load in LOADS],
                   "instances", "decision_us_p50", title="sfs: one decision (p50)",
                   xlabel="instances", ylabel="µs", logy=True)
    return [
        "## Pools of replicas at the same load per instance\n\n"
        f"The paper's workload, {per} requests per instance and run; load as a fraction of "
        f"{CAPACITY_QPS:g} q/s per replica set (module doc of `duetime.experiments.scale`). "
        "`decision_us`: the router's wall time per decision; `realtime_factor`: simulated / "
        "wall seconds of the whole run.\n\n" + rp.md_table(rows, COLUMNS),
        "![on time](scale_on_time.png)\n\n![OnTimeUtility](scale_ontime_utility.png)\n\n"
        "![p99 TTFT](scale_p99_ttft_s.png)\n\n![decision](scale_decision_us.png)\n"]
