"""Explanations of routing decisions (:mod:`duetime.policy.explain`) and the dry run
(:meth:`Policy.preview`): a preview is the choice the policy makes next, and previews with
their explanations change no later choice, for every registered policy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duetime.policy import make_policy, policy_names
from duetime.policy.explain import KEYS, explain
from duetime.sim import ClusterSim
from duetime.workload import load_workload, multi_turn

DEMO = load_workload("demo")
REPLICAS = [(f"r{k}", "qwen3-8b") for k in range(3)] + [("s", "qwen3-0.6b")]


def conversations():
    """Chat sessions (prompts that share blocks, session ids) fast enough to queue."""
    return multi_turn(DEMO, 3.0, np.random.default_rng(1), n_sessions=25, question_len=300,
                      answer_len=150, think_time_s=2.0)


def run(name: str, spy: bool, instances):
    policy = make_policy(name)
    seen: list[tuple[int, int, dict]] = []
    if spy:
        choose = policy.choose

        def spied(req, cands, now):
            p = policy.preview(req, cands, now)
            e = explain(policy, req, cands, now, p)
            d = choose(req, cands, now)
            seen.append((p.index, d.index, e))
            if p.forecast is not None:  # (the same replay on the same state)
                assert d.forecast == pytest.approx(p.forecast)
            return d

        policy.choose = spied
    res = ClusterSim(DEMO, policy, seed=0, instances=instances, prefix_caching=True
                     ).run(conversations())
    return res, seen


@pytest.mark.parametrize("instances", [None, REPLICAS], ids=["three-models", "replicas"])
@pytest.mark.parametrize("name", policy_names())
def test_previews_and_explanations_change_no_decision(name: str, instances) -> None:
    plain, _ = run(name, False, instances)
    spied, seen = run(name, True, instances)
    assert len(seen) == len(plain.instance) > 50
    np.testing.assert_array_equal(spied.instance, plain.instance)
    assert [p for p, _, _ in seen] == [d for _, d, _ in seen]  # the preview is the choice
    for _, d, e in seen:
        cands = e["candidates"]
        assert e["policy"] == name and cands[d]["chosen"] and e["chosen"] == cands[d]["instance"]
        assert sum(c["chosen"] for c in cands) == 1
        assert all(set(KEYS) <= set(c) for c in cands)
        assert all(c["cost"] > 0 and c["running"] >= 0 for c in cands)


def test_sfs_explains_its_rule_with_every_forecast() -> None:
    _, seen = run("sfs", True, None)
    late = 0
    for _, d, e in seen:
        cands = e["candidates"]
        assert all(c["forecast_ttft_ms"] is not None and c["utility"] is not None
                   for c in cands)
        feasible = [c for c in cands if c["feasible"]]
        assert all(c["feasible"] == (c["forecast_ttft_ms"] <= c["target_ms"]) for c in cands)
        if feasible:  # the best utility among those that meet the target
            assert cands[d]["utility"] == max(c["utility"] for c in feasible)
            assert "meets the target" in e["rule"]
        else:  # none does: the least forecast
            late += 1
            assert cands[d]["forecast_ttft_ms"] == min(c["forecast_ttft_ms"] for c in cands)
            assert "least forecast" in e["rule"]
        assert e["score"] == "utility" and e["better"] == "higher"
    assert late < len(seen)


@pytest.mark.parametrize("name,score", [("shortest-queue", "load (running + waiting)"),
                                        ("load-aware", "load-aware score"),
                                        ("laar", "L/Q"), ("ttca", "L/Q"),
                                        ("prefix-load", "weighted score"),
                                        ("sfs-soft", "U - delta x TTFT")])
def test_each_policy_names_what_it_ranks_by_and_the_winner_has_the_best_score(
        name: str, score: str) -> None:
    _, seen = run(name, True, None)
    for _, d, e in seen:
        assert e["score"] == score
        vals = [c["score"] for c in e["candidates"]]
        pick = max if e["better"] == "higher" else min
        best = pick(v for v in vals if v is not None)
        if name == "laar":
            assert math.isclose(vals[d], best, rel_tol=1e-9)
        else:
            assert vals[d] == best


def test_round_robin_weighs_nothing_and_its_preview_keeps_the_cursor() -> None:
    from duetime.policy.base import Candidate, RoutingRequest

    rr = make_policy("round-robin")
    cands = [Candidate(n, n, 0.1, 0.2, view=None) for n in "abc"]  # (it reads no view)
    req = RoutingRequest("x", 10, None, np.array([5, 5, 5]), 1.0)
    assert [rr.preview(req, cands, 0).index for _ in range(3)] == [0, 0, 0]
    assert [rr.choose(req, cands, 0).index for _ in range(4)] == [0, 1, 2, 0]
    assert rr.preview(req, cands, 0).index == 1
