"""Pools that change in the simulator (duetime.sim.scaling): exact when nothing scales; a new
replica serves only after its scale-up delay; a drained one takes no new request and finishes
those it has; GPU time is counted from asking to release."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duetime.autoscale import Scripted, Static
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.sim.fleet import FleetSpec
from duetime.sim.scaling import Scaling
from duetime.workload import load_workload, make_arrivals, sample_requests

PAPER = load_workload("paper")


def stream(rate: float, n: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return sample_requests(PAPER, make_arrivals("poisson", rate).times(n, rng), rng)


def run(policy: str, reqs, scaling=None, instances=None):
    pol = make_policy(policy, defaults={"lambda": PAPER.lam, "seed": 0, "delta": 1e-6})
    return ClusterSim(PAPER, pol, seed=0, scaling=scaling, instances=instances).run(reqs)


@pytest.mark.parametrize("policy", ["sfs", "round-robin", "load-aware"])
def test_a_pool_that_never_changes_runs_as_without_scaling(policy):
    reqs = stream(7.0, 1500)
    plain = run(policy, reqs)
    static = run(policy, reqs, Scaling(Static(), interval_s=5.0))
    assert np.array_equal(static.instance, plain.instance)
    assert np.array_equal(static.first_token, plain.first_token)
    assert np.array_equal(static.finish, plain.finish)
    rec = static.scaling
    assert rec.events == [] and len(rec.timeline) > 10
    assert rec.instance_hours() == pytest.approx(3 * (np.nanmax(plain.finish)
                                                      - reqs.arrival[0]) / 3600)


def test_a_new_replica_serves_only_after_its_delay():
    reqs = stream(6.0, 1500)
    t0 = float(reqs.arrival[0])
    up = Scripted(((t0 + 30.0, {"qwen3-8b": 3}),))
    res = run("round-robin", reqs, Scaling(up, interval_s=10.0, scale_up_delay_s=45.0))
    rec = res.scaling
    new = [k for k, r in enumerate(rec.replicas) if r.model == "qwen3-8b" and r.asked > t0]
    assert len(new) == 2 and [e[2] for e in rec.events] == [1, 1]
    for k in new:
        r = rec.replicas[k]
        assert r.asked == pytest.approx(t0 + 30.0) and r.ready == pytest.approx(t0 + 75.0)
        mine = res.instance == k
        assert mine.any() and (reqs.arrival[mine] >= r.ready).all()
    # round-robin over the larger pool once they serve: the 8B model gets more of the traffic
    later = reqs.arrival >= t0 + 75.0
    share = np.mean(res.model[later] == PAPER.model_names.index("qwen3-8b"))
    assert share == pytest.approx(3 / 5, abs=0.05)


def test_a_drained_replica_takes_nothing_new_and_finishes_what_it_has():
    reqs = stream(6.0, 1200)
    t0 = float(reqs.arrival[0])
    pairs = [("qwen3-0.6b", "qwen3-0.6b"), *[(f"qwen3-8b.{k}", "qwen3-8b") for k in range(3)],
             ("qwen3-32b", "qwen3-32b")]
    down = Scripted(((t0 + 40.0, {"qwen3-8b": 1}),))
    res = run("load-aware", reqs, Scaling(down, interval_s=20.0), instances=pairs)
    rec = res.scaling
    drained = [k for k, r in enumerate(rec.replicas) if r.drained < math.inf]
    assert len(drained) == 2
    assert not np.isnan(res.finish).any()  # every request finished
    for k in drained:
        r = rec.replicas[k]
        mine = res.instance == k
        assert (reqs.arrival[mine] < r.drained).all()
        last = res.finish[mine].max() if mine.any() else r.drained
        assert r.released == pytest.approx(max(r.drained, last))
    kept = [r for r in rec.replicas if r.model == "qwen3-8b" and r.drained == math.inf]
    assert len(kept) == 1


def test_a_replica_let_go_while_starting_is_paid_until_then():
    reqs = stream(4.0, 600)
    t0 = float(reqs.arrival[0])
    plan = Scripted(((t0 + 20.0, {"qwen3-32b": 2}), (t0 + 40.0, {"qwen3-32b": 1})))
    res = run("round-robin", reqs, Scaling(plan, interval_s=20.0, scale_up_delay_s=60.0,
                                           gpus={"qwen3-32b": 2}))
    rec = res.scaling
    k = next(k for k, r in enumerate(rec.replicas) if r.asked > t0)
    r = rec.replicas[k]
    assert r.drained == pytest.approx(t0 + 40.0) and r.drained < r.ready
    assert r.released == r.drained and not (res.instance == k).any()
    end = float(np.nanmax(res.finish))
    expect = (2 * 20.0 + (end - t0) * (1 + 1 + 2)) / 3600  # the cancelled one, the pool
    assert rec.gpu_hours() == pytest.approx(expect)


def test_replica_bounds_and_what_cannot_scale():
    reqs = stream(4.0, 300)
    t0 = float(reqs.arrival[0])
    many = Scripted(((t0 + 10.0, {"qwen3-8b": 50, "qwen3-0.6b": 0}),))
    res = run("round-robin", reqs, Scaling(many, interval_s=10.0, scale_up_delay_s=0.0,
                                           max_replicas=4, min_replicas=1))
    counts = {m: sum(1 for r in res.scaling.replicas if r.model == m) for m in PAPER.models}
    assert counts == {"qwen3-0.6b": 1, "qwen3-8b": 4, "qwen3-32b": 1}
    with pytest.raises(ValueError, match="min_replicas"):
        Scaling(Static(), min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="no scale to zero"):
        Scaling(Static(), min_replicas=0)
    with pytest.raises(ValueError, match="interval_s"):
        Scaling(Static(), interval_s=0)
    pol = make_policy("sfs", defaults={"lambda": PAPER.lam, "seed": 0, "delta": 1e-6})
    fleet = FleetSpec(2, "shared", 0.1, "random").fleet(
        lambda k: make_policy("sfs", defaults={"lambda": PAPER.lam, "seed": k}), 0)
    with pytest.raises(ValueError, match="one router"):
        ClusterSim(PAPER, fleet, scaling=Scaling(Static()))
    with pytest.raises(ValueError, match="open loop"):
        ClusterSim(PAPER, pol, scaling=Scaling(Static())).run(reqs, closed_loop=4)


def test_sfs_forecasts_over_replicas_added_while_it_runs():
    # sfs ranks replicas on the pool's board of wait summaries: the board follows the pool
    reqs = stream(9.0, 1500)
    t0 = float(reqs.arrival[0])
    up = Scripted(((t0 + 20.0, {"qwen3-8b": 2, "qwen3-32b": 2}),))
    res = run("sfs", reqs, Scaling(up, interval_s=10.0, scale_up_delay_s=30.0))
    plain = run("sfs", reqs)
    rec = res.scaling
    new = [k for k, r in enumerate(rec.replicas) if r.asked > t0]
    assert len(new) == 2
    for k in new:
        mine = res.instance == k
        assert mine.sum() > 20 and (reqs.arrival[mine] >= rec.replicas[k].ready).all()
    on_time = (res.ttft <= reqs.target).mean()
    assert on_time > (plain.ttft <= reqs.target).mean()  # more capacity, more on time


def test_the_hpa_arithmetic():
    from duetime.autoscale.hpa import Hpa

    h = Hpa()
    assert h.recommend(0.0, 4, 1.05) == 4          # within the tolerance
    assert h.recommend(15.0, 4, 2.6) == 8          # ceil(4 x 2.6) = 11, at most x2 / +4
    assert h.recommend(30.0, 8, 1.6) == 13         # ceil(12.8), within 15 s of 8: <= 16
    assert h.recommend(45.0, 8, 0.25) == 8         # a scale-down waits for the window
    assert h.recommend(400.0, 8, 0.25) == 2        # ... 300 s after the higher wants
    # llm-d's behaviour: up after a 30 s window, down one pod per 120 s after a 180 s window
    from duetime.autoscale.hpa import Behavior

    g = Hpa(behavior=Behavior(up_window_s=30, up_pods=4, up_period_s=60, down_window_s=180,
                              down_pods=1, down_period_s=120))
    assert g.scale(0.0, 3, 6) == 6 and g.scale(15.0, 6, 12) == 6  # least over 30 s: 6
    assert g.scale(60.0, 6, 12) == 12                              # doubling within 60 s
    assert g.scale(200.0, 12, 3) == 12             # 12 was wanted within 180 s
    assert g.scale(300.0, 12, 3) == 11             # then one pod per 120 s
    assert g.scale(360.0, 11, 3) == 11 and g.scale(420.0, 11, 3) == 10


class Recorder:
    """A static autoscaler that keeps what it saw."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen = []

    def desired(self, status):
        self.seen.append(status)
        return {}


