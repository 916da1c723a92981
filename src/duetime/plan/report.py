"""A plan's outputs: ``summary.json``, ``report.md``, ``frontier.png`` (cost against the worst
class's on-time rate of every pool simulated), and pool YAMLs ``duetime serve --config``
accepts: ``pool.yaml`` (emulated instances) and ``pool-urls.yaml`` (a URL to fill in per
replica). A schedule's: its intervals' pools (``schedule.csv``, ``schedule.png``) and GPU-hours
against the static peak pool."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from duetime.experiments.report import write_json
from duetime.plan.evaluate import Outcome, Pool, pool_gpus
from duetime.plan.problem import PlanProblem
from duetime.plan.rates import level
from duetime.plan.schedule import STEP, ScheduleResult
from duetime.plan.search import SearchResult


def frontier(outcomes: list[Outcome]) -> list[Outcome]:
    """The pools no other beats on both cost and worst-class attainment, cheapest first."""
    out: list[Outcome] = []
    for o in sorted(outcomes, key=lambda o: (o.cost, -o.worst_on_time)):
        if not out or o.worst_on_time > out[-1].worst_on_time:
            out.append(o)
    return out


def option_rows(problem: PlanProblem) -> list[dict[str, Any]]:
    return [{"option": o.name, "model": o.model, "gpu": o.gpu, "tp": o.tp,
             "usd_per_hour": round(problem.price(o), 4),
             "profile": "derived" if problem.specs[o].derived_from else "measured",
             "derived_from": problem.specs[o].derived_from or None} for o in problem.options]


def summary(problem: PlanProblem, result: SearchResult) -> dict[str, Any]:
    c = problem.constraints
    return {
        "workload": problem.workload_source, "rate": problem.rate, "router": problem.router,
        "router_params": problem.params, "seed": problem.seed,
        "constraints": {"on_time": c.on_time, "quality": c.quality, "budget": c.budget},
        "options": option_rows(problem),
        "best": None if result.best is None else result.best.as_dict(),
        "search": {"simulations": result.simulations, "pools_considered":
                   result.pools_considered, "pruned": result.pruned,
                   "pools_simulated": len(result.outcomes),
                   "simulated_requests": sum(o.requests for o in result.outcomes),
                   "wall_s": round(result.wall_s, 2)},
        "frontier": [o.as_dict() for o in frontier(result.outcomes)],
        "simulated": [o.as_dict() for o in sorted(result.outcomes, key=lambda o: o.cost)],
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def pool_config(problem: PlanProblem, pool: Pool, *, urls: bool = False) -> dict[str, Any]:
    """A pool config for ``duetime serve --config``: each deployment an instance group of its
    replicas, with its (measured or derived) profile; emulated, or URL placeholders."""
    router: Any = problem.router if not problem.params else {"name": problem.router,
                                                            **problem.params}
    def rule(t) -> dict[str, float]:
        return {"base_ms": t.base_ms, "per_prompt_token_ms": t.per_prompt_token_ms,
                "min_ms": t.clip_ms[0], "max_ms": t.clip_ms[1]}

    target: dict[str, Any] = rule(problem.workload.target)
    own = {name: rule(task.target) for name, task in problem.workload.tasks.items()
           if task.target is not None}
    if own:
        target["tasks"] = own
    cfg: dict[str, Any] = {
        "policy": router, "lambda": problem.workload.lam,
        "quality": {"workload": problem.workload_source},
        "ttft_target": target, "instances": []}
    seed = 0
    for opt, r in pool:
        name = _slug(opt.name.replace("@", "-"))
        base = {"model": opt.model, "profile": opt.name}
        if urls:
            for k in range(r):
                cfg["instances"].append({"name": f"{name}-{k}", **base,
                                         "url": f"http://{name}-{k}.invalid:8000"})
        else:
            cfg["instances"].append({"name": name, **base, "replicas": r,
                                     "emulate": {"seed": seed}})
            seed += r
    return cfg


def _header(problem: PlanProblem, pool: Pool, urls: bool) -> str:
    what = ("one URL per replica: replace each http://....invalid:8000 with your instance's"
            if urls else "emulated instances (duetime serve --config this file)")
    derived = [o.name for o, _ in pool if problem.specs[o].derived_from]
    note = (f"# derived profiles (scaled from a measured one, docs/simulator.md): "
            f"{', '.join(derived)}\n" if derived else "")
    return (f"# duetime plan: the cheapest pool found for {problem.workload_source} at "
            f"{problem.rate:g} q/s, router {problem.router}\n# {what}\n{note}")


def write_pools(out: Path, problem: PlanProblem, pool: Pool, note: str = "") -> None:
    """``pool.yaml`` (emulated) and ``pool-urls.yaml`` (URL placeholders) for ``pool``."""
    for name, urls in (("pool.yaml", False), ("pool-urls.yaml", True)):
        body = yaml.safe_dump(pool_config(problem, pool, urls=urls), sort_keys=False)
        (out / name).write_text(_header(problem, pool, urls) + note + body)


def frontier_plot(path: Path, problem: PlanProblem, result: SearchResult) -> None:
    from duetime.experiments.report import plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    outs = result.outcomes
    ok = [o for o in outs if o.meets]
    bad = [o for o in outs if not o.meets]
    ax.scatter([o.cost for o in bad], [o.worst_on_time for o in bad], s=14, c="#bbbbbb",
               label="simulated, misses a constraint")
    ax.scatter([o.cost for o in ok], [o.worst_on_time for o in ok], s=18, c="#1f77b4",
               label="simulated, meets them")
    front = frontier(outs)
    ax.step([o.cost for o in front], [o.worst_on_time for o in front], where="post",
            c="#ff7f0e", label="cost-attainment frontier")
    floor = min(problem.constraints.on_time.values())
    ax.axhline(floor, ls="--", c="#999999", lw=1)
    if result.best is not None:
        ax.scatter([result.best.cost], [result.best.worst_on_time], s=90, marker="*",
                   c="#d62728", label="the plan", zorder=5)
    ax.set_xlabel("pool cost (USD per hour)")
    ax.set_ylabel("on-time rate of the worst class")
    ax.set_title(f"{problem.workload_source} at {problem.rate:g} q/s, router {problem.router}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_md(problem: PlanProblem, result: SearchResult, data: dict[str, Any]) -> str:
    c = problem.constraints
    lines = [f"# duetime plan: {problem.workload_source} at {problem.rate:g} q/s", "",
             f"Router in the loop: `{problem.router}`. Constraints: on time "
             + ", ".join(f"{k} >= {v:g}" for k, v in c.on_time.items())
             + (f"; mean quality >= {c.quality:g}" if c.quality is not None else "")
             + (f"; budget <= {c.budget:g} USD/h" if c.budget is not None else "") + ".", ""]
    best = result.best
    if best is None:
        lines += ["**No pool of the space meets the constraints** (more replicas: "
                  "`--max-replicas`; other deployments: `--options`; a lower floor).", ""]
    else:
        lines += ["## The pool", "", "| deployment | replicas | GPUs | USD/h | profile |",
                  "|---|---|---|---|---|"]
        for o, r in best.pool:
            spec = problem.specs[o]
            prof = f"derived from {spec.derived_from}" if spec.derived_from else "measured"
            lines.append(f"| {o.name} | {r} | {r * o.tp} | {r * problem.price(o):.2f} | "
                         f"{prof} |")
        lines += [f"| **total** | {sum(r for _, r in best.pool)} | {pool_gpus(best.pool)} | "
                  f"**{best.cost:.2f}** | |", "",
                  "Predicted (simulated on the plan's stream, "
                  f"{best.requests} requests; 95% intervals by batch means):", "",
                  "| class | on time | floor |", "|---|---|---|"]
        for k, v in best.on_time.items():
            lines.append(f"| {k} | {v:.3f} ± {best.half_width[k]:.3f} | {c.on_time[k]:g} |")
        lines += ["", f"Mean quality {best.quality:.3f}, utility {best.utility:.3f}, "
                  f"OnTimeUtility {best.ontime_utility:.3f}, p90 TTFT "
                  f"{best.p90_ttft_s * 1000:.0f} ms.", ""]
    s = data["search"]
    lines += ["## The search", "",
              f"{s['pools_considered']} pools considered in order of cost; "
              f"{sum(s['pruned'].values())} ruled out by bounds without a simulation ("
              + ", ".join(f"{k} {v}" for k, v in s["pruned"].items())
              + f"); {s['pools_simulated']} simulated in {s['simulations']} runs "
              f"({s['simulated_requests']} requests), {s['wall_s']:.1f} s.", "",
              "## Deployments", "", "| option | USD/h | profile |", "|---|---|---|"]
    for row in data["options"]:
        prof = (f"derived from {row['derived_from']}" if row["derived_from"] else "measured")
        lines.append(f"| {row['option']} | {row['usd_per_hour']:.3f} | {prof} |")
    lines += ["", "Derived profiles are scaled from a measured one (docs/simulator.md, "
              "\"Derived profiles\"): measure the real deployment with `duetime calibrate` "
              "before you buy it.", "", "## Frontier", "",
              "![frontier](frontier.png)", "", "| USD/h | pool | worst class on time | quality |",
              "|---|---|---|---|"]
    for o in frontier(result.outcomes):
        label = " + ".join(f"{r} x {x.name}" for x, r in o.pool)
        lines.append(f"| {o.cost:.2f} | {label} | {o.worst_on_time:.3f} | {o.quality:.3f} |")
    return "\n".join(lines) + "\n"


def write_plan(out: Path, problem: PlanProblem, result: SearchResult) -> dict[str, Any]:
    """Everything a plan writes into ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    data = summary(problem, result)
    write_json(out / "summary.json", data)
    (out / "report.md").write_text(report_md(problem, result, data))
    frontier_plot(out / "frontier.png", problem, result)
    if result.best is not None:
        write_pools(out, problem, result.best.pool)
    return data


