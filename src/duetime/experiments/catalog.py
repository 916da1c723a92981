"""The papers' experiments as named, reproducible runs (SFS: demo .. estimators; LAAR: ttca).

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
from duetime.policy import make_policy
from duetime.predict.quality_source import TaskTable
from duetime.sim.retry import run_retries
from duetime.workload import load_workload
from duetime.workload.kvlookup import load_pool

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


def ttca(out: Path, quick: bool, seed: int, log: Log) -> Outcome:
    """The LAAR paper's evaluation: KV lookups with retries on the five-model pool, per
    (context length, language); load-aware, session-affinity, laar and ttca."""
    pool = load_pool()
    models = {m: pm.spec for m, pm in pool.models.items()}
    names = list(models)
    contexts = pool.contexts[::2] if quick else pool.contexts
    languages = pool.languages[:2] if quick else pool.languages
    n_fit, n_eval = (20, 24) if quick else (50, 50)
    routers = ("load-aware", "session-affinity", "laar", "ttca")
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    curves: dict[tuple[int, str, str], tuple[np.ndarray, np.ndarray]] = {}
    total = len(contexts) * len(languages) * len(routers)
    k = 0
    for ci, ctx in enumerate(pool.contexts):
        if ctx not in contexts:
            continue
        for lang in languages:
            p = np.array([pool.models[m].p_success(lang, ci) for m in names])
            truth = rng.random((n_fit + n_eval, len(names))) < p  # fixed per (query, model)
            fit, ev = truth[:n_fit], truth[n_fit:]
            # the router's success model: the fit queries' rate per model (Laplace-smoothed)
            rate = (fit.sum(0) + 1) / (n_fit + 2)
            q_pred = TaskTable({"kv-lookup": dict(zip(names, rate.tolist(), strict=True))})
            prompt = np.full(n_eval, ctx)
            outs = np.full((n_eval, len(names)), pool.output_tokens)
            for router in routers:
                r = run_retries(models, make_policy(router, defaults={
                                    "lambda": 0.0, "seed": seed, "alpha": pool.alpha}),
                                prompt, outs, ev, q_pred, clients=pool.concurrency,
                                retry_cap=pool.retry_cap, seed=seed)
                t = r.ttca
                curves[(ctx, lang, router)] = (r.ttca_by_attempt(pool.retry_cap),
                                               r.success_by_attempt(pool.retry_cap))
                rows.append({"router": router, "rate": "", "context_tokens": ctx,
                             "language": lang, "queries": n_eval, "mean_ttca_s": float(t.mean()),
                             "p95_ttca_s": float(np.percentile(t, 95)),
                             "success": float(r.solved.mean()),
                             "mean_attempts": float(np.mean([len(a) for a in r.attempts])),
                             "first_attempt_success": float(r.success_by_attempt(1)[0]),
                             "wall_s": r.wall_s})
                k += 1
                log(f"[{k}/{total}] {router} @ {ctx} tokens, {lang}: mean TTCA "
                    f"{t.mean():.2f} s, success {r.solved.mean():.2f}")

    def mean_ttca(router: str, sel=lambda r: True) -> float:
        vals = [r["mean_ttca_s"] for r in rows if r["router"] == router and sel(r)]
        return float(np.mean(vals))

    def gain(a: str, b: str, sel=lambda r: True) -> float:
        return 1.0 - mean_ttca(a, sel) / mean_ttca(b, sel)

    settings = sorted({(r["context_tokens"], r["language"]) for r in rows})
    per_setting = []
    for ctx, lang in settings:
        def sel(r, ctx=ctx, lang=lang):
            return r["context_tokens"] == ctx and r["language"] == lang
        per_setting.append({"context_tokens": ctx, "language": lang,
                            "laar_vs_load_aware": gain("laar", "load-aware", sel),
                            "laar_vs_session_affinity": gain("laar", "session-affinity", sel),
                            "ttca_vs_laar": gain("ttca", "laar", sel)})
    summary = {
        "ttca_gain": {"laar_vs_load_aware": gain("laar", "load-aware"),
                      "laar_vs_session_affinity": gain("laar", "session-affinity"),
                      "ttca_vs_laar": gain("ttca", "laar")},
        "ttca_gain_max": {k2: max(x[k2] for x in per_setting) for k2 in
                          ("laar_vs_load_aware", "laar_vs_session_affinity", "ttca_vs_laar")},
        "per_setting": per_setting,
        "note": "gain = 1 - mean TTCA of the first / mean TTCA of the second, over the settings "
                "(each setting weighs the same); the pool's numbers are illustrative "
                "(src/duetime/workload/kvlookup/pool.yaml)"}
    _ttca_plots(out, curves, contexts, languages, routers, per_setting)
    cols = ["router", "context_tokens", "language", "mean_ttca_s", "p95_ttca_s", "success",
            "mean_attempts", "first_attempt_success"]
    return Outcome(rows, summary, [
        "## TTCA gains (mean over settings)\n\n"
        + rp.md_table([{"comparison": k2, "gain": v, "max over settings":
                        summary["ttca_gain_max"][k2]} for k2, v in summary["ttca_gain"].items()],
                      ["comparison", "gain", "max over settings"])
        + "\nPaper (LAAR vs load-aware / session-affinity): up to 31% / 49%.\n",
        "![TTCA and success vs attempts](ttca_attempts.png)\n\n"
        "![TTCA improvement](ttca_gain.png)\n",
        rp.md_table(per_setting, ["context_tokens", "language", "laar_vs_load_aware",
                                  "laar_vs_session_affinity", "ttca_vs_laar"]),
        "## All settings\n\n" + rp.md_table(rows, cols)])


def _ttca_plots(out: Path, curves, contexts, languages, routers, per_setting) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(languages), len(contexts), dpi=100, squeeze=False,
                             figsize=(2.6 * len(contexts), 2.4 * len(languages)))
    for li, lang in enumerate(languages):
        for ci, ctx in enumerate(contexts):
            ax = axes[li][ci]
            for router in routers:
                t, ok = curves[(ctx, lang, router)]
                ax.plot(t, ok, marker=".", ms=3, label=router)
            ax.set_title(f"{ctx // 1024}K {lang}", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.set_ylim(0, 1.02)
    axes[0][0].legend(fontsize=6)
    fig.supxlabel("TTCA so far (s), attempts 1..R")
    fig.supylabel("success rate")
    fig.tight_layout()
    fig.savefig(out / "ttca_attempts.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=100)
    labels = [f"{x['context_tokens'] // 1024}K {x['language']}" for x in per_setting]
    xs = np.arange(len(per_setting))
    for j, key in enumerate(("laar_vs_load_aware", "laar_vs_session_affinity",
                             "ttca_vs_laar")):
        ax.bar(xs + (j - 1) * 0.27, [x[key] for x in per_setting], width=0.27, label=key)
    ax.set_xticks(xs, labels, rotation=60, fontsize=7)
    ax.set_ylabel("TTCA improvement")
    ax.axhline(0, color="k", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttca_gain.png")
    plt.close(fig)


EXPERIMENTS: dict[str, Callable[..., Outcome]] = {
    "demo": demo, "load-sweep": load_sweep, "delta-sweep": delta_sweep,
    "composition": composition, "bursty": bursty, "estimators": estimators, "ttca": ttca}


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
