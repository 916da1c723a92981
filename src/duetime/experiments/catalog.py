"""The SFS paper's experiments as named, reproducible runs.

Each writes ``results.csv`` (one row per router x setting), ``summary.json`` (headline
numbers), PNG plots and ``report.md`` into its output folder. ``quick`` shrinks the runs (fewer
requests and rates) to finish in about two minutes on a laptop-class core.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetime.estimate import LpsEstimator, SfsEstimator, ThroughputEstimator
from duetime.experiments import report as rp
from duetime.experiments.runner import Point, Runner
from duetime.metrics import auc, forecast_mape, routing_share
from duetime.workload import load_workload

# The paper's settings (shared/reference/paper-parameters.yaml).
PAPER_RATES = (3, 4, 5, 6, 7, 8, 8.3, 8.6, 8.75, 9, 9.2, 9.3, 9.5)
QUICK_RATES = (3, 5, 7, 8, 9, 9.5)
PAPER_REQUESTS = 16000
QUICK_REQUESTS = 1200
DELTAS = (0, 1e-7, 3e-7, 4e-7, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 8e-6, 1e-5, 5e-5, 1e-4, 5e-4,
          1e-3)
BASELINES = ("round-robin", "shortest-queue", "load-aware", "latency-agnostic")
ESTIMATOR_ROUTERS = ("throughput", "lps")  # SFS's routing rule with coarser estimators
TABLE = ["router", "rate", "mean_ttft_s", "p95_ttft_s", "on_time", "utility", "ontime_utility"]


@dataclass(slots=True)
class Outcome:
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    sections: list[str]  # markdown parts of the report (plots are linked in them)


Log = Callable[[str], None]


def _n(quick: bool, full: int = PAPER_REQUESTS) -> int:
    return QUICK_REQUESTS if quick else full


def demo(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    """The SFS page's illustration: identical instances, 6 q/s, four routers."""
    runner = Runner(load_workload("demo"), seed=seed)
    routers = ("latency-agnostic", "shortest-queue", "round-robin", "sfs")
    rows, _ = runner.run_all([Point(r, 6.0, _n(quick, 4000)) for r in routers], progress=log)
    best = max((r for r in rows if r["router"] != "sfs"), key=lambda r: r["ontime_utility"])
    sfs = next(r for r in rows if r["router"] == "sfs")
    summary = {"rate": 6.0, "ontime_utility": {r["router"]: r["ontime_utility"] for r in rows},
               "best_baseline": best["router"],
               "ontime_utility_gain_vs_best_baseline":
                   sfs["ontime_utility"] / best["ontime_utility"] - 1}
    cols = ["router", "mean_ttft_s", "p95_ttft_s", "on_time", "utility", "ontime_utility"]
    return Outcome(rows, summary, ["## Routers at 6 q/s (identical instances)\n\n"
                                   + rp.md_table(rows, cols)])


