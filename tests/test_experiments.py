"""Every named experiment runs (quick) from the CLI and writes its files."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest

from duetime.cli import main
from duetime.experiments import EXPERIMENTS
from duetime.experiments import prefix as px
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.workload import load_workload

REQUIRED = {"router", "rate", "mean_ttft_s", "p95_ttft_s", "on_time", "utility",
            "ontime_utility"}


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_quick_writes_its_outputs(name, tmp_path, capsys) -> None:
    out = tmp_path / name
    assert main(["experiment", name, "--quick", "--out", str(out), "--seed", "1"]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    required = {"ttca": {"router", "context_tokens", "language", "mean_ttca_s", "success"},
                "plan": {"variant", "rate", "method", "pool", "cost_per_hour", "gpus",
                         "worst_on_time", "quality"},
                "autoscale": {"trace", "autoscaler", "router", "on_time", "quality",
                              "gpu_hours", "scale_events"}}.get(name, REQUIRED)
    assert rows and set(rows[0]) >= required
    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == name and summary["quick"] is True
    report = (out / "report.md").read_text()
    assert report.startswith(f"# Experiment `{name}`")
    for png in report.split("](")[1:]:
        assert (out / png.split(")")[0]).stat().st_size > 1000
    if name == "load-sweep":
        assert set(summary["auc"]) >= {"sfs", "round-robin", "shortest-queue", "load-aware",
                                       "latency-agnostic", "throughput", "lps"}
        best = max(v for k, v in summary["auc"].items()
                   if k in ("round-robin", "shortest-queue", "load-aware", "latency-agnostic"))
        assert summary["auc_gain_vs_best_baseline"] == pytest.approx(
            summary["auc"]["sfs"] / best - 1)
    if name == "estimators":
        assert set(summary["mape"]) == {"sfs", "throughput", "lps"}
    if name == "ttca":
        assert set(summary["ttca_gain"]) == {"laar_vs_load_aware", "laar_vs_session_affinity",
                                             "ttca_vs_laar"}
        assert summary["ttca_gain"]["laar_vs_load_aware"] > 0
    if name == "prefix":
        _check_prefix(out, rows, summary)
    if name == "replicas":
        for key in ("sfs_shared_vs_single", "sfs_independent_vs_single"):
            assert _finite(summary[key]) and 0 < summary[key] < 2
        # shared views keep more of one router's OnTimeUtility than independent ones
        assert summary["sfs_shared_vs_single"] > summary["sfs_independent_vs_single"]
        assert {r["router"] for r in rows} == {"sfs", "load-aware"}
        assert {r["routers"] for r in rows} == {"1", "2", "4"}
        assert set(summary["table"]["sfs"]["4"]) >= {"independent", "shared 0.1 s"}
    if name == "plan":
        _check_plan(rows, summary)
    if name == "autoscale":
        assert {(r["trace"], r["router"], r["autoscaler"]) for r in rows} == {
            (t, r, a) for t in ("diurnal", "bursty") for r in ("sfs", "load-aware")
            for a in ("static", "queue-threshold", "llm-d-saturation", "throughput-planner",
                      "duetime")} | {("diurnal", "sfs", "oracle")}
        for key in ("duetime_gpu_hours_vs_static", "duetime_gpu_hours_vs_best_baseline",
                    "bursty_duetime_gpu_hours_vs_static", "oracle_gpu_hours_vs_static"):
            assert _finite(summary[key]) and summary[key] > 0
        # foresight of the rate saves GPU-hours against the static peak pool
        assert summary["oracle_gpu_hours_vs_static"] < 1
        static = [r for r in rows if r["autoscaler"] == "static"]
        assert all(r["scale_events"] == "0" for r in static)
        assert set(summary["attainment"]) >= {"sfs/duetime", "load-aware/static"}
    if name == "lora":
        assert {r["router"] for r in rows} == {"sfs", "lora-affinity", "load-aware",
                                                "round-robin"}
        assert {(r["adapters"], r["max_loras"]) for r in rows} == {("8", "2"), ("64", "8")}
        auc = summary["ontime_utility_auc"]
        assert summary["sfs_gain_vs_lora_affinity"] == pytest.approx(
            auc["sfs"] / auc["lora-affinity"] - 1)
        # replaying the cap beats the adapter scorer; routing blind to adapters is far worse
        assert auc["sfs"] > auc["lora-affinity"] > auc["round-robin"]
        assert isinstance(summary["sfs_p90_no_worse_where_both_on_time"], bool)
        assert set(summary["by_setting"]["8 adapters, max_loras 2"]["p90_ttft_s"]) == set(auc)
    if name == "scale":
        sizes = {"3", "30", "90"}
        for load in ("0.7", "0.9"):
            assert set(summary["sfs_on_time"][load]) == sizes
            assert all(0 <= v <= 1 for v in summary["sfs_on_time"][load].values())
        assert set(summary["decision_us_p50"]) == sizes
        assert all(_finite(v) and v > 0 for v in summary["decision_us_p50"].values())
        assert isinstance(summary["sfs_bigger_pools_no_worse"], bool)
        assert {r["router"] for r in rows} >= {"sfs", "round-robin", "load-aware"}


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_plan(rows, summary) -> None:
    ratios = summary["joint_vs_independent_cost"]
    assert set(ratios) == {"paper", "heterogeneous"}
    for per_rate in ratios.values():
        assert len(per_rate) == 3
        # the joint plan is the cheapest pool of its space that meets the floors; sizing
        # model by model can only find one as cheap or dearer
        assert all(_finite(r) and 0 < r <= 1 + 1e-9 for r in per_rate.values())
    for r in rows:
        if "cost_per_hour" in r:
            assert float(r["worst_on_time"]) >= 0.95 and float(r["quality"]) >= 0.8
    # the search finds the enumerated optimum with a small share of its simulations
    assert all(_finite(r) and r <= 1.05 for r in summary["search_vs_grid_cost"].values())
    assert all(0 < r <= 0.1 for r in summary["search_simulations_vs_grid"].values())
    day = summary["diurnal_gpu_hours_vs_static_peak"]
    assert _finite(day) and 0 < day <= 1 and summary["diurnal"]["intervals"] == 96


def _check_prefix(out, rows, summary) -> None:
    views, workloads = ("precise", "estimated"), ("multi-turn", "system-prompts")
    assert set(rows[0]) >= {"workload", "cache_view", "p50_ttft_s", "p90_ttft_s",
                            "throughput_rps", "cache_hit_rate", "working_set_ratio"}
    routers = {"sfs", "prefix-load", "cache-aware", "round-robin", "load-aware"}
    for w in workloads:
        for v in views:
            got = {r["router"] for r in rows if r["workload"] == w and r["cache_view"] == v}
            assert got >= routers
            assert len({r["rate"] for r in rows if r["workload"] == w}) >= 2
    gain = summary["sfs_gain_vs_best_cache_aware"]
    assert set(gain) == set(views) and all(_finite(g) for g in gain.values())
    by_w = summary["sfs_gain_vs_best_cache_aware_by_workload"]
    for w in workloads:
        assert all(_finite(by_w[w][v]) for v in views)
        for v in views:
            aucs = summary["auc"][w][v]
            assert all(_finite(a) and a > 0 for a in aucs.values())
            best = max(aucs["prefix-load"], aucs["cache-aware"])
            assert by_w[w][v] == pytest.approx(aucs["sfs"] / best - 1)
            p90 = summary["p90_ttft_vs_best_cache_aware"][v][w]
            assert _finite(p90["sfs_mean_s"]) and _finite(p90["best_mean_s"])
        lo, hi = summary["working_set_ratio_range"][w]
        assert _finite(lo) and _finite(hi) and 0 < lo <= hi
        hit = summary["mean_cache_hit_rate"][w]["precise"]
        assert hit["prefix-load"] > hit["round-robin"] and hit["cache-aware"] > hit["round-robin"]
    assert _finite(summary["kv_capacity_tokens"]) and summary["kv_capacity_tokens"] > 0
    assert all(isinstance(x, bool) for x in summary["sfs_p90_no_worse_at_every_load"].values())
    assert len(list(out.glob("prefix_*.png"))) == 6


def test_prefix_streams_working_set() -> None:
    """The multi-turn window runs at the nominal request rate (steady state) and its working
    set grows with the rate; the system prompts' is the tenants used x their length."""
    profile = load_workload("paper")
    low = px.make_stream("multi-turn", profile, 3.0, 2000, 0)
    high = px.make_stream("multi-turn", profile, 9.0, 2000, 0)
    assert len(low.requests) == 2000 and low.requests.segments is not None
    assert 2.5 < low.arrival_rps < 3.5 and 7.5 < high.arrival_rps < 10.5
    assert 0 < low.working_set_tokens < high.working_set_tokens
    sp = px.make_stream("system-prompts", profile, 5.0, 500, 0)
    used = len(set(sp.requests.session.tolist()))
    assert sp.working_set_tokens == used * px.SYSTEM_PROMPTS["system_tokens"]
    assert sp.requests.prompt.min() > px.SYSTEM_PROMPTS["system_tokens"]


