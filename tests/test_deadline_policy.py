"""``sfs-deadline`` (duetime.policy.deadline): the output length at probability q of the
predicted median and p90, the finish forecast there, and the choice it makes where a
TTFT-only router would send a request that cannot finish in time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duetime.engine import Paper4, ResidentRequest, SchedulerConfig, Snapshot
from duetime.estimate import SfsEstimator
from duetime.policy import Candidate, PolicyError, RoutingRequest, make_policy
from duetime.policy.deadline import length_quantile

CFG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, block_size=16)
MODEL = Paper4(b0=0.001, b1=2e-3, b2=0.0, b3=0.0)  # (decode steps cost by their batch)


class View:
    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap
        self.request_overhead_s = 0.0

    def snapshot(self) -> Snapshot:
        return self._snap


def decoding(n: int) -> Snapshot:
    """``n`` requests decoding, far from their ends."""
    return Snapshot(CFG, MODEL, time=0.0, running=[
        ResidentRequest(f"r{i}", 100, 104, 5, 900) for i in range(n)])


def request(deadline: float, tpot: float = math.inf, p90=None) -> RoutingRequest:
    return RoutingRequest("q", 100, np.array([0.9, 0.5]), np.array([50, 50]), 0.5,
                          deadline=deadline, tpot_target=tpot,
                          output_p90=None if p90 is None else np.array(p90))


def test_the_length_at_q_of_a_log_normal_through_median_and_p90() -> None:
    med, p90 = np.array([100, 100, 40]), np.array([200, 100, 20])
    assert length_quantile(med, p90, 0.9).tolist() == [200, 100, 40]
    assert length_quantile(med, p90, 0.5).tolist() == [100, 100, 40]
    assert length_quantile(med, None, 0.99).tolist() == [100, 100, 40]
    for q in (0, 1, 1.5):
        with pytest.raises(PolicyError, match=r"policy\.q"):
            make_policy("sfs-deadline", {"q": q})
    got = length_quantile(med, p90, 0.99)[0]
    assert 200 < got == pytest.approx(100 * 2 ** (2.3263 / 1.2816), abs=1)


def test_it_sends_a_request_where_it_finishes_by_its_deadline() -> None:
    """Instance 0 (the better model) meets the TTFT target but decodes 30 requests at once;
    instance 1 is idle. TTFT-only sfs takes 0; sfs-deadline takes 1 when the finish at 0
    misses the deadline, and 0 when it does not."""
    views = [View(decoding(30)), View(decoding(0))]
    cands = [Candidate(f"i{k}", f"m{k}", 0.0, 0.0, v) for k, v in enumerate(views)]
    est = SfsEstimator()
    end = [est.finishes(v, 100, [50], 0.0)[0] for v in views]
    ttft = [est.ttft(v, 100, 0.0) for v in views]
    assert max(ttft) < 0.5 and end[1] < 1.0 < end[0]
    assert make_policy("sfs").choose(request(1.0), cands, 0.0).index == 0
    policy = make_policy("sfs-deadline")
    d = policy.choose(request(1.0), cands, 0.0)
    assert d.index == 1 and d.forecast == pytest.approx(ttft[1])
    assert policy.choose(request(end[0] + 0.01), cands, 0.0).index == 0
    # the same through its time-per-output-token target alone
    tpot0 = (end[0] - est.finishes(views[0], 100, [1], 0.0)[0]) / 49
    assert policy.choose(request(math.inf, tpot=tpot0 * 0.9), cands, 0.0).index == 1
    # an uncertain length: the p90 (200 tokens) at 0 misses a deadline its median meets
    p90 = request(end[0] + 0.01, p90=[200, 200])
    assert policy.choose(p90, cands, 0.0).index == 1
    assert make_policy("sfs-deadline", {"q": 0.5}).choose(p90, cands, 0.0).index == 0
    # none can: the least finish
    assert policy.choose(request(0.01), cands, 0.0).index == 1
    described = policy.describe(request(1.0), cands, 0.0, 1)
    assert described.columns["feasible"] == [False, True]
    assert described.columns["forecast_finish_s"] == pytest.approx(end)


def test_a_steady_decode_does_not_speed_up_as_the_batch_drains() -> None:
    """30 requests 3 tokens from their ends: the replay's probe decodes beside them for 3
    steps, then alone. ``steady`` (the default) holds the time per token at least at the
    next STEADY_TOKENS tokens' (arrivals refill a batch that drains); ``steady`` 0 keeps the
    replay's."""
    from duetime.policy.deadline import STEADY_TOKENS

    snap = Snapshot(CFG, MODEL, time=0.0, running=[
        ResidentRequest(f"r{i}", 100, 104, 5, 8) for i in range(30)])
    cand = Candidate("i0", "m0", 0.0, 0.0, View(snap))
    est = SfsEstimator()
    k = STEADY_TOKENS + 1
    first, near, end = est.finishes(cand.view, 100, [1, k, 200], 0.0)
    near_tpot = (near - first) / (k - 1)
    assert near_tpot > (end - first) / 199  # (the premise: the batch drains)
    req = request(math.inf)
    _, steady_end, tpot = make_policy("sfs-deadline")._forecast(req, cand, 200, 0.0)
    assert tpot == pytest.approx(near_tpot) and steady_end == pytest.approx(
        first + 199 * near_tpot)
    _, drain_end, _ = make_policy("sfs-deadline", {"steady": 0})._forecast(req, cand, 200, 0.0)
    assert drain_end == pytest.approx(end) and drain_end < steady_end
    with pytest.raises(PolicyError, match=r"policy\.steady"):
        make_policy("sfs-deadline", {"steady": 2})
