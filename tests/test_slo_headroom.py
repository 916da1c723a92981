"""llm-d's predicted-latency SLO scorer (``slo-headroom``): its buckets and weights as its
published rule gives them, and its draw."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from duetime.policy import PolicyError, make_policy
from duetime.policy.base import Candidate, RoutingRequest
from duetime.sim import ClusterSim
from duetime.workload import load_workload, sample_requests


def _cands(running: list[int]) -> list[Candidate]:
    return [Candidate(f"i{k}", "m", 0.0, 0.0, SimpleNamespace(num_running=r))
            for k, r in enumerate(running)]


def _req(ttft_target: float, tpot_target: float = math.inf) -> RoutingRequest:
    return RoutingRequest("r", 100, None, np.array([50, 50, 50]), ttft_target,
                          tpot_target=tpot_target)


def test_positive_headroom_favours_the_tightest_fit():
    p = make_policy("slo-headroom")
    w, pos = p.weights(_req(1.0, 0.05), _cands([1, 1, 1]), np.array([0.1, 0.5, 0.9]),
                       np.array([0.01, 0.01, 0.01]))
    assert pos.tolist() == [True, True, True]
    # TTFT headroom 0.9, 0.5, 0.1 scaled to 1, 0.5, 0: blended 0.8 x that + 0.2 x 0.5 (TPOT
    # headrooms equal); weight floor((1 - blended) x 99) + 2
    assert w.tolist() == [11.0, 51.0, 91.0]


def test_a_pod_short_on_either_headroom_is_negative_and_idle_pods_go_first():
    p = make_policy("slo-headroom")
    ttft = np.array([0.2, 1.5, 0.3])
    tpot = np.array([0.09, 0.01, 0.01])  # pod 0 decodes too slowly for a 0.05 s target
    w, pos = p.weights(_req(1.0, 0.05), _cands([1, 1, 1]), ttft, tpot)
    assert pos.tolist() == [False, False, True]
    assert w[0] > 0 and w[1] > 0  # (each the only one in its deficit class: weight 82)
    w, _ = p.weights(_req(1.0, 0.05), _cands([1, 0, 1]), ttft, tpot)
    assert w[0] == 0 and w[1] > 0  # the idle negative pod strictly before the busy one
    # two pods short on TTFT: the smaller deficit weighs more
    w, _ = p.weights(_req(0.1), _cands([1, 1, 1]), np.array([0.2, 0.6, 1.1]), np.zeros(3))
    assert w[0] > w[1] > w[2] >= 2


def test_choose_draws_by_weight_and_prefers_the_positive_bucket():
    p = make_policy("slo-headroom", {"seed": 3})
    cands = _cands([1, 1, 1])
    ttft, tpot = np.array([0.1, 0.9, 2.0]), np.full(3, 0.01)
    p.predictions = lambda req, c, now: (ttft, tpot)  # (fixed forecasts)
    got = np.bincount([p.choose(_req(1.0), cands, 0.0).index for _ in range(3000)],
                      minlength=3) / 3000
    # positive: pods 0 (weight 11) and 1 (weight 91); pod 2 only in the 1% negative draw
    assert got[1] == pytest.approx(0.99 * 91 / 102, abs=0.03)
    assert got[0] == pytest.approx(0.99 * 11 / 102, abs=0.02)
    assert 0 < got[2] < 0.03


def test_it_routes_in_the_simulator_and_checks_its_weight():
    prof = load_workload("paper")
    rng = np.random.default_rng(0)
    reqs = sample_requests(prof, np.cumsum(rng.exponential(1 / 4.0, 60)), rng)
    res = ClusterSim(prof, make_policy("slo-headroom")).run(reqs)
    assert np.isfinite(res.forecast).all() and len(set(res.instance.tolist())) > 1
    with pytest.raises(PolicyError, match="ttft_weight"):
        make_policy("slo-headroom", {"ttft_weight": 1.5})