def test_live_context_tokens() -> None:
    """Turn j counts its prompt + answer from its arrival until its session's next turn."""
    from duetime.workload import RequestSet

    n = 3  # session 0: turns at 0 and 10; session 1: one turn at 5 (counts for nothing)
    rs = RequestSet(np.array([0.0, 5.0, 10.0]), np.zeros(n, dtype=np.int64),
                    np.array([100, 50, 400]), np.array([[20], [30], [40]]), np.zeros((n, 1)),
                    np.ones(n), ["t"], ["m"], session=np.array([0, 1, 0]))
    assert px.live_context_tokens(rs, 0.0, 10.0) == pytest.approx(120.0)
    assert px.live_context_tokens(rs, 5.0, 15.0) == pytest.approx(120.0 * 5 / 10)


def test_sfs_ignores_the_cache_view() -> None:
    """Why the prefix experiment runs sfs (and the load-only routers) once per point: a policy
    that does not consume the prefix index routes the same whatever the view."""
    profile = load_workload("paper")
    rs = px.make_stream("system-prompts", profile, 6.0, 200, 0).requests
    got = []
    for view in ("precise", "estimated"):
        sim = ClusterSim(profile, make_policy("sfs", defaults={"lambda": profile.lam}),
                         prefix_caching=True, cache_view=view)
        res = sim.run(rs)
        got.append((res.instance.copy(), res.first_token.copy()))
    assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])