def test_an_autoscaler_sees_the_requests_first_tokens_as_they_come():
    reqs = stream(7.0, 1200)
    rec = Recorder()
    res = run("sfs", reqs, Scaling(rec, interval_s=15.0))
    ttft = res.ttft
    checked = 0
    for st in rec.seen:
        for m, recent in st.recent.items():
            got, target = recent.first_tokens_since(st.t - st.interval_s)
            # every first token in the last interval, with its request's TTFT and target
            mi = PAPER.model_names.index(m)
            first = res.first_token
            want = (res.model == mi) & (first > st.t - st.interval_s) & (first <= st.t)
            assert np.sort(got) == pytest.approx(np.sort(ttft[want]))
            assert np.sort(target) == pytest.approx(np.sort(reqs.target[want]))
            checked += want.sum()
        assert sum(st.ready.values()) == 3 and not st.starting
    assert checked > 500


def test_queue_threshold_scales_up_under_a_queue_and_back_down_after_the_window():
    from duetime.autoscale import make_autoscaler

    rng = np.random.default_rng(5)
    # vLLM batches what it can: requests wait only once the batch is full, far above the
    # pool's on-time capacity (~9 q/s); this burst queues them
    hot = make_arrivals("poisson", 30.0).times(3600, rng)       # ~120 s
    calm = hot[-1] + make_arrivals("poisson", 2.0).times(1400, rng)  # then ~700 s calm
    reqs = sample_requests(PAPER, np.concatenate([hot, calm]), rng)
    auto = make_autoscaler("queue-threshold", {"threshold": 5})
    res = run("load-aware", reqs, Scaling(auto, interval_s=15.0, scale_up_delay_s=30.0))
    rec = res.scaling
    ups = [e for e in rec.events if e[2] > 0]
    downs = [e for e in rec.events if e[2] < 0]
    assert ups and ups[0][0] < hot[-1]                       # it scaled up during the burst
    assert downs and min(e[0] for e in downs) >= hot[-1]     # and down only after it
    serving = [sum(n.values()) for _, n in rec.timeline]
    assert max(serving) > 3 and serving[-1] < max(serving)
    with pytest.raises(ValueError, match="threshold"):
        make_autoscaler("queue-threshold", {"threshold": 0})
    with pytest.raises(ValueError, match="no parameter"):
        make_autoscaler("queue-threshold", {"limit": 3})