def schedule_summary(problem: PlanProblem, sched: ScheduleResult) -> dict[str, Any]:
    static_gpu_h = sched.static_gpu_hours()
    peak = sched.peak.best
    static_cost = None if peak is None else peak.cost * sched.hours
    gpu_h, cost = sched.gpu_hours(), sched.cost(problem)
    return {
        "schedule": problem.schedule_source, "hours": round(sched.hours, 4),
        "scale_up_delay_s": sched.delay_s, "objective": problem.objective,
        "intervals": [{"start_s": iv.start_s, "duration_s": iv.duration_s,
                       "rate": round(iv.rate, 4), "planned_for": round(level(iv.rate, STEP), 4),
                       "pool": None if o is None else {x.name: r for x, r in o.pool},
                       "cost_per_hour": None if o is None else round(o.cost, 4),
                       "gpus": None if o is None else pool_gpus(o.pool),
                       "worst_on_time": None if o is None else round(o.worst_on_time, 4)}
                      for iv, o in zip(sched.intervals, sched.pools, strict=True)],
        "unplanned_intervals": sum(o is None for o in sched.pools),
        "gpu_hours": round(gpu_h, 3), "cost_usd": round(cost, 3),
        "static_peak_pool": None if peak is None else peak.as_dict(),
        "static_gpu_hours": static_gpu_h, "static_cost_usd": (
            None if static_cost is None else round(static_cost, 3)),
        "gpu_hours_vs_static_peak": (None if not static_gpu_h else round(gpu_h / static_gpu_h, 4)),
        "cost_vs_static_peak": (None if not static_cost else round(cost / static_cost, 4)),
        "levels": {f"{lv:.4g}": (None if r.best is None else r.best.as_dict())
                   for lv, r in sched.levels.items()},
        "search": {"simulations": sum(r.simulations for r in sched.levels.values()),
                   "levels": len(sched.levels)},
    }


