"""The papers' experiments as named, reproducible runs (SFS: demo .. estimators; LAAR: ttca;
prefix caching: prefix; scale; several routers: replicas; capacity planning: plan).

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
from duetime.experiments import prefix as px
from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.experiments.runner import Point, Runner, run_points
from duetime.metrics import auc, forecast_mape, routing_share
from duetime.policy import consumes, make_policy
from duetime.policy.registry import PREFIX
from duetime.predict.quality_source import TaskTable
from duetime.sim.cache_view import CACHE_VIEWS
from duetime.sim.retry import run_retries
from duetime.workload import load_workload
from duetime.workload.kvlookup import load_pool

# The paper's settings (docs/simulator.md, "The papers' parameters").
PAPER_RATES = (3, 4, 5, 6, 7, 8, 8.3, 8.6, 8.75, 9, 9.2, 9.3, 9.5)
QUICK_RATES = (3, 5, 7, 8, 9, 9.5)
PAPER_REQUESTS = 16000
QUICK_REQUESTS = 1200
DELTAS = (0, 1e-7, 3e-7, 4e-7, 1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 8e-6, 1e-5, 5e-5, 1e-4, 5e-4,
          1e-3)
BASELINES = ("round-robin", "shortest-queue", "load-aware", "latency-agnostic")
ESTIMATOR_ROUTERS = ("throughput", "lps")  # SFS's routing rule with coarser estimators
TABLE = ["router", "rate", "mean_ttft_s", "p95_ttft_s", "on_time", "utility", "ontime_utility"]
# prefix: the cache-aware baselines, then references (the load-sweep's baselines that route on
# load alone, and latency-agnostic: SFS's utility without its TTFT forecast)
CACHE_AWARE = ("prefix-load", "cache-aware")
PREFIX_ROUTERS = ("sfs", *CACHE_AWARE, "round-robin", "load-aware", "latency-agnostic")
PREFIX_REQUESTS = 5000
PREFIX_QUICK_REQUESTS = 300
PREFIX_QUICK_RATES = QUICK_RATES[::2]


@dataclass(slots=True)
class Outcome:
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    sections: list[str]  # markdown parts of the report (plots are linked in them)


Log = Callable[[str], None]


def _n(quick: bool, full: int = PAPER_REQUESTS) -> int:
    return QUICK_REQUESTS if quick else full


def demo(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """The SFS page's illustration: identical instances, 6 q/s, four routers."""
    runner = Runner(load_workload("demo"), seed=seed, fanout=fanout)
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


def load_sweep(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout, *,
               arrivals: str = "poisson", arrival_kw: tuple = (), title: str = "Load sweep"
               ) -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed, fanout=fanout)
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


def delta_sweep(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed, fanout=fanout)
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