def ramp(rng, phases):
    """Poisson arrivals through (rate, seconds) phases."""
    times, t0 = [], 0.0
    for rate, secs in phases:
        n = int(rate * secs)
        times.append(t0 + np.sort(rng.uniform(0, secs, n)))
        t0 += secs
    return np.concatenate(times)


def _status(t, ratio, ready, starting=0, model="m"):
    """A status whose model's first tokens in the last minute have P90 TTFT / target =
    ``ratio`` (all equal)."""
    from duetime.autoscale import PoolStatus, Recent

    n = 50
    arrival = np.full(n, t - 10.0)
    first = arrival + ratio * 0.5
    recent = Recent(arrival, first, np.full(n, np.nan), np.full(n, 0.5), np.full(n, 10.0))
    return PoolStatus(t, 15.0, {model: ready}, {model: starting}, {}, {}, {}, {},
                      {model: recent}, (model,))


def test_llm_d_s_law():
    from duetime.autoscale import make_autoscaler

    a = make_autoscaler("llm-d-saturation")
    assert a.saturation(_status(100.0, 0.8, 4), "m") == pytest.approx(0.8)
    assert a.saturation(_status(100.0, 3.0, 4), "m") == 2.0          # clamped
    # s = 0.8 > 0.55 with 4 ready: 4 + ceil(4 (0.8 / 0.55 - 1)) = 6
    assert a.desired(_status(100.0, 0.8, 4))["m"] == 6
    # 2 ready of 4 provisioned: credited, 4 + ceil(4 (0.8 x 0.5 / 0.55 - 1)) = 3; the HPA's
    # scale-down window holds it at 4 while the recommendation that asked for them is in it
    b = make_autoscaler("llm-d-saturation")
    assert b.desired(_status(100.0, 0.8, 2, starting=2))["m"] == 3  # (no history: the law)
    b = make_autoscaler("llm-d-saturation")
    assert b.desired(_status(85.0, 0.8, 4))["m"] == 6
    assert b.desired(_status(100.0, 0.8, 2, starting=2))["m"] == 4
    # in the band: hold; below 0.40: 6 - floor(6 (1 - 0.2 / 0.4)) = 3, one pod per 120 s
    c = make_autoscaler("llm-d-saturation")
    assert c.desired(_status(100.0, 0.5, 6))["m"] == 6
    assert c.desired(_status(400.0, 0.2, 6))["m"] == 5
    # the signal is the mean over 45 s: one hot sample among cool ones
    d = make_autoscaler("llm-d-saturation")
    for t, r in ((100.0, 0.2), (115.0, 0.2), (130.0, 1.4)):
        got = d.desired(_status(t, r, 4))["m"]
    assert got == 4  # mean (0.2 + 0.2 + 1.4) / 3 = 0.6 > 0.55 -> 5, after the 30 s window: 4
    with pytest.raises(ValueError, match="up"):
        make_autoscaler("llm-d-saturation", {"up": 0})