def load_sweep(out: Path, quick: bool, seed: int, log: Log, *, arrivals: str = "poisson",
               arrival_kw: tuple = (), title: str = "Load sweep") -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed)
    rates = QUICK_RATES if quick else PAPER_RATES
    routers = (*BASELINES, "sfs", *ESTIMATOR_ROUTERS)
    points = [Point(r, rate, _n(quick), arrivals, arrival_kw) for rate in rates
              for r in routers]
    rows, _ = runner.run_all(points, progress=log)
    aucs = {r: auc([x["rate"] for x in rows if x["router"] == r],
                   [x["ontime_utility"] for x in rows if x["router"] == r]) for r in routers}
    best = max(BASELINES, key=lambda r: aucs[r])
    summary = {"auc": aucs, "best_baseline": best,
               "auc_gain_vs_best_baseline": aucs["sfs"] / aucs[best] - 1,
               "rates": list(rates), "requests_per_point": _n(quick),
               "sfs_leads_baselines_at_every_rate": all(
                   max((x for x in rows if x["rate"] == rate and x["router"] in (
                       *BASELINES, "sfs")), key=lambda x: x["ontime_utility"])["router"] == "sfs"
                   for rate in rates)}
    stem = title.lower().replace(" ", "_")
    rp.line_plot(out / f"{stem}_ontime_utility.png", rows, "rate", "ontime_utility",
                 title=f"{title}: OnTimeUtility", xlabel="arrival rate (q/s)")
    rp.line_plot(out / f"{stem}_attainment.png", rows, "rate", "on_time",
                 title=f"{title}: TTFT attainment", xlabel="arrival rate (q/s)",
                 ylabel="on time")
    auc_rows = [{"router": r, "auc": v} for r, v in sorted(aucs.items(), key=lambda kv: -kv[1])]
    sections = [
        f"## {title}: OnTimeUtility AUC over {rates[0]}..{rates[-1]} q/s\n\n"
        + rp.md_table(auc_rows, ["router", "auc"])
        + f"\nSFS vs the best baseline ({best}): {summary['auc_gain_vs_best_baseline']:+.1%}. "
          f"(Baselines: {', '.join(BASELINES)}; `throughput` and `lps` are SFS's rule with "
          "coarser estimators.)\n",
        f"![OnTimeUtility]({stem}_ontime_utility.png)\n\n![attainment]({stem}_attainment.png)\n",
        "## All points\n\n" + rp.md_table(rows, TABLE)]
    return Outcome(rows, summary, sections)


def delta_sweep(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed)
    deltas = DELTAS[::2] if quick else DELTAS
    points = [Point("sfs-soft", 8.0, _n(quick), delta=d, label=f"sfs-soft d={d:g}")
              for d in deltas]
    points += [Point(r, 8.0, _n(quick)) for r in ("sfs", "shortest-queue", "latency-agnostic")]
    rows, _ = runner.run_all(points, progress=log)
    soft = [r for r in rows if r["router"].startswith("sfs-soft")]
    rp.scatter_plot(out / "frontier.png", [r["mean_ttft_s"] for r in soft],
                    [r["utility"] for r in soft], [f"{r['delta']:g}" for r in soft],
                    title="sfs-soft at 8 q/s: utility vs mean TTFT (labels: delta)",
                    xlabel="mean TTFT (s)", ylabel="utility")
    best = max(rows, key=lambda r: r["ontime_utility"])
    summary = {"rate": 8.0, "best_ontime_utility": {"router": best["router"],
                                                    "value": best["ontime_utility"]},
               "frontier": [{"delta": r["delta"], "utility": r["utility"],
                             "mean_ttft_s": r["mean_ttft_s"], "on_time": r["on_time"]}
                            for r in soft]}
    return Outcome(rows, summary, [
        "## The utility-latency frontier at 8 q/s\n\n![frontier](frontier.png)\n",
        rp.md_table(rows, ["router", "delta", *TABLE[2:]])])


def composition(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed)
    routers = ("shortest-queue", "round-robin", "latency-agnostic", "sfs")
    rows, kept = runner.run_all([Point(r, 8.0, _n(quick)) for r in routers], progress=log,
                                keep=lambda p: True)
    shares = {p.name: routing_share(res) for p, res in kept.items()}
    res0 = next(iter(kept.values()))
    rp.bar_plot(out / "composition.png", shares, res0.requests.models, res0.requests.tasks,
                "Share of each task sent to each model at 8 q/s")
    flat = [{"router": r, "task": t, **{m: v for m, v in ms.items()}}
            for r, s in shares.items() for t, ms in s.items()]
    summary = {"rate": 8.0, "share": shares,
               "sfs_govreport_to_smallest": shares["sfs"].get("govreport", {}).get(
                   res0.requests.models[0])}
    return Outcome(rows, summary, [
        "## Routing composition at 8 q/s\n\n![composition](composition.png)\n",
        rp.md_table(flat, ["router", "task", *res0.requests.models]),
        "## Routers\n\n" + rp.md_table(rows, TABLE)])


