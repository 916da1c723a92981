"""Experiment ``deadlines``: completion deadlines under length uncertainty (issue 36).

The SFS paper's workload (its pool of three models, tasks, arrivals and TTFT targets) with an
end-to-end deadline and a time-per-output-token target drawn per request by its task's class
(:data:`CLASSES`): *interactive* (alpaca, hotpotqa: a few seconds, a reader's pace) and
*batch* (govreport, writingprompts: tens of seconds, a looser pace).

What the router is told of a request's output length is what a length predictor can know: the
median and the 90th percentile of the request's (task, model) length distribution
(:class:`TaskLengths`, the workload profile's own log-normal). That is the predictor's real
error on these tasks: the trained predictor's length MAE is 0.96x the per-(task, model)
baseline's on the synthetic set (docs/predict.md, "Evaluation"); the simulator's default
(the truth +-30%) would be an oracle's.

Routers: ``sfs-deadline`` (finish at the q = 0.9 length meets the deadline), ``median-finish``
(the same rule with the median length plugged into the finish forecast: ``sfs-deadline`` with
q = 0.5), ``sfs`` (TTFT only), ``slo-headroom`` (llm-d's predicted-latency SLO scorer,
reimplemented from its published rule; no quality, no deadline) and ``load-aware``. The
references: ``sfs-deadline`` at other q (:data:`Q_SWEEP`), without its steady decode
(``steady`` 0: the replay's draining batch), and ``sfs-deadline`` and ``sfs`` told every
request's exact length (what the length predictor's error costs).
Metrics per router and rate: on deadline, OnTimeUtility by deadline (utility x 1{finished by
the deadline}), TPOT attainment, TTFT on time; per class too. ``summary.json``:
``gain_vs_ttft_sfs`` and ``gain_vs_median_length`` (OnTimeUtility-by-deadline AUC over the
rates, sfs-deadline / the other - 1) and each router's mean TPOT attainment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from duetime.experiments import report as rp
from duetime.experiments.fanout import Fanout
from duetime.experiments.runner import Point, Runner, run_points
from duetime.metrics import auc, deadline_met, tpot_met
from duetime.policy.deadline import Z90
from duetime.sim import SimResult
from duetime.workload import RequestSet, WorkloadProfile, load_workload, make_arrivals
from duetime.workload.requests import sample_requests

MODEL_JITTER = 0.1  # sample_requests: each model's length = the request's x exp(N(0, 0.1))


@dataclass(frozen=True, slots=True)
class DeadlineClass:
    """Requests of these tasks get a deadline ~ U(lo, hi) seconds after arrival and a TPOT
    target."""

    name: str
    tasks: tuple[str, ...]
    deadline_s: tuple[float, float]
    tpot_s: float


CLASSES = (DeadlineClass("interactive", ("alpaca", "hotpotqa"), (2.0, 4.0), 0.025),
           DeadlineClass("batch", ("govreport", "writingprompts"), (8.0, 16.0), 0.060))
ROUTERS = (("sfs-deadline", "sfs-deadline", ()),
           ("median-finish", "sfs-deadline", (("q", 0.5),)),
           ("sfs", "sfs", ()),
           ("slo-headroom", "slo-headroom", ()),
           ("load-aware", "load-aware", ()))
Q_SWEEP = (0.8, 0.95, 0.98)
DRAINING = (("sfs-deadline, draining", "sfs-deadline", (("steady", 0),)),)  # (the replay as is)
EXACT = (("sfs-deadline, exact lengths", "sfs-deadline", ()), ("sfs, exact lengths", "sfs", ()))
RATES = (3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
QUICK_RATES = (3.0, 5.0, 7.0, 9.0)
REQUESTS = 4000
QUICK_REQUESTS = 500


@dataclass(frozen=True, slots=True)
class TaskLengths:
    """A per-(task, model) length predictor: each request's median and p90 are those of its
    task's length distribution for the model (the profile's log-normal, scaled by the model's
    ``output_scale``, widened by the per-model jitter ``sample_requests`` draws)."""

    profile: WorkloadProfile

    def _table(self, requests: RequestSet, z: float) -> np.ndarray:
        out = np.zeros(requests.output.shape)
        for ti, t in enumerate(requests.tasks):
            spec = self.profile.tasks[t]
            sigma = math.hypot(spec.output.sigma, MODEL_JITTER)
            for mi, m in enumerate(requests.models):
                out[requests.task == ti, mi] = (spec.output.median * spec.output_scale[m]
                                                * math.exp(z * sigma))
        return out

    def median(self, requests: RequestSet, rng: np.random.Generator) -> np.ndarray:
        return self._table(requests, 0.0)

    def p90(self, requests: RequestSet, rng: np.random.Generator) -> np.ndarray:
        return self._table(requests, Z90)


def exact_lengths(requests: RequestSet, rng: np.random.Generator) -> np.ndarray:
    """Every request's true length per model (an oracle's prediction)."""
    return requests.output.astype(float)


def with_deadlines(requests: RequestSet, rng: np.random.Generator) -> RequestSet:
    """The requests with each one's class deadline and TPOT target (inf for a task in no
    class)."""
    deadline = np.full(len(requests), math.inf)
    tpot = np.full(len(requests), math.inf)
    for c in CLASSES:
        mine = np.isin(requests.task, [requests.tasks.index(t) for t in c.tasks])
        deadline[mine] = rng.uniform(*c.deadline_s, int(mine.sum()))
        tpot[mine] = c.tpot_s
    return replace(requests, deadline=deadline, tpot=tpot)


def make_stream(profile: WorkloadProfile, rate: float, n: int, seed: int) -> RequestSet:
    """Poisson arrivals at ``rate`` with the paper's requests and the classes' deadlines."""
    rng = np.random.default_rng([seed, int(rate * 1000), n])
    times = make_arrivals("poisson", rate).times(n, rng)
    return with_deadlines(sample_requests(profile, times, rng), rng)


def _class_rows(name: str, rate: float, res: SimResult) -> list[dict[str, Any]]:
    reqs = res.requests
    util = res.quality - res.lam * res.cost
    met = deadline_met(res)
    has, tpot_ok = tpot_met(res)
    rows = []
    for c in CLASSES:
        mine = np.isin(reqs.task, [reqs.tasks.index(t) for t in c.tasks])
        rows.append({"router": name, "rate": rate, "class": c.name,
                     "on_deadline": float(np.mean(met[mine])),
                     "deadline_utility": float(np.mean((util * met)[mine])),
                     "tpot_attainment": float(np.mean(tpot_ok[mine & has])),
                     "p90_e2e_s": float(np.percentile((res.finish - reqs.arrival)[mine], 90)),
                     "share_32b": float(np.mean(res.model[mine] == len(reqs.models) - 1))})
    return rows


def run_deadlines(out: Path, quick: bool, seed: int, log: Any, fanout: Fanout
                  ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """The routers over the rates (module doc): rows, summary and report sections."""
    profile = load_workload("paper")
    lengths = TaskLengths(profile)
    runner = Runner(profile, seed=seed, fanout=fanout, length_model=lengths.median,
                    length_p90_model=lengths.p90)
    exact = Runner(profile, seed=seed, fanout=fanout, length_model=exact_lengths)
    rates = QUICK_RATES if quick else RATES
    n = QUICK_REQUESTS if quick else REQUESTS
    sweep = tuple((f"sfs-deadline q={q:g}", "sfs-deadline", (("q", q),)) for q in Q_SWEEP)
    jobs = []
    for rate in rates:
        stream = make_stream(profile, rate, n, seed)
        for r, routers in ((runner, ROUTERS + sweep + DRAINING), (exact, EXACT)):
            for label, router, params in routers:
                p = Point(router, rate, n, label=label, params=params)
                r.set_stream(p, stream)
                jobs.append((r.portable(p), p))
    got = run_points(jobs, fanout, progress=log, keep=lambda p: True)
    rows = [row for row, _ in got]
    kept = {p: res for (_, p), (_, res) in zip(jobs, got, strict=True)}
    names = [label for label, _, _ in ROUTERS + sweep + DRAINING + EXACT]
    by_class = [r for p, res in kept.items() for r in _class_rows(p.name, p.rate, res)]
    aucs = {r: auc(rates, [x["deadline_utility"] for x in rows if x["router"] == r])
            for r in names}
    tpot = {r: float(np.mean([x["tpot_attainment"] for x in rows if x["router"] == r]))
            for r in names}
    on_deadline = {r: float(np.mean([x["on_deadline"] for x in rows if x["router"] == r]))
                   for r in names}
    class_auc = {c.name: {r: auc(rates, [x["deadline_utility"] for x in by_class
                                         if x["router"] == r and x["class"] == c.name])
                          for r in names} for c in CLASSES}
    ours = aucs["sfs-deadline"]
    summary = {
        "rates": list(rates), "requests": n, "deadline_utility_auc": aucs,
        "deadline_utility_auc_by_class": class_auc, "mean_on_deadline": on_deadline,
        "mean_tpot_attainment": tpot,
        "gain_vs_ttft_sfs": ours / aucs["sfs"] - 1 if aucs["sfs"] > 0 else None,
        "gain_vs_median_length": (ours / aucs["median-finish"] - 1
                                  if aucs["median-finish"] > 0 else None),
        "gain_vs_slo_headroom": (ours / aucs["slo-headroom"] - 1
                                 if aucs["slo-headroom"] > 0 else None),
        "gain_vs_ttft_sfs_exact_lengths": (aucs["sfs-deadline, exact lengths"]
                                           / aucs["sfs, exact lengths"] - 1),
        "gain_vs_ttft_sfs_by_q": {f"{q:g}": aucs["sfs-deadline" if q == 0.9 else
                                                 f"sfs-deadline q={q:g}"] / aucs["sfs"] - 1
                                  for q in sorted((0.9, *Q_SWEEP))},
        "tpot_no_worse_than_ttft_sfs": tpot["sfs-deadline"] >= tpot["sfs"],
        "tpot_no_worse_than_median_length": tpot["sfs-deadline"] >= tpot["median-finish"],
        "classes": {c.name: {"tasks": list(c.tasks), "deadline_s": list(c.deadline_s),
                             "tpot_ms": c.tpot_s * 1000} for c in CLASSES},
        "length_predictor": "per (task, model): the task's log-normal median and p90"}
    summary["target_met"] = bool(
        (summary["gain_vs_ttft_sfs"] or -1) >= 0.20
        and (summary["gain_vs_median_length"] or -1) >= 0.10
        and summary["tpot_no_worse_than_ttft_sfs"]
        and summary["tpot_no_worse_than_median_length"])
    rp.line_plot(out / "deadline_utility.png", rows, "rate", "deadline_utility",
                 title="OnTimeUtility by deadline")
    rp.line_plot(out / "on_deadline.png", rows, "rate", "on_deadline",
                 title="finished by the deadline")
    return rows, summary, _sections(rows, by_class, summary, names)


COLUMNS = ["router", "rate", "on_deadline", "deadline_utility", "tpot_attainment", "on_time",
           "p90_e2e_s", "mean_quality"]


def _sections(rows: list[dict[str, Any]], by_class: list[dict[str, Any]],
              summary: dict[str, Any], names: list[str]) -> list[str]:
    table = [{"router": r, "AUC": summary["deadline_utility_auc"][r],
              **{f"AUC {c}": summary["deadline_utility_auc_by_class"][c][r]
                 for c in summary["classes"]},
              "mean on deadline": summary["mean_on_deadline"][r],
              "mean TPOT attainment": summary["mean_tpot_attainment"][r]} for r in names]
    classes = "; ".join(f"{c}: {', '.join(v['tasks'])}, deadline U({v['deadline_s'][0]:g}, "
                        f"{v['deadline_s'][1]:g}) s, TPOT {v['tpot_ms']:g} ms"
                        for c, v in summary["classes"].items())
    return [
        "## OnTimeUtility by deadline\n\n"
        f"Classes: {classes}. Lengths told to the routers: the (task, model) median and "
        "p90. AUC over the rates of mean utility x 1{finished by the deadline}.\n\n"
        + rp.md_table(table, list(table[0]))
        + f"\nsfs-deadline vs TTFT-only sfs: {summary['gain_vs_ttft_sfs']:+.1%} (target "
        f"+20%); vs the median length in the finish forecast: "
        f"{summary['gain_vs_median_length']:+.1%} (target +10%); vs llm-d's SLO scorer: "
        f"{summary['gain_vs_slo_headroom']:+.1%}. TPOT attainment no worse than sfs's: "
        f"{summary['tpot_no_worse_than_ttft_sfs']}, than median-finish's: "
        f"{summary['tpot_no_worse_than_median_length']}.\n\n"
        "![OnTimeUtility by deadline](deadline_utility.png)\n\n"
        "![on deadline](on_deadline.png)\n",
        "## Per rate\n\n" + rp.md_table(rows, COLUMNS),
        "## Per class (share_32b: the share sent to the largest model)\n\n"
        + rp.md_table(by_class, ["router", "rate", "class", "on_deadline", "deadline_utility",
                                 "tpot_attainment", "p90_e2e_s", "share_32b"])]