def test_llm_d_saturation_in_the_simulator():
    from duetime.autoscale import make_autoscaler

    rng = np.random.default_rng(7)
    arrivals = ramp(rng, [(4.0, 120), (14.0, 240), (3.0, 300)])
    reqs = sample_requests(PAPER, arrivals, rng)
    auto = make_autoscaler("llm-d-saturation")
    res = run("sfs", reqs, Scaling(auto, interval_s=15.0, scale_up_delay_s=30.0))
    serving = {round(t): sum(n.values()) for t, n in res.scaling.timeline}
    at = lambda t: serving[min(serving, key=lambda s: abs(s - t))]  # noqa: E731
    assert at(350) > at(100)  # more replicas in the busy phase
    assert (res.ttft <= reqs.target).mean() > 0.95


def test_the_throughput_planner_sizes_each_model_from_its_forecast_rate():
    from duetime.autoscale import PoolStatus, make_autoscaler

    a = make_autoscaler("throughput-planner", capacity={"m": 2.0})

    def st(t, routed, starting=0):
        return PoolStatus(t, 30.0, {"m": 1}, {"m": starting}, {}, {"m": routed}, {}, {}, {},
                          ("m",))

    assert a.desired(st(30.0, 150)) == {}            # (180 s between decisions)
    for t in (60.0, 90.0, 120.0, 150.0):
        assert a.desired(st(t, 150)) == {}
    assert a.desired(st(180.0, 150)) == {"m": 3}     # 900 requests / 180 s = 5 q/s -> 3
    b = make_autoscaler("throughput-planner", {"trend": 1, "adjustment_interval_s": 30},
                        capacity={"m": 2.0})
    assert b.desired(st(30.0, 60)) == {"m": 1}       # 2 q/s
    assert b.desired(st(60.0, 120)) == {"m": 3}      # 4 q/s rising by 2: forecast 6
    assert b.desired(st(90.0, 120, starting=2)) == {}  # a scale-up in flight: no decision
    with pytest.raises(ValueError, match="needs each model's capacity"):
        make_autoscaler("throughput-planner")


