"""Completion deadlines in the simulator: request columns, what the router is told, the
metrics, and the ``deadlines`` experiment's summary."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from duetime.experiments import run_experiment
from duetime.experiments.deadlines import CLASSES, TaskLengths, make_stream
from duetime.metrics import summarize
from duetime.policy import make_policy
from duetime.policy.base import Decision
from duetime.sim import ClusterSim
from duetime.workload import load_workload


@pytest.fixture(scope="module")
def paper():
    return load_workload("paper")


def test_streams_carry_class_deadlines_and_tpot_targets(paper):
    reqs = make_stream(paper, 4.0, 200, seed=1)
    assert reqs.deadline.shape == reqs.tpot.shape == (200,)
    for c in CLASSES:
        mine = np.isin(reqs.task, [reqs.tasks.index(t) for t in c.tasks])
        assert mine.any()
        lo, hi = c.deadline_s
        assert ((reqs.deadline[mine] >= lo) & (reqs.deadline[mine] <= hi)).all()
        assert (reqs.tpot[mine] == c.tpot_s).all()
    head = reqs.head(10)
    assert head.deadline.tolist() == reqs.deadline[:10].tolist()
    assert make_stream(paper, 4.0, 200, seed=1).deadline.tolist() == reqs.deadline.tolist()


class Recording:
    """A policy that records what it is told and sends everything to candidate 0."""

    name = "recording"
    consumes = frozenset({"output_length"})

    def __init__(self) -> None:
        self.seen = []

    def choose(self, req, cands, now):
        self.seen.append((req.deadline, req.tpot_target, req.output_tokens.copy(),
                          None if req.output_p90 is None else req.output_p90.copy()))
        return Decision(0)


def test_the_router_is_told_deadlines_tpot_and_the_length_spread(paper):
    reqs = make_stream(paper, 4.0, 40, seed=2)
    lengths = TaskLengths(paper)
    rec = Recording()
    ClusterSim(paper, rec, length_model=lengths.median, length_p90_model=lengths.p90).run(reqs)
    assert [s[0] for s in rec.seen] == reqs.deadline.tolist()
    assert [s[1] for s in rec.seen] == reqs.tpot.tolist()
    med, p90 = lengths.median(reqs, None), lengths.p90(reqs, None)
    for i, (_, _, out, got_p90) in enumerate(rec.seen):
        assert out.tolist() == np.rint(med[i]).astype(int).tolist()
        assert np.allclose(got_p90, p90[i]) and (got_p90 > out).all()
    plain = reqs.head(5)  # (a request set without the columns: none has a deadline)
    plain.deadline = plain.tpot = None
    rec = Recording()
    ClusterSim(paper, rec).run(plain)
    assert all(s[0] == math.inf and s[1] == math.inf and s[3] is None for s in rec.seen)


def test_deadline_and_tpot_metrics_follow_their_definitions(paper):
    reqs = make_stream(paper, 4.0, 120, seed=3)
    res = ClusterSim(paper, make_policy("round-robin")).run(reqs)
    row = summarize(res)
    e2e = res.finish - reqs.arrival
    met = e2e <= reqs.deadline
    util = res.quality - res.lam * res.cost
    assert row["on_deadline"] == pytest.approx(met.mean())
    assert row["deadline_utility"] == pytest.approx(np.mean(util * met))
    n = res.output_tokens
    has = n > 1
    tpot = (res.finish - res.first_token)[has] / (n[has] - 1)
    assert row["tpot_attainment"] == pytest.approx(np.mean(tpot <= reqs.tpot[has]))
    assert 0 < row["on_deadline"] < 1  # (the premise: some are late at this load)


def test_the_experiment_runs_quick_and_writes_its_gains(tmp_path, monkeypatch):
    import duetime.experiments.deadlines as dl

    monkeypatch.setattr(dl, "QUICK_RATES", (4.0, 8.0))
    monkeypatch.setattr(dl, "QUICK_REQUESTS", 120)
    o = run_experiment("deadlines", tmp_path, quick=True, log=lambda s: None)
    s = json.loads((tmp_path / "summary.json").read_text())
    aucs = s["deadline_utility_auc"]
    assert s["gain_vs_ttft_sfs"] == pytest.approx(aucs["sfs-deadline"] / aucs["sfs"] - 1)
    assert s["gain_vs_median_length"] == pytest.approx(
        aucs["sfs-deadline"] / aucs["median-finish"] - 1)
    assert set(aucs) >= {"sfs-deadline", "median-finish", "sfs", "slo-headroom", "load-aware"}
    assert {r["router"] for r in o.rows} >= set(aucs)
    assert "vs the median length in the finish forecast" in (tmp_path / "report.md").read_text()
