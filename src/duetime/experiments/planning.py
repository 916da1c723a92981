"""The ``plan`` experiment: capacity planned jointly with the router in the loop, against the
pool an operator sizes model by model today.

On the paper's workload (its three models on the H100 deployments their profiles were measured
on) and a heterogeneous-GPU variant (each model on each GPU of the catalogue, derived profiles),
at three rates:

- *joint*: ``duetime plan``'s search (:func:`duetime.plan.search.search`): the cheapest pool
  whose every class is on time and whose mean quality meets the floor with ``sfs`` routing it;
- *model by model*: each model given the traffic a latency-agnostic router sends it (its share
  of each class, routed by utility alone, which does not depend on load), on the deployment
  that serves that traffic at the least cost, with the replicas that keep its utilization
  (engine-seconds of work a second, :func:`duetime.plan.bounds.work_seconds`, over replicas)
  under a cap; the cap is lowered from 1.0 (the bound saturated) in steps of 0.1 until the
  pool, routed by the same ``sfs``, meets the same floors: the cheapest pool this way of sizing
  gives (an operator would pick one cap ahead; this one is picked knowing the answer). Both
  are judged by the same simulations (same stream, same rules:
  :class:`duetime.plan.evaluate.Evaluator`).

And, on the paper's variant, the search against simulating every pool of a space small enough
to enumerate; and a day's schedule (a diurnal rate between the lowest and highest rate) against
the static peak pool, in GPU-hours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from duetime.engine.profiles import measured_option
from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.plan.evaluate import Evaluator, Outcome, Pool, pool_cost, pool_gpus, pool_label
from duetime.plan.problem import PlanProblem, problem_from_dict
from duetime.plan.rates import diurnal
from duetime.plan.schedule import plan_schedule
from duetime.plan.search import Bounds, enumerate_grid, search
from duetime.workload import load_workload

RATES = (8.6, 20.0, 40.0)  # the paper's knee (its one-instance-each pool saturates), x2.3, x4.7
QUICK_RATES = (8.6, 13.0, 20.0)
VARIANTS = ("paper", "heterogeneous")
CONSTRAINTS = {"on_time": 0.95, "quality": 0.8}
CAPS = tuple(round(1.0 - 0.1 * k, 1) for k in range(10))  # 1.0 (saturated) .. 0.1
# per run: requests a simulation (and at most), replicas of one deployment; the grid's space
FULL = {"requests": 4000, "max_requests": 16000, "max_replicas": 8}
QUICK = {"requests": 1000, "max_requests": 4000, "max_replicas": 4}
GRID = {"requests": 2000, "max_requests": 8000, "max_replicas": 6}
QUICK_GRID = {"requests": 1000, "max_requests": 4000, "max_replicas": 4}
DAY = {"requests": 2000, "max_requests": 8000, "max_replicas": 8, "objective": "gpus"}
QUICK_DAY = {"requests": 1000, "max_requests": 4000, "max_replicas": 4, "objective": "gpus"}


def problem(variant: str, rate: float, settings: dict[str, Any], seed: int) -> PlanProblem:
    """The plan of one variant at one rate."""
    data: dict[str, Any] = {"workload": "paper", "rate": rate, "seed": seed,
                            "constraints": CONSTRAINTS, **settings}
    if variant == "paper":
        workload = load_workload("paper")
        data["options"] = [measured_option(m).name for m in workload.model_names]
    elif variant != "heterogeneous":
        raise ValueError(f"unknown variant {variant!r}")
    return problem_from_dict(data, f"plan experiment ({variant})")


def model_by_model(problem: PlanProblem, ev: Evaluator) -> tuple[float | None, Outcome | None,
                                                                  dict[str, float]]:
    """The operator's sizing (module doc): the cap that met the floors (None: none did), the
    pool's outcome, and each model's share of the traffic."""
    p = problem
    reqs = ev.requests()
    # latency-agnostic's split: one replica of each model (the split does not depend on load,
    # nor on the deployment: a request's utility uses the model's price)
    one_each = tuple((next(o for o in p.options if o.model == m), 1) for m in p.models)
    agnostic = Evaluator(replace(p, router="latency-agnostic", params={}))
    res = agnostic.simulate(one_each, reqs)
    col = {m: k for k, m in enumerate(reqs.models)}
    bounds = Bounds(ev)
    n_c = len(p.classes)
    counts = np.maximum(np.bincount(reqs.task, minlength=n_c), 1)
    share = {m: np.bincount(reqs.task[res.model == col[m]], minlength=n_c) / counts
             for m in p.models}
    load = {o: float((bounds.class_rate * share[o.model] * bounds.work[o]).sum())
            for o in p.options}  # engine-seconds a second of work on deployment o
    sent = {m: res.model == col[m] for m in p.models}

    def serves(o) -> bool:  # idle, the model's requests meet every class floor on o
        mine = sent[o.model]
        for c, name in enumerate(p.classes):
            sel = mine & (reqs.task == c)
            if sel.any() and bounds.idle[o][sel].mean() < p.constraints.on_time[name]:
                return False
        return True

    for cap in CAPS:
        pool: list[tuple[Any, int]] = []
        for m in p.models:
            if not sent[m].any():
                continue
            fits = [o for o in p.options if o.model == m and serves(o)] or \
                [o for o in p.options if o.model == m]
            n = {o: max(1, math.ceil(load[o] / cap - 1e-9)) for o in fits}
            best = min(fits, key=lambda o: (n[o] * p.price(o), n[o] * o.tp))
            pool.append((best, n[best]))
        order = {o: k for k, o in enumerate(p.options)}
        canon: Pool = tuple(sorted(pool, key=lambda x: order[x[0]]))
        out = ev.evaluate(canon)
        if out.meets:
            return cap, out, {m: float(sent[m].mean()) for m in p.models}
    return None, None, {m: float(sent[m].mean()) for m in p.models}


def joint_and_independent(variant: str, rate: float, quick: bool, seed: int
                          ) -> dict[str, Any]:
    """One (variant, rate): the joint plan and the model-by-model pool (a fan-out's job)."""
    prob = problem(variant, rate, QUICK if quick else FULL, seed)
    t0 = time.perf_counter()
    joint = search(prob, Evaluator(prob))
    t_joint = time.perf_counter() - t0
    ev = Evaluator(prob)
    cap, indep, shares = model_by_model(prob, ev)
    return {"variant": variant, "rate": rate, "joint": _row(prob, joint.best),
            "joint_simulations": joint.simulations, "joint_wall_s": t_joint,
            "independent": _row(prob, indep), "cap": cap, "shares": shares,
            "independent_simulations": ev.simulations}


def search_and_grid(rate: float, quick: bool, seed: int) -> dict[str, Any]:
    """The search against every pool simulated, on the paper's variant (a fan-out's job)."""
    prob = problem("paper", rate, QUICK_GRID if quick else GRID, seed)
    s = search(prob, Evaluator(prob))
    g = enumerate_grid(prob, Evaluator(prob))
    return {"rate": rate, "search": _row(prob, s.best), "grid": _row(prob, g.best),
            "search_simulations": s.simulations, "grid_simulations": g.simulations,
            "grid_pools": g.pools_considered, "search_wall_s": s.wall_s, "grid_wall_s": g.wall_s}


def _row(prob: PlanProblem, o: Outcome | None) -> dict[str, Any] | None:
    if o is None:
        return None
    return {"pool": pool_label(o.pool), "cost_per_hour": pool_cost(o.pool, prob),
            "gpus": pool_gpus(o.pool), "worst_on_time": o.worst_on_time,
            "quality": o.quality, "ontime_utility": o.ontime_utility}


def run_plan(out: Path, quick: bool, seed: int, log: Callable[[str], None], fanout: Fanout
             ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The runs, ``summary.json``'s content and the report's sections."""
    rates = QUICK_RATES if quick else RATES
    jobs = [(v, r, quick, seed) for v in VARIANTS for r in rates]

    def done(k: int, got: dict[str, Any]) -> None:
        j, i = got["joint"], got["independent"]
        log(f"[{k + 1}/{len(jobs)}] {got['variant']} @ {got['rate']:g} q/s: joint "
            + (f"{j['cost_per_hour']:.2f}" if j else "none") + " USD/h, model by model "
            + (f"{i['cost_per_hour']:.2f}" if i else "none") + " USD/h")

    pairs = fanout.map(joint_and_independent, jobs, done)
    grids = fanout.map(search_and_grid, [(r, quick, seed) for r in rates])
    log("search and grid: " + ", ".join(
        f"{g['rate']:g} q/s {g['search_simulations']}/{g['grid_simulations']} runs"
        for g in grids))
    day_problem = replace(problem("heterogeneous", max(rates), QUICK_DAY if quick else DAY,
                                  seed),
                          intervals=tuple(diurnal(max(rates), min(rates))),
                          schedule_source=f"diurnal {max(rates):g} -> {min(rates):g} q/s")
    t0 = time.perf_counter()
    day = plan_schedule(day_problem, fanout=fanout)
    day_wall = time.perf_counter() - t0
    rows = _rows(pairs)
    summary = _summary(pairs, grids, day, day_problem, day_wall, quick, rates)
    _plot(out / "plan_cost.png", rows)
    return rows, summary, _sections(rows, grids, summary, rates)


def _rows(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for got in pairs:
        for method in ("joint", "independent"):
            r = got[method]
            label = "joint" if method == "joint" else "model by model"
            rows.append({"router": "sfs", "rate": got["rate"], "variant": got["variant"],
                         "method": label, "line": f"{got['variant']}: {label}",
                         "utilization_cap": got["cap"] if method == "independent" else "",
                         **(r or {"pool": "(none meets the floors)"}),
                         "simulations": got[f"{method}_simulations"]})
    return rows


def _ratio(a: dict | None, b: dict | None, key: str = "cost_per_hour") -> float | None:
    return None if a is None or b is None else a[key] / b[key]


def _summary(pairs, grids, day, day_problem, day_wall, quick, rates) -> dict[str, Any]:
    joint_vs = {v: {f"{g['rate']:g}": _ratio(g["joint"], g["independent"])
                    for g in pairs if g["variant"] == v} for v in VARIANTS}
    search_vs = {f"{g['rate']:g}": _ratio(g["search"], g["grid"]) for g in grids}
    sims_vs = {f"{g['rate']:g}": g["search_simulations"] / g["grid_simulations"]
               for g in grids}
    static = day.static_gpu_hours()
    settings = QUICK if quick else FULL
    return {
        "rates": list(rates), "constraints": CONSTRAINTS, "router": "sfs",
        "settings": settings, "utilization_caps": list(CAPS),
        "joint_vs_independent_cost": joint_vs,
        "joint_vs_independent_cost_max": max(
            (x for v in joint_vs.values() for x in v.values() if x is not None), default=None),
        "search_vs_grid_cost": search_vs,
        "search_simulations_vs_grid": sims_vs,
        "grid_pools": grids[0]["grid_pools"] if grids else 0,
        "diurnal_gpu_hours_vs_static_peak": None if not static else day.gpu_hours() / static,
        "diurnal": {"source": day_problem.schedule_source, "intervals": len(day.intervals),
                    "scale_up_delay_s": day.delay_s, "objective": day_problem.objective,
                    "gpu_hours": day.gpu_hours(), "static_peak_gpu_hours": static,
                    "cost": day.cost(day_problem),
                    "static_peak_pool": None if day.peak.best is None
                    else pool_label(day.peak.best.pool), "wall_s": day_wall},
        "pools": [{k: g[k] for k in ("variant", "rate", "joint", "independent", "cap",
                                     "shares")} for g in pairs]}


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    pts = [r for r in rows if "cost_per_hour" in r]
    if pts:
        rp.line_plot(path, pts, "rate", "cost_per_hour", group="line",
                     title="Cheapest pool meeting the floors: joint plan vs model by model",
                     xlabel="arrival rate (q/s)", ylabel="USD per hour")


def _sections(rows, grids, summary, rates) -> list[str]:
    d = summary["diurnal"]
    ratio = summary["diurnal_gpu_hours_vs_static_peak"]
    grid_rows = [{"rate": g["rate"], "search pool": (g["search"] or {}).get("pool", "none"),
                  "search USD/h": (g["search"] or {}).get("cost_per_hour", ""),
                  "grid USD/h": (g["grid"] or {}).get("cost_per_hour", ""),
                  "search runs": g["search_simulations"], "grid runs": g["grid_simulations"],
                  "grid pools": g["grid_pools"]} for g in grids]
    ratios = [{"variant": v, **{f"{r} q/s": x for r, x in per.items()}}
              for v, per in summary["joint_vs_independent_cost"].items()]
    return [
        "## Joint plan vs model-by-model sizing\n\nThe cheapest pool whose every class is "
        f"on time ≥ {CONSTRAINTS['on_time']:g} with mean quality ≥ {CONSTRAINTS['quality']:g}, "
        "`sfs` routing: found by `duetime plan`'s search (joint), or sized model by model at "
        "a latency-agnostic router's traffic shares under the highest utilization cap that "
        "meets the same floors. Cost ratio joint / model by model:\n\n"
        + rp.md_table(ratios, ["variant", *[f"{r:g} q/s" for r in rates]])
        + "\n![cost](plan_cost.png)\n",
        rp.md_table(rows, ["variant", "rate", "method", "pool", "cost_per_hour", "gpus",
                           "worst_on_time", "quality", "utilization_cap", "simulations"]),
        "## The search against every pool simulated (paper's deployments)\n\n"
        + rp.md_table(grid_rows, list(grid_rows[0])) if grid_rows else "",
        f"## A day\n\n{d['source']}, {d['intervals']} intervals of 15 minutes, scale-up delay "
        f"{d['scale_up_delay_s']:g} s, objective {d['objective']}, the heterogeneous "
        f"deployments: {d['gpu_hours']:.1f} GPU-hours against {d['static_peak_gpu_hours']} "
        f"for the static peak pool ({d['static_peak_pool']})"
        + (f": {ratio:.3f}×" if ratio is not None else "") + f" ({d['wall_s']:.0f} s).\n"]