def test_duetime_s_autoscaler_sizes_ahead_and_adds_on_a_late_forecast():
    from duetime.autoscale import PoolStatus, make_autoscaler

    def st(t, routed, ready=1, starting=0, ratio=None, delay=60.0):
        return PoolStatus(t, 15.0, {"m": ready}, {"m": starting}, {}, {"m": routed}, {}, {},
                          {}, ("m",), {} if ratio is None else {"m": ratio}, delay)

    a = make_autoscaler("duetime", {"utilization": 1.0}, capacity={"m": 2.0})
    assert a.desired(st(15.0, 30)) == {"m": 1}            # 2 q/s: one replica
    for t, n in ((30.0, 45), (45.0, 60)):                 # 3, 4 q/s: rising ...
        a.desired(st(t, n, ratio=0.5))
    # ... 5 q/s: the window's mean is 3.5 q/s (2 replicas), its trend is no noise: sized for
    # when a new replica serves, up to the highest tick seen (5 q/s: 3 replicas)
    assert a.desired(st(60.0, 75, ratio=0.5)) == {"m": 3}
    n = make_autoscaler("duetime", {"utilization": 1.0}, capacity={"m": 1.0})
    for t, k in ((15.0, 30), (30.0, 48), (45.0, 28)):    # ~2.4 q/s, Poisson-like noise
        n.desired(st(t, k, ratio=0.5))
    # no trend in noise: the mean (2.4 q/s: 3 replicas), not the highest tick (3.2: 4)
    assert n.desired(st(60.0, 38, ratio=0.5)) == {"m": 3}
    s = make_autoscaler("duetime", {"utilization": 1.0}, capacity={"m": 2.0})
    for t in (15.0, 30.0, 45.0):                          # 1 q/s, then a step to 5
        s.desired(st(t, 15, ratio=0.5))
    assert s.desired(st(60.0, 75, ratio=0.5)) == {"m": 3}  # the new level at once
    assert s.desired(st(75.0, 75, ready=3, ratio=0.5)) == {"m": 3}  # (older ticks dropped)
    b = make_autoscaler("duetime", capacity={"m": 100.0})
    assert b.desired(st(15.0, 15, ready=2, ratio=1.3)) == {"m": 3}   # late: one more
    assert b.desired(st(30.0, 15, ready=2, starting=1, ratio=1.3)) == {"m": 3}  # (one coming)
    c = make_autoscaler("duetime", {"hold_s": 60}, capacity={"m": 10.0})
    assert c.desired(st(15.0, 15, ready=3)) == {"m": 3}    # low demand: hold ...
    assert c.desired(st(60.0, 15, ready=3)) == {"m": 3}
    assert c.desired(st(80.0, 15, ready=3)) == {"m": 2}    # ... 60 s, then one at a time


def test_a_replica_s_capacity_is_measured_on_the_requests_the_router_sends_it():
    from duetime.experiments.capacity import on_time_alone, replica_capacity, routed

    cap = replica_capacity(PAPER, "sfs", requests=800, steps=6)
    assert cap == replica_capacity(PAPER, "sfs", requests=800, steps=6)  # deterministic
    mine = routed(PAPER, "sfs", 6.0, 800)
    assert set(cap) == set(mine) and all(c > 0 for c in cap.values())
    for m, c in cap.items():
        if c > 0.05:
            assert on_time_alone(PAPER, m, mine[m], c, 800) >= 0.95
            assert on_time_alone(PAPER, m, mine[m], 2 * c, 800) < 0.95


def test_duetime_s_autoscaler_follows_the_planner_s_table():
    from duetime.autoscale import PoolStatus, make_autoscaler

    table = [(4.0, {"a": 1, "b": 1}), (8.0, {"a": 2, "b": 1}), (16.0, {"a": 3, "b": 2})]

    def st(t, a, b):
        return PoolStatus(t, 10.0, {"a": 1, "b": 1}, {}, {}, {"a": a, "b": b}, {}, {}, {},
                          ("a", "b"))

    def fresh():
        return make_autoscaler("duetime", {"utilization": 1.0, "window": 1}, table=table)

    assert fresh().desired(st(10.0, 30, 20)) == {"a": 2, "b": 1}    # 5 q/s: the 8 q/s row
    assert fresh().desired(st(10.0, 60, 30)) == {"a": 3, "b": 2}    # 9 q/s: the 16 q/s row
    assert fresh().desired(st(10.0, 300, 30)) == {"a": 3, "b": 2}   # beyond: the last row
    assert fresh().desired(st(10.0, 20, 10)) == {"a": 1, "b": 1}    # 3 q/s: the first
    with pytest.raises(ValueError, match="rise"):
        make_autoscaler("duetime", table=table[::-1])