def bursty(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    rows, summary, sections = [], {}, []
    for ratio in (3, 6):
        o = load_sweep(out, quick, seed, log, arrivals="mmpp2",
                       arrival_kw=(("ratio", float(ratio)),), title=f"MMPP-2 ratio {ratio}")
        for r in o.rows:
            r["ratio"] = ratio
        rows += o.rows
        summary[f"ratio_{ratio}"] = {k: o.summary[k] for k in
                                     ("auc", "best_baseline", "auc_gain_vs_best_baseline",
                                      "sfs_leads_baselines_at_every_rate")}
        sections += o.sections[:2]
    return Outcome(rows, summary, sections)


def estimators(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    """Forecast error of the three estimators on the same routed traffic (SFS routing): each
    forecasts the TTFT of every request at the instance it was sent to."""
    runner = Runner(load_workload("paper"), seed=seed)
    shadow = (SfsEstimator(), ThroughputEstimator(), LpsEstimator())
    rates = (4.0, 8.0) if quick else (3.0, 5.0, 7.0, 8.0, 9.0)
    rows, kept = runner.run_all([Point("sfs", r, _n(quick, 4000)) for r in rates],
                                progress=log, keep=lambda p: True, shadow=shadow)
    mape: dict[str, float] = {}
    per_rate = []
    for p, res in kept.items():
        for name, f in res.shadow.items():
            per_rate.append({"router": "sfs", "rate": p.rate, "estimator": name,
                             "mape": forecast_mape(f, res.ttft)})
    for name in ("sfs", "throughput", "lps"):
        f = np.concatenate([res.shadow[name] for res in kept.values()])
        t = np.concatenate([res.ttft for res in kept.values()])
        mape[name] = forecast_mape(f, t)
    for r in rows:
        r["forecast_mape_sfs"] = next(x["mape"] for x in per_rate
                                      if x["rate"] == r["rate"] and x["estimator"] == "sfs")
    summary = {"mape": mape, "rates": list(rates),
               "note": "the simulated instances run the same batch-time model the estimators "
                       "use (no noise): SFS's error here comes only from predicted output "
                       "lengths (+-30%)"}
    return Outcome(rows, summary, [
        "## TTFT forecast error (MAPE) by estimator\n\n"
        + rp.md_table([{"estimator": k, "mape": v} for k, v in mape.items()],
                      ["estimator", "mape"]) + "\nPaper: SFS 5%, prefill-throughput 85% "
        "(against a real vLLM).\n",
        rp.md_table(per_rate, ["rate", "estimator", "mape"])])


EXPERIMENTS: dict[str, Callable[..., Outcome]] = {
    "demo": demo, "load-sweep": load_sweep, "delta-sweep": delta_sweep,
    "composition": composition, "bursty": bursty, "estimators": estimators}


def run_experiment(name: str, out: Path, *, quick: bool = False, seed: int = 0,
                   log: Log = print) -> Outcome:
    """Run a named experiment and write its outputs into ``out``."""
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; expected one of {', '.join(EXPERIMENTS)}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    o = EXPERIMENTS[name](out, quick, seed, log)
    o.summary.update({"experiment": name, "quick": quick, "seed": seed,
                      "wall_s": time.perf_counter() - t0})
    rp.write_csv(out / "results.csv", o.rows)
    rp.write_json(out / "summary.json", o.summary)
    head = (f"# Experiment `{name}`{' (quick)' if quick else ''}\n\n"
            f"Seed {seed}; {o.summary['wall_s']:.0f} s. Made by `duetime experiment {name}"
            f"{' --quick' if quick else ''} --seed {seed}`. Simulated instances: duetime's "
            "compiled vLLM V1 engine with the workload profile's batch-time models; the "
            "workload lengths are illustrative (see the profile file).\n\n")
    (out / "report.md").write_text(head + "\n".join(o.sections) + "\n")
    return o
