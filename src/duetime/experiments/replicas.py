"""Experiment ``replicas``: the cost of being many. N routers (1, 2, 4, 8) over the paper's pool
at the paper's 8.6 q/s, arrivals spread over them at random (a load balancer in front), each
routing from its own views of the instances (:mod:`duetime.sim.fleet`): *independent* (only its
own dispatches) or *shared* (everyone's, the others' ``staleness`` seconds late). OnTimeUtility
and p90 TTFT against N and staleness, for ``sfs`` and ``load-aware``.

One router's views hold every request it sent, at once: the views of a single gateway, which
for ``sfs`` decide exactly as reading the instances' true state (tested). The ratios in
``summary.json`` are each setting's OnTimeUtility over that one router's, on the same requests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.experiments.runner import Point, Runner, run_points
from duetime.sim.fleet import FleetSpec
from duetime.workload import load_workload

RATE = 8.6  # q/s: the paper's point (the load sweep's)
ROUTERS = ("sfs", "load-aware")
FLEETS = (1, 2, 4, 8)
STALENESS_S = (0.0, 0.1, 0.5, 2.0)
REQUESTS = 16000
QUICK_FLEETS = (1, 2, 4)
QUICK_STALENESS_S = (0.1, 0.5)
QUICK_REQUESTS = 1200
HEADLINE_ROUTERS = 4
HEADLINE_STALENESS_S = 0.1  # a ledger synchronised every 100 ms (see the module doc)
TARGET = 0.95
SPREAD = "random"
COLUMNS = ["router", "routers", "view", "ontime_utility", "vs_single", "on_time", "p50_ttft_s",
           "p90_ttft_s", "p99_ttft_s", "view_share", "decision_us_mean", "wall_s"]


def _label(sharing: str, staleness: float) -> str:
    return "independent" if sharing == "independent" else f"shared {staleness:g} s"


def _settings(fleets: tuple[int, ...], staleness: tuple[float, ...]
              ) -> list[tuple[int, str, float]]:
    out = [(1, "shared", 0.0)]  # one router: its views know all it sent (both kinds agree)
    for n in fleets:
        if n > 1:
            out += [(n, "independent", 0.0)] + [(n, "shared", s) for s in staleness]
    return out


def run_replicas(out: Path, quick: bool, seed: int, log: Callable[[str], None],
                 fanout: Fanout) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The runs, ``summary.json``'s content and the report's sections."""
    fleets = QUICK_FLEETS if quick else FLEETS
    staleness = QUICK_STALENESS_S if quick else STALENESS_S
    n_req = QUICK_REQUESTS if quick else REQUESTS
    runner = Runner(load_workload("paper"), seed=seed)
    settings = _settings(fleets, staleness)
    jobs = [(runner, Point(router, RATE, n_req, fleet=FleetSpec(n, sharing, s, SPREAD),
                           label=f"{router}, {n} router(s), "
                                 f"{'single' if n == 1 else _label(sharing, s)}"))
            for router in ROUTERS for n, sharing, s in settings]
    rows: list[dict[str, Any]] = []
    got = iter(run_points(jobs, fanout, progress=log, keep=lambda p: True))
    for router in ROUTERS:
        single = 1.0
        for n, sharing, s in settings:
            row, res = next(got)
            o = res.overhead_s
            row.update(router=router, view="single" if n == 1 else _label(sharing, s),
                       p90_ttft_s=float(np.percentile(res.ttft, 90)),
                       decision_us_mean=float(o.mean() * 1e6) if o is not None else 0.0)
            if n == 1:
                single = row["ontime_utility"]
            row["vs_single"] = row["ontime_utility"] / single
            rows.append(row)
    summary = _summary(rows, fleets, staleness, n_req)
    return rows, summary, _sections(out, rows, summary)


def _ratio(rows: list[dict[str, Any]], router: str, n: int, view: str) -> float | None:
    got = [x["vs_single"] for x in rows
           if x["router"] == router and x["routers"] == n and x["view"] == view]
    return got[0] if got else None


def _summary(rows: list[dict[str, Any]], fleets: tuple[int, ...],
             staleness: tuple[float, ...], n_req: int) -> dict[str, Any]:
    n = HEADLINE_ROUTERS
    by = {r: {"independent": _ratio(rows, r, n, "independent"),
              **{f"{s:g}": _ratio(rows, r, n, _label("shared", s)) for s in staleness}}
          for r in ROUTERS}
    shared = {k: v for k, v in by["sfs"].items() if k != "independent"}
    head = shared[f"{HEADLINE_STALENESS_S:g}"]
    kept = [float(k) for k, v in shared.items() if v is not None and v >= TARGET]
    table = {r: {str(x["routers"]): {} for x in rows if x["router"] == r} for r in ROUTERS}
    for x in rows:
        table[x["router"]][str(x["routers"])][x["view"]] = {
            "ontime_utility": x["ontime_utility"], "p90_ttft_s": x["p90_ttft_s"]}
    return {
        "rate": RATE, "requests_per_point": n_req, "routers": list(fleets),
        "staleness_s": list(staleness), "spread": SPREAD, "policies": list(ROUTERS),
        # at 4 routers: OnTimeUtility / one router's (sfs)
        "sfs_shared_vs_single": head, "sfs_shared_staleness_s": HEADLINE_STALENESS_S,
        "sfs_independent_vs_single": by["sfs"]["independent"],
        "sfs_shared_vs_single_by_staleness": shared,
        "load_aware_vs_single": by["load-aware"],
        "target": TARGET, "sfs_shared_target_met": head is not None and head >= TARGET,
        "sfs_shared_largest_staleness_meeting_target": max(kept) if kept else None,
        # router -> routers -> view -> {ontime_utility, p90_ttft_s}
        "table": table}