def schedule_plot(path: Path, problem: PlanProblem, sched: ScheduleResult) -> None:
    from duetime.experiments.report import plt

    hours = [iv.start_s / 3600 for iv in sched.intervals]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(hours, [iv.rate for iv in sched.intervals], where="post", c="#1f77b4",
            label="rate (q/s)")
    ax.set_xlabel("hour")
    ax.set_ylabel("requests per second")
    ax2 = ax.twinx()
    ax2.step(hours, [0 if o is None else pool_gpus(o.pool) for o in sched.pools], where="post",
             c="#ff7f0e", label="GPUs of the planned pool")
    peak = sched.peak.best
    if peak is not None:
        ax2.axhline(pool_gpus(peak.pool), ls="--", c="#999999", lw=1, label="static peak pool")
    ax2.set_ylabel("GPUs")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.set_title(f"{problem.workload_source}: {problem.schedule_source}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_autoscale_table(path: Path, sched: ScheduleResult) -> None:
    """The pools by rate level as the gateway's ``autoscale.table`` reads them (replicas per
    model, summed over its deployments): duetime's autoscaler sizes from it live."""
    lines = ["# duetime plan's pools by rate level (requests/s): the pool config's",
             "# autoscale.table (docs/gateway.md, \"The desired-replica signal\")"]
    for lv, r in sorted(sched.levels.items()):
        if r.best is None:
            continue
        per: dict[str, int] = {}
        for o, n in r.best.pool:
            per[o.model] = per.get(o.model, 0) + n
        lines.append(f"- {{rate: {lv:.6g}, replicas: {{"
                     + ", ".join(f"{m}: {n}" for m, n in per.items()) + "}}")
    path.write_text("\n".join(lines) + "\n")


def write_schedule(out: Path, problem: PlanProblem, sched: ScheduleResult) -> dict[str, Any]:
    """A schedule's outputs in ``out``: summary.json, report.md, schedule.png, schedule.csv,
    autoscale-table.yaml, and the static peak pool's pool YAMLs."""
    out.mkdir(parents=True, exist_ok=True)
    data = schedule_summary(problem, sched)
    write_json(out / "summary.json", data)
    with (out / "schedule.csv").open("w") as f:
        f.write("start_s,duration_s,rate,planned_for,cost_per_hour,gpus,pool\n")
        for row in data["intervals"]:
            pool = ";".join(f"{k}={v}" for k, v in (row["pool"] or {}).items())
            f.write(f"{row['start_s']:g},{row['duration_s']:g},{row['rate']},"
                    f"{row['planned_for']},{row['cost_per_hour']},{row['gpus']},{pool}\n")
    schedule_plot(out / "schedule.png", problem, sched)
    write_autoscale_table(out / "autoscale-table.yaml", sched)
    lines = [f"# duetime plan: {problem.workload_source}, a schedule", "",
             f"{problem.schedule_source}; router `{problem.router}`; objective "
             f"{problem.objective}; a new replica costs from {sched.delay_s:g} s before its "
             "interval (loading, warm-up); transitions are not simulated.", "",
             "![schedule](schedule.png)", "",
             "| | GPU-hours | USD |", "|---|---|---|",
             f"| schedule | {data['gpu_hours']:.1f} | {data['cost_usd']:.2f} |"]
    if data["static_gpu_hours"] is not None:
        lines.append(f"| static peak pool | {data['static_gpu_hours']:.1f} | "
                     f"{data['static_cost_usd']:.2f} |")
        lines.append(f"| ratio | {data['gpu_hours_vs_static_peak']:.3f} | "
                     f"{data['cost_vs_static_peak']:.3f} |")
    if data["unplanned_intervals"]:
        lines.append(f"\n**{data['unplanned_intervals']} intervals have no pool that meets the "
                     "constraints.**")
    lines += ["", "## Pools by rate level", "", "| planned for (q/s) | pool | USD/h | GPUs |",
              "|---|---|---|---|"]
    for lv, r in sched.levels.items():
        best = r.best
        label = "(none)" if best is None else " + ".join(f"{n} x {o.name}" for o, n in best.pool)
        lines.append(f"| {lv:.3g} | {label} | "
                     f"{'' if best is None else f'{best.cost:.2f}'} | "
                     f"{'' if best is None else pool_gpus(best.pool)} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if sched.peak.best is not None:
        write_pools(out, problem, sched.peak.best.pool,
                    "# (the static peak pool of the schedule)\n")
    return data
