"""The simulator's model of the gateway's admission queue (duetime.sim.admission)."""

from __future__ import annotations

from duetime.sim.admission import SimAdmission


def test_release_follows_the_shared_order() -> None:
    q = SimAdmission(max_queued=10)
    q.served("heavy", 5_000, now=0.0)
    for i in range(3):
        assert q.offer(i, "heavy", "critical", deadline_abs=1.0 + i, give_up_at=5.0, now=0.0)
    assert q.offer(3, "light", "critical", deadline_abs=9.0, give_up_at=5.0, now=0.1)
    assert q.offer(4, "light", "standard", deadline_abs=0.5, give_up_at=5.0, now=0.1)
    assert len(q) == 5
    assert q.release(now=0.5) == [3]  # the light key first, earlier waiters notwithstanding
    assert q.release(now=0.6, n=3) == [0, 1, 2]
    assert q.release(now=0.7, n=5) == [4]  # (the lower band last)
    assert q.release(now=0.8) == [] and len(q) == 0
    assert [(w.i, w.key, round(w.seconds, 6), w.how) for w in q.waits] == [
        (3, "light", 0.4, "released"), (0, "heavy", 0.6, "released"),
        (1, "heavy", 0.6, "released"), (2, "heavy", 0.6, "released"),
        (4, "light", 0.6, "released")]


def test_waiters_expire_at_their_give_up_time() -> None:
    q = SimAdmission(max_queued=10)
    assert q.offer(0, "a", "critical", 2.0, give_up_at=2.0, now=0.0)
    assert q.offer(1, "a", "critical", 1.0, give_up_at=1.0, now=0.0)
    assert q.offer(2, "b", "critical", 3.0, give_up_at=3.0, now=0.0)
    assert not q.offer(3, "b", "critical", 3.0, give_up_at=0.0, now=0.0)  # (nothing left)
    assert q.next_give_up() == 1.0
    assert q.expired(0.5) == []
    assert q.expired(2.0) == [1, 0]
    assert q.release(2.5) == [2]
    assert q.expired(10.0) == [] and q.next_give_up() is None
    assert {(w.i, w.how) for w in q.waits} == {(1, "expired"), (0, "expired"), (2, "released")}


def test_a_released_request_offered_again_keeps_its_new_give_up_time() -> None:
    q = SimAdmission(max_queued=10)
    assert q.offer(7, "a", "critical", 1.0, give_up_at=1.0, now=0.0)
    assert q.release(0.2) == [7]
    assert q.offer(7, "a", "critical", 1.0, give_up_at=5.0, now=0.2)
    assert q.expired(1.5) == []  # (the first wait's give-up time is stale)
    assert q.next_give_up() == 5.0
    assert q.expired(5.0) == [7]


def test_a_full_queue_turns_away_or_displaces_a_more_served_keys_waiter() -> None:
    q = SimAdmission(max_queued=2)
    q.served("heavy", 10_000, now=0.0)
    assert q.offer(0, "heavy", "critical", 1.0, give_up_at=9.0, now=0.0)
    assert q.offer(1, "heavy", "critical", 2.0, give_up_at=9.0, now=0.0)
    assert not q.offer(2, "heavy", "critical", 0.5, give_up_at=9.0, now=0.1)  # full
    assert q.offer(3, "light", "critical", 3.0, give_up_at=9.0, now=0.2)  # displaces 1
    assert len(q) == 2
    assert q.expired(0.2) == [1]  # (to the best forecast at once)
    assert q.release(0.3, n=2) == [3, 0]
    assert [(w.i, w.how) for w in q.waits] == [(1, "displaced"), (3, "released"),
                                               (0, "released")]
    assert not SimAdmission(max_queued=0).offer(0, "a", "critical", 1.0, 2.0, now=0.0)


def _stream(rate: float, n: int, seed: int = 0):
    from dataclasses import replace

    import numpy as np

    from duetime.workload import load_workload, sample_requests

    prof = load_workload("demo")
    rng = np.random.default_rng(seed)
    reqs = sample_requests(prof, np.cumsum(rng.exponential(1 / rate, n)), rng)
    # tenant 1 sends one request in eleven (a light key), tenant 0 the rest
    return prof, replace(reqs, tenant=(rng.random(n) < 1 / 11).astype(np.int64))


def test_the_cluster_simulator_routes_through_the_queue() -> None:
    """``ClusterSim(admission=...)``: unloaded, nothing queues and every request is served as
    without the queue (the step-by-step loop takes the same steps); saturated, requests whose
    forecast misses wait (never past their target), every one is served, and the light tenant
    waits less than the heavy one (least attained service first)."""
    import numpy as np
    import pytest

    from duetime.metrics import summarize
    from duetime.policy import make_policy
    from duetime.sim import ClusterSim

    def run(prof, reqs, adm):
        return ClusterSim(prof, make_policy("sfs", defaults={"lambda": prof.lam}),
                          admission=adm).run(reqs)

    from dataclasses import replace

    prof, calm = _stream(4.0, 300)
    calm = replace(calm, target=np.full(len(calm), 10.0))  # (a target every forecast meets)
    plain, queued = run(prof, calm, None), run(prof, calm, SimAdmission(256))
    assert summarize(queued)["queued"] == 0
    assert np.array_equal(plain.first_token, queued.first_token)
    assert np.array_equal(plain.finish, queued.finish)

    prof, busy = _stream(20.0, 1200)
    res = run(prof, busy, SimAdmission(256))
    assert summarize(res)["queued"] > 0.1 and np.isfinite(res.finish).all()
    assert (res.queue_s <= busy.target + 1e-9).all()
    light, heavy = busy.tenant == 1, busy.tenant == 0
    assert np.percentile(res.queue_s[light], 90) < np.percentile(res.queue_s[heavy], 90)
    with pytest.raises(ValueError, match="admission: open loop only"):
        ClusterSim(prof, make_policy("sfs"), admission=SimAdmission(4)).run(busy,
                                                                              closed_loop=2)