def _sections(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    ones = {r: next(x for x in rows if x["router"] == r and x["routers"] == 1)
            for r in ROUTERS}
    lines = []  # every view as a line over N, the one router at N = 1 included
    for x in rows:
        if x["routers"] > 1:
            lines.append(x)
    for r, one in ones.items():
        for v in {x["view"] for x in rows if x["router"] == r and x["routers"] > 1}:
            lines.append(dict(one, view=v))
    lines.sort(key=lambda x: (x["router"], x["view"], x["routers"]))
    panels = [(r, [x for x in lines if x["router"] == r]) for r in ROUTERS]
    for key, label, logy in (("ontime_utility", "OnTimeUtility", False),
                             ("p90_ttft_s", "p90 TTFT (s)", True)):
        rp.panels_plot(out / f"replicas_{key}.png", panels, "routers", key, group="view",
                       title=f"{label} against the number of routers ({RATE:g} q/s)",
                       xlabel="routers", ylabel=label, logy=logy)
    stale = [dict(x, fleet=f"{x['routers']} routers") for x in rows
             if x["view"].startswith("shared") and x["routers"] > 1]
    rp.panels_plot(out / "replicas_staleness.png",
                   [(r, [x for x in stale if x["router"] == r]) for r in ROUTERS],
                   "staleness_s", "vs_single", group="fleet",
                   title="Shared views: OnTimeUtility / one router's against staleness",
                   xlabel="staleness (s)", ylabel="OnTimeUtility / one router's")
    head, ind = summary["sfs_shared_vs_single"], summary["sfs_independent_vs_single"]
    met = "met" if summary["sfs_shared_target_met"] else "not met"
    return [
        "## Setting\n\n"
        f"The paper's pool and workload at {RATE:g} q/s, {summary['requests_per_point']} "
        f"requests per run; arrivals spread over the routers at {SPREAD}. Each router routes "
        "from its own shadow engine of every instance: *independent* views know only the "
        "router's own dispatches (their first tokens, token counts and ends as the instance "
        "streams them back); *shared* views also know every other router's dispatches, first "
        "tokens and ends, `staleness` seconds late. `view_share`: requests in the deciding "
        "router's views / requests in the instances, over the decisions. `vs_single`: "
        "OnTimeUtility / one router's on the same requests.\n",
        f"## Headline ({HEADLINE_ROUTERS} routers, sfs)\n\n"
        f"- shared, {HEADLINE_STALENESS_S:g} s stale: {head:.1%} of one router's "
        f"OnTimeUtility (target >= {TARGET:.0%}: {met}); by staleness: "
        + ", ".join(f"{k} s {v:.1%}" for k, v in
                    summary["sfs_shared_vs_single_by_staleness"].items() if v is not None)
        + f"\n- independent: {ind:.1%}\n",
        "## OnTimeUtility and p90 TTFT\n\n" + _grid(rows),
        "![OnTimeUtility](replicas_ontime_utility.png)\n\n![p90 TTFT](replicas_p90_ttft_s.png)"
        "\n\n![staleness](replicas_staleness.png)\n",
        "## All runs\n\n" + rp.md_table(rows, COLUMNS)]


def _grid(rows: list[dict[str, Any]]) -> str:
    """OnTimeUtility / p90 TTFT per (router, view) and number of routers."""
    ns = sorted({x["routers"] for x in rows})
    out = []
    for r in ROUTERS:
        one = next(x for x in rows if x["router"] == r and x["routers"] == 1)
        views = list(dict.fromkeys(x["view"] for x in rows if x["router"] == r
                                   and x["routers"] > 1))
        for v in views:
            row: dict[str, Any] = {"router": r, "view": v}
            for n in ns:
                got = one if n == 1 else next((x for x in rows if x["router"] == r
                                               and x["routers"] == n and x["view"] == v), None)
                row[f"N={n}"] = ("" if got is None else
                                 f"{got['ontime_utility']:.3f} / {got['p90_ttft_s']:.3f} s")
            out.append(row)
    return ("OnTimeUtility / p90 TTFT (N = 1: the one router, the same in every row)\n\n"
            + rp.md_table(out, ["router", "view", *(f"N={n}" for n in ns)]))