def composition(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    runner = Runner(load_workload("paper"), seed=seed, fanout=fanout)
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


def bursty(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    rows, summary, sections = [], {}, []
    for ratio in (3, 6):
        o = load_sweep(out, quick, seed, log, fanout, arrivals="mmpp2",
                       arrival_kw=(("ratio", float(ratio)),), title=f"MMPP-2 ratio {ratio}")
        for r in o.rows:
            r["ratio"] = ratio
        rows += o.rows
        summary[f"ratio_{ratio}"] = {k: o.summary[k] for k in
                                     ("auc", "best_baseline", "auc_gain_vs_best_baseline",
                                      "sfs_leads_baselines_at_every_rate")}
        sections += o.sections[:2]
    return Outcome(rows, summary, sections)


def estimators(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Forecast error of the three estimators on the same routed traffic (SFS routing): each
    forecasts the TTFT of every request at the instance it was sent to."""
    runner = Runner(load_workload("paper"), seed=seed, fanout=fanout)
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
    # with prefix caching: the same routing on the prefix experiment's shared-prefix streams
    # (instances caching), SFS's forecasts replaying the cache (prompt hits included)
    # (and the same streams without caching: the part of the error that is not the cache's,
    # e.g. arrivals after a forecast that share its steps)
    caching = []
    runners = {on: Runner(runner.profile, seed=seed, prefix_caching=on) for on in (True, False)}
    jobs, keys = [], []
    for w in px.WORKLOADS:
        for rate in rates:
            p = Point("sfs", rate, _n(quick, 4000))
            stream = px.make_stream(w, runner.profile, rate, p.requests, seed).requests
            for on, r in runners.items():
                r.set_stream(p, stream)
                jobs.append((r.portable(p), p))
                keys.append((w, rate, on))
    results = dict(zip(keys, (res for _, res in run_points(
        jobs, fanout, progress=log, keep=lambda p: True, shadow=shadow)), strict=True))
    for w in px.WORKLOADS:
        for rate in rates:
            res, plain = results[(w, rate, True)], results[(w, rate, False)]
            caching.append({"workload": w, "rate": rate, "cache_hit_rate": res.cache_hit_rate,
                            **{f"mape_{k}": forecast_mape(f, res.ttft)
                               for k, f in res.shadow.items()},
                            "mape_sfs_no_caching": forecast_mape(plain.shadow["sfs"],
                                                                 plain.ttft)})
    mape_caching = {w: float(np.mean([r["mape_sfs"] for r in caching if r["workload"] == w]))
                    for w in px.WORKLOADS}
    mape_plain = {w: float(np.mean([r["mape_sfs_no_caching"] for r in caching
                                    if r["workload"] == w])) for w in px.WORKLOADS}
    summary = {"mape": mape, "rates": list(rates), "mape_sfs_prefix_caching": mape_caching,
               "mape_sfs_same_streams_no_caching": mape_plain,
               "note": "the simulated instances run the same batch-time model the estimators "
                       "use (no noise): SFS's error here comes only from predicted output "
                       "lengths (+-30%); with prefix caching, also from the probe's cache hits "
                       "(mean over the rates of each shared-prefix workload)"}
    return Outcome(rows, summary, [
        "## TTFT forecast error (MAPE) by estimator\n\n"
        + rp.md_table([{"estimator": k, "mape": v} for k, v in mape.items()],
                      ["estimator", "mape"]) + "\nPaper: SFS 5%, prefill-throughput 85% "
        "(against a real vLLM).\n",
        rp.md_table(per_rate, ["rate", "estimator", "mape"]),
        "## With prefix caching\n\nSFS routing on the `prefix` experiment's shared-prefix "
        "streams, every instance caching; SFS's forecasts replay the cache (the probe's hits "
        "and what the requests ahead cache and evict). Target: SFS MAPE <= 2%. The same "
        "streams without caching, for comparison: a forecast assumes no arrivals after it, and "
        "later arrivals that share the probe's steps make them longer (with perfect output "
        "lengths, the forecasts are exact otherwise).\n\n"
        + rp.md_table(caching, ["workload", "rate", "cache_hit_rate", "mape_sfs",
                                "mape_sfs_no_caching", "mape_throughput", "mape_lps"])])


def ttca(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
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
    jobs, settings = [], []
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
                jobs.append((models, router, seed, pool.alpha, prompt, outs, ev, q_pred,
                             pool.concurrency, pool.retry_cap))
                settings.append((ctx, lang, router))

    def done(k: int, r) -> None:
        finished.append(k)
        ctx, lang, router = settings[k]
        log(f"[{len(finished)}/{len(jobs)}] {router} @ {ctx} tokens, {lang}: mean TTCA "
            f"{r.ttca.mean():.2f} s, success {r.solved.mean():.2f}")

    finished: list[int] = []
    for (ctx, lang, router), r in zip(settings, fanout.map(_retries, jobs, done), strict=True):
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


def _retries(models, router, seed, alpha, prompt, outs, ev, q_pred, clients, retry_cap):
    """One router's retries on one (context, language) setting (a job of ``ttca``'s
    fan-out)."""
    return run_retries(models, make_policy(router, defaults={
                           "lambda": 0.0, "seed": seed, "alpha": alpha}),
                       prompt, outs, ev, q_pred, clients=clients, retry_cap=retry_cap, seed=seed)


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


def prefix(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Prefix caching (every instance caches): load sweeps on multi-turn chat and on shared
    system prompts over the load-sweep's pool and rates, with working sets near and above the
    pool's KV capacity (:mod:`duetime.experiments.prefix`); each policy that reads the cache
    view runs with both views, the others once per point (their row stands for both views)."""
    profile = load_workload("paper")
    rates = PREFIX_QUICK_RATES if quick else PAPER_RATES
    n = PREFIX_QUICK_REQUESTS if quick else PREFIX_REQUESTS
    cap_by_model = px.kv_capacity_tokens(profile)
    cap = sum(cap_by_model.values())
    runners = {v: Runner(profile, seed=seed, prefix_caching=True, cache_view=v)
               for v in CACHE_VIEWS}
    reads = {r: PREFIX in consumes(r) for r in PREFIX_ROUTERS}
    jobs, settings = [], []
    for w in px.WORKLOADS:
        for rate in rates:
            s = px.make_stream(w, profile, rate, n, seed)
            info = {"workload": w, "arrival_rps": s.arrival_rps,
                    "working_set_tokens": s.working_set_tokens,
                    "working_set_ratio": s.working_set_tokens / cap}
            for r in PREFIX_ROUTERS:
                for v in CACHE_VIEWS if reads[r] else CACHE_VIEWS[:1]:
                    p = Point(r, rate, n, label=f"{w}, {v if reads[r] else 'either view'}: {r}")
                    runners[v].set_stream(p, s.requests)
                    jobs.append((runners[v].portable(p), p))
                    settings.append((w, info, r, v))
    rows: list[dict[str, Any]] = []
    for (w, info, r, v), (row, res) in zip(settings, run_points(
            jobs, fanout, progress=log, keep=lambda p: True), strict=True):
        sim_s = max(res.simulated_s, 1e-9)
        row.update(info, router=r, arrivals="poisson sessions" if w == "multi-turn"
                   else "poisson",
                   p90_ttft_s=float(np.percentile(res.ttft, 90)),
                   throughput_rps=len(res.ttft) / sim_s,
                   output_tok_s=float(res.output_tokens.sum()) / sim_s)
        share = np.bincount(res.model, minlength=len(profile.model_names))
        row.update({f"share_{m}": float(c) / len(res.model)
                    for m, c in zip(profile.model_names, share, strict=True)})
        for view in (v,) if reads[r] else CACHE_VIEWS:
            rows.append(dict(row, cache_view=view, view_shared=not reads[r]))
    summary, sections = _prefix_summary(out, rows, rates, n, cap, cap_by_model, reads,
                                        profile.model_names)
    return Outcome(rows, summary, sections)


def _prefix_summary(out: Path, rows: list[dict[str, Any]], rates: tuple, n: int, cap: int,
                    cap_by_model: dict[str, int], reads: dict[str, bool], models: list[str]
                    ) -> tuple[dict[str, Any], list[str]]:
    def sel(w: str, v: str, r: str) -> list[dict[str, Any]]:
        return sorted((x for x in rows if x["workload"] == w and x["cache_view"] == v
                       and x["router"] == r), key=lambda x: x["rate"])

    wls, views = px.WORKLOADS, CACHE_VIEWS
    aucs = {w: {v: {r: auc([x["rate"] for x in sel(w, v, r)],
                           [x["ontime_utility"] for x in sel(w, v, r)])
                    for r in PREFIX_ROUTERS} for v in views} for w in wls}
    hits = {w: {v: {r: float(np.mean([x["cache_hit_rate"] for x in sel(w, v, r)]))
                    for r in PREFIX_ROUTERS} for v in views} for w in wls}
    mean_p90 = {w: {v: {r: float(np.mean([x["p90_ttft_s"] for x in sel(w, v, r)]))
                        for r in PREFIX_ROUTERS} for v in views} for w in wls}
    best = {w: {v: max(CACHE_AWARE, key=lambda r, w=w, v=v: aucs[w][v][r]) for v in views}
            for w in wls}
    by_w = {w: {v: aucs[w][v]["sfs"] / aucs[w][v][best[w][v]] - 1 for v in views} for w in wls}
    gain = {v: sum(aucs[w][v]["sfs"] for w in wls)
            / sum(aucs[w][v][best[w][v]] for w in wls) - 1 for v in views}
    p90: dict[str, dict[str, Any]] = {v: {} for v in views}
    for v in views:
        for w in wls:
            a = [x["p90_ttft_s"] for x in sel(w, v, "sfs")]
            no_worse = {r: sum(x <= y["p90_ttft_s"] for x, y in zip(a, sel(w, v, r),
                                                                   strict=True))
                        for r in CACHE_AWARE}
            p90[v][w] = {"best_cache_aware": best[w][v], "sfs_mean_s": mean_p90[w][v]["sfs"],
                         "best_mean_s": mean_p90[w][v][best[w][v]],
                         "loads_sfs_no_worse": no_worse[best[w][v]],
                         "loads_sfs_no_worse_by_policy": no_worse, "loads": len(a)}
    p90_ok = {v: all(p90[v][w]["loads_sfs_no_worse"] == p90[v][w]["loads"] for w in wls)
              for v in views}
    ws = {w: {f"{rate:g}": next(x["working_set_ratio"] for x in rows
                                if x["workload"] == w and x["rate"] == rate) for rate in rates}
          for w in wls}
    summary = {
        "rates": list(rates), "requests_per_point": n, "workloads": list(wls),
        "routers": list(PREFIX_ROUTERS), "cache_views": list(views),
        "view_independent_routers": [r for r in PREFIX_ROUTERS if not reads[r]],
        "auc": aucs, "mean_cache_hit_rate": hits, "mean_p90_ttft_s": mean_p90,
        "best_cache_aware": best,
        "sfs_gain_vs_best_cache_aware": gain,
        "sfs_gain_vs_best_cache_aware_by_workload": by_w,
        "p90_ttft_vs_best_cache_aware": p90, "sfs_p90_no_worse_at_every_load": p90_ok,
        "target_met_precise": bool(gain["precise"] >= 0.3 and p90_ok["precise"]),
        "kv_capacity_tokens": cap, "kv_capacity_tokens_by_instance": cap_by_model,
        "working_set_ratio": ws,
        "working_set_ratio_range": {w: [min(ws[w].values()), max(ws[w].values())]
                                    for w in wls},
        "workload_params": {"multi-turn": px.MULTI_TURN, "system-prompts": px.SYSTEM_PROMPTS},
        "note": "gain = sum over workloads of sfs's OnTimeUtility AUC / sum of the better "
                "cache-aware policy's (per workload and view) - 1; routers that do not read the "
                "cache view ran once per point (view_shared); sfs reads each instance's "
                "snapshot, which carries its cache exactly in either view"}
    sections = [_prefix_intro(rows, rates, n, cap, cap_by_model, reads),
                _prefix_headline(summary)]
    for w in wls:
        stem = w.replace("-", "_")
        panels = {v: [x for x in rows if x["workload"] == w and x["cache_view"] == v]
                  for v in views}
        for y, name, label, logy in (("ontime_utility", "ontime_utility", "OnTimeUtility",
                                      False),
                                     ("cache_hit_rate", "hit_rate", "cache hit rate", False),
                                     ("p90_ttft_s", "p90_ttft", "p90 TTFT (s)", True)):
            rp.panels_plot(out / f"prefix_{stem}_{name}.png",
                           [(f"{v} view", panels[v]) for v in views], "rate", y,
                           title=f"{w}: {label} vs load", xlabel="arrival rate (q/s)",
                           ylabel=label, logy=logy)
        sections.append(_prefix_workload_section(w, stem, rows, aucs[w], hits[w], best[w]))
    cols = ["workload", "cache_view", "router", "rate", "ontime_utility", "on_time",
            "p50_ttft_s", "p90_ttft_s", "throughput_rps", "cache_hit_rate",
            *(f"share_{m}" for m in models), "view_shared"]
    sections.append("## All points\n\n" + rp.md_table(
        sorted(rows, key=lambda x: (x["workload"], x["cache_view"], x["router"], x["rate"])),
        cols))
    return summary, sections


def _prefix_intro(rows: list[dict[str, Any]], rates: tuple, n: int, cap: int,
                  cap_by_model: dict[str, int], reads: dict[str, bool]) -> str:
    mt, sp = px.MULTI_TURN, px.SYSTEM_PROMPTS
    ws_rows = []
    for rate in rates:
        got = {x["workload"]: x for x in rows if x["rate"] == rate}
        row: dict[str, Any] = {"rate": rate}
        for w in px.WORKLOADS:
            row[f"{w} working set (tokens)"] = round(got[w]["working_set_tokens"])
            row[f"{w} / capacity"] = got[w]["working_set_ratio"]
            row[f"{w} q/s realised"] = got[w]["arrival_rps"]
        ws_rows.append(row)
    shared = ", ".join(r for r in PREFIX_ROUTERS if not reads[r])
    return (
        "## Setting\n\n"
        f"The load-sweep's pool (the `paper` profile: one instance per model) with vLLM's "
        f"automatic prefix caching on every instance; {n} requests per point at "
        f"{', '.join(f'{r:g}' for r in rates)} q/s. KV capacity (usable blocks x block size): "
        + ", ".join(f"{m} {c:,}" for m, c in cap_by_model.items())
        + f" tokens, {cap:,} in all (the built-in profile's blocks, unscaled; the prefixes are "
        "sized to it).\n\n"
        f"- `multi-turn`: chat sessions of ~{mt['mean_turns']:g} turns (geometric, at most "
        f"{mt['max_turns']}), {mt['think_time_s']:g} s of thinking between turns (exponential), "
        f"questions LogNormal(median {mt['question_tokens']['median']}, sigma "
        f"{mt['question_tokens']['sigma']}) and answers LogNormal(median "
        f"{mt['answer_tokens']['median']}, sigma {mt['answer_tokens']['sigma']}) tokens; each "
        "prompt is the conversation so far. Sessions start at rate / mean turns; each point's "
        f"requests are the turns after a {mt['warmup_s']:g} s warm-up (steady state). Working "
        "set: the time average of the live sessions' contexts.\n"
        f"- `system-prompts`: {sp['tenants']} tenants with {sp['system_tokens']}-token system "
        f"prompts ({sp['tenants'] * sp['system_tokens'] / cap:.2f}x the capacity), "
        f"Zipf({sp['zipf_s']:g}) popularity; the question is the profile's prompt for the "
        "request's task. Working set: the system prompts of the tenants the point's requests "
        "use.\n\n"
        f"Routers: {', '.join(PREFIX_ROUTERS)}. Those that do not read the cache view ({shared}) "
        "ran once per point; their row stands for both views. `sfs` forecasts from each "
        "instance's snapshot, which carries the instance's cache exactly whichever the view: "
        "the `estimated` view handicaps only the cache-aware baselines. Costs (and so "
        "utility) charge every prompt token at the prompt price, cached or not.\n\n"
        "### Working set / KV capacity\n\n"
        + rp.md_table(ws_rows, list(ws_rows[0])))


def _prefix_headline(summary: dict[str, Any]) -> str:
    gain, by_w = summary["sfs_gain_vs_best_cache_aware"], summary[
        "sfs_gain_vs_best_cache_aware_by_workload"]
    p90 = summary["p90_ttft_vs_best_cache_aware"]
    table = []
    for v in CACHE_VIEWS:
        for w in px.WORKLOADS:
            q = p90[v][w]
            means = summary["mean_p90_ttft_s"][w][v]
            table.append({"view": v, "workload": w, "best cache-aware": q["best_cache_aware"],
                          "sfs AUC gain": f"{by_w[w][v]:+.1%}",
                          **{f"{r} mean p90 (s)": means[r] for r in ("sfs", *CACHE_AWARE)},
                          **{f"loads sfs p90 <= {r}'s": f"{c}/{q['loads']}"
                             for r, c in q["loads_sfs_no_worse_by_policy"].items()}})
        table.append({"view": v, "workload": "both", "sfs AUC gain": f"{gain[v]:+.1%}"})
    met = summary["target_met_precise"]
    return ("## SFS vs the better cache-aware policy\n\n"
            "The better of prefix-load and cache-aware is the one with the higher OnTimeUtility "
            "AUC on the workload in the view; over both workloads the gain is Σ sfs AUC / Σ the "
            "better one's AUC - 1. p90 TTFT: the mean over the loads, and at how many loads sfs's "
            "is no worse.\n\n"
            + rp.md_table(table, ["view", "workload", "best cache-aware", "sfs AUC gain",
                                  *(f"{r} mean p90 (s)" for r in ("sfs", *CACHE_AWARE)),
                                  *(f"loads sfs p90 <= {r}'s" for r in CACHE_AWARE)])
            + f"\nTarget (precise view: AUC gain >= 30% and p90 TTFT no worse at every load): "
            f"{'met' if met else 'not met'}. Estimated view: {gain['estimated']:+.1%} "
            f"(precise {gain['precise']:+.1%}).\n")


def _prefix_workload_section(w: str, stem: str, rows: list[dict[str, Any]],
                             aucs: dict[str, dict[str, float]], hits: dict[str, dict[str, float]],
                             best: dict[str, str]) -> str:
    table = [{"router": r, **{f"AUC {v}": aucs[v][r] for v in CACHE_VIEWS},
              **{f"mean hit rate {v}": hits[v][r] for v in CACHE_VIEWS}}
             for r in PREFIX_ROUTERS]
    p90 = []
    for rate in sorted({x["rate"] for x in rows}):
        row: dict[str, Any] = {"rate": rate}
        for v in CACHE_VIEWS:
            for r in ("sfs", *CACHE_AWARE):
                row[f"{r} {v}"] = next(x["p90_ttft_s"] for x in rows if x["workload"] == w
                                       and x["cache_view"] == v and x["router"] == r
                                       and x["rate"] == rate)
        p90.append(row)
    return (f"## `{w}`\n\nOnTimeUtility AUC over load and mean cache hit rate (better "
            f"cache-aware policy: {', '.join(f'{v} {best[v]}' for v in CACHE_VIEWS)})\n\n"
            + rp.md_table(table, list(table[0]))
            + f"\n![OnTimeUtility](prefix_{stem}_ontime_utility.png)\n\n"
            f"![hit rate](prefix_{stem}_hit_rate.png)\n\n"
            f"![p90 TTFT](prefix_{stem}_p90_ttft.png)\n\n"
            "p90 TTFT (s) per load\n\n" + rp.md_table(p90, list(p90[0])))


def scale(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Routing at cluster scale: pools of replicas at the same load per instance
    (:mod:`duetime.experiments.scale`)."""
    from duetime.experiments.scale import run_scale

    return Outcome(*run_scale(out, quick, seed, log, fanout))


def replicas(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """The cost of being many: N routers over one pool, each with its own view
    (:mod:`duetime.experiments.replicas`)."""
    from duetime.experiments.replicas import run_replicas

    return Outcome(*run_replicas(out, quick, seed, log, fanout))


def plan(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Capacity planned with the router in the loop against sizing model by model
    (:mod:`duetime.experiments.planning`)."""
    from duetime.experiments.planning import run_plan

    return Outcome(*run_plan(out, quick, seed, log, fanout))


def autoscale(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Autoscalers on a pool that scales while it runs (:mod:`duetime.experiments.autoscale`)."""
    from duetime.experiments.autoscale import run_autoscale

    return Outcome(*run_autoscale(out, quick, seed, log, fanout))


def lora(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Many LoRA adapters on replicas of one base model: sfs against llm-d's lora-affinity
    and the load balancers (:mod:`duetime.experiments.lora`)."""
    from duetime.experiments.lora import run_lora

    return Outcome(*run_lora(out, quick, seed, log, fanout))


def ttca_multiturn(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Multi-turn TTCA with cache locality: conversations of KV lookups on the LAAR pool, ttca
    against laar and the affinity / cache-aware routers (:mod:`duetime.experiments.multiturn`)."""
    from duetime.experiments.multiturn import run_multiturn

    return Outcome(*run_multiturn(out, quick, seed, log, fanout))


def deadlines(out: Path, quick: bool, seed: int, log: Log, fanout: Fanout) -> Outcome:
    """Completion deadlines under length uncertainty: sfs-deadline against TTFT-only sfs, the
    median length in a finish forecast, llm-d's SLO scorer and load-aware
    (:mod:`duetime.experiments.deadlines`)."""
    from duetime.experiments.deadlines import run_deadlines

    return Outcome(*run_deadlines(out, quick, seed, log, fanout))


EXPERIMENTS: dict[str, Callable[..., Outcome]] = {
    "demo": demo, "load-sweep": load_sweep, "delta-sweep": delta_sweep,
    "composition": composition, "bursty": bursty, "estimators": estimators, "ttca": ttca,
    "prefix": prefix, "scale": scale, "replicas": replicas, "plan": plan,
    "autoscale": autoscale, "lora": lora, "deadlines": deadlines,
    "ttca-multiturn": ttca_multiturn}


def run_experiment(name: str, out: Path, *, quick: bool = False, seed: int = 0,
                   log: Log = print, fanout: Fanout | None = None) -> Outcome:
    """Run a named experiment and write its outputs into ``out``; its simulations run where
    ``fanout`` says (default: serially here), with the serial run's results."""
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; expected one of {', '.join(EXPERIMENTS)}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    o = EXPERIMENTS[name](out, quick, seed, log, fanout or Fanout())
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
