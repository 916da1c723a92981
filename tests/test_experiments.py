"""Every named experiment runs (quick) from the CLI and writes its files."""

from __future__ import annotations

import csv
import json

import pytest

from duetime.cli import main
from duetime.experiments import EXPERIMENTS

REQUIRED = {"router", "rate", "mean_ttft_s", "p95_ttft_s", "on_time", "utility",
            "ontime_utility"}


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_quick_writes_its_outputs(name, tmp_path, capsys) -> None:
    out = tmp_path / name
    assert main(["experiment", name, "--quick", "--out", str(out), "--seed", "1"]) == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    required = (REQUIRED if name != "ttca" else
                {"router", "context_tokens", "language", "mean_ttca_s", "success"})
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


def test_simulate_command(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--policy", "sfs", "--rate", "6", "--requests", "300",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 300 and summary["wall_s"] > 0 and summary["simulated_s"] > 0
    assert "| sfs |" in capsys.readouterr().out


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