def test_simulate_command(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--policy", "sfs", "--rate", "6", "--requests", "300",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 300 and summary["wall_s"] > 0 and summary["simulated_s"] > 0
    assert "| sfs |" in capsys.readouterr().out


def test_simulate_through_the_admission_queue(tmp_path, capsys) -> None:
    """``--admission-queue N``: a saturated pool's late forecasts wait in the gateway's queue
    (summary ``queued``, ``p90_queue_s``); one router, open loop only."""
    out = tmp_path / "queued"
    assert main(["simulate", "--policy", "sfs", "--workload", "demo", "--rate", "20",
                 "--requests", "1200", "--admission-queue", "256", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["queued"] > 0.05 and summary["p90_queue_s"] > 0
    assert "p90_queue_s" in capsys.readouterr().out
    code = main(["simulate", "--policy", "sfs", "--rate", "2", "--requests", "10",
                 "--clients", "2", "--admission-queue", "8", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "--admission-queue runs an open loop" in err and err.count("\n") == 1


def test_simulate_bad_workload(tmp_path, capsys) -> None:
    code = main(["simulate", "--policy", "sfs", "--rate", "6", "--requests", "10",
                 "--workload", str(tmp_path / "none.yaml"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("duetime: error:") and err.count("\n") == 1


def test_simulate_trace_and_closed_loop(tmp_path, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival,task,prompt_tokens,output_tokens\n0.5,alpaca,30,100\n"
                     "0.1,govreport,9000,\n0.2,hotpotqa,1500,50\n")
    out = tmp_path / "trace"
    assert main(["simulate", "--policy", "sfs", "--trace", str(trace), "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert [r["task"] for r in rows] == ["govreport", "hotpotqa", "alpaca"]
    assert all(float(r["first_token_s"]) > float(r["arrival_s"]) for r in rows)
    out = tmp_path / "closed"
    assert main(["simulate", "--policy", "shortest-queue", "--requests", "50", "--clients",
                 "4", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["clients"] == 4
    code = main(["simulate", "--policy", "sfs", "--out", str(tmp_path / "x")])
    assert code == 2 and "--requests" in capsys.readouterr().err
