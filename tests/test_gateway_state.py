"""Per-instance live state in the gateway, without a network: reads change nothing, time moves
only on refresh and on recorded events, the in-flight ledger sits behind a store."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from attempts import dispatch, end, first_token, progress
from duetime.engine import ResidentRequest, SchedulerConfig, Sfs6, Snapshot
from duetime.engine.forecasting import Forecaster, ForecastError
from duetime.engine.snapshot import RequestTable
from duetime.estimate.sfs import SfsEstimator
from duetime.gateway import pool_from_dict
from duetime.gateway.backends.memory import ENDED_MEMORY_S, MemoryStore
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.ledger import Ledger
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome


def _state(**state) -> InstanceState:
    pool = pool_from_dict({"state": state, "instances": [
        {"name": "a", "model": "qwen3-8b", "url": "http://127.0.0.1:9", "profile": "qwen3-8b"}]})
    return InstanceState(pool.instances[0], pool, GatewayMetrics(), MemoryStore(),
                         time.monotonic())


def test_reads_have_no_side_effects_and_refresh_moves_time():
    s = _state()
    t = time.monotonic()
    dispatch(s, "x", 20000, 50, t, None)
    dispatch(s, "y", 100, 50, t, None)
    eng = s.shadow.engine
    rev = eng.revision
    for _ in range(3):  # every read of the InstanceView, twice over
        snap = s.snapshot()
        _ = (s.num_running, s.num_waiting, s.kv_usage, s.stats, s.request_overhead_s,
             s.source(), s.source(load=True), s.describe())
        assert eng.revision == rev and s.snapshot() is snap
    assert len(snap.waiting_table) == 2 and snap.time == pytest.approx(t)
    time.sleep(0.02)
    s.refresh(time.monotonic())
    assert eng.revision != rev  # the replica stepped to now
    later = s.snapshot()
    assert later is not snap and later.time > snap.time
    assert len(later.running_table) >= 1


def test_events_flow_to_the_replica_and_the_ledger():
    s = _state(sync_interval_s=0.0)
    t0 = time.monotonic()
    a = dispatch(s, "x", 100, 20, t0, 0.01)
    f = a.flight
    assert s.flights == {"x": f} and f.shadowed
    first_token(a, t0 + 0.05)
    progress(a, 5)
    s.refresh(t0 + 0.05)
    r = s.shadow.engine.request("x")
    assert (r["output_tokens"], r["computed_tokens"]) == (5, 104)  # corrected by the stream
    assert end(a, t0 + 0.1, output_tokens=5)
    assert not s.flights and "x" in s.ledger.ended and s.shadow.idle
    st = s.stats
    assert (st.arrivals, st.ttft_count, st.output_tokens_sum) == (1, 1, 5)
    assert st.mean_ttft == pytest.approx(0.05)
    assert not end(a, t0 + 0.2)  # twice: nothing happens
    assert s.stats.e2e_count == 1


def test_memory_store_remembers_recent_ends_for_a_while():
    store = MemoryStore()
    led = Ledger("a", store)
    lifecycle = Lifecycle([led])
    for k in range(100):
        f = Flight(f"r{k}", 10, 5, float(k), None)
        a = lifecycle.dispatch(Attempt(f, _NoParts(), 1, float(k), 1.0, "test", "shadow"))
        lifecycle.end(a, float(k), Outcome.OK, output_tokens=5)
    ended = store.ended("a")
    assert "r99" in ended and "r0" not in ended
    assert len(ended) <= 65  # bounded: the oldest, older than ENDED_MEMORY_S, are forgotten
    assert all(f"r{k}" in ended for k in range(99 - int(ENDED_MEMORY_S), 100))
    assert store.flights("a") == {} and store.remove("a", "r5", 200.0) is None


class _NoParts:
    """An instance with no parts of its own (the ledger is pool-wide here)."""

    subscribers = ()


def test_a_published_snapshot_is_merged_with_what_the_gateway_did_since():
    s = _state()
    cfg, model = SchedulerConfig(), Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0, css=0.0)
    now = time.monotonic()
    f_done = dispatch(s, "old", 10, 5, now, None)
    f_new = dispatch(s, "new", 30, 5, now, None)
    end(f_done, now)
    pub = Snapshot(cfg, model, time=100.0, running=[ResidentRequest("old", 10, 9, 1, 5)],
                   waiting=[ResidentRequest("other", 40, 0, 0, 5)])
    s.published.set(pub, instance_clock=100.0, sent=now, received=now)
    assert s.source() == "published"
    merged = s.snapshot()
    assert [r.id for r in merged.running] == []  # "old" finished since
    assert [r.id for r in merged.waiting] == ["other", "new"]  # "new" not seen there yet
    assert merged.time >= now
    first_token(f_new, time.monotonic())
    assert [r.id for r in s.snapshot().running] == ["new"]
    assert _state(source="shadow").source() == "shadow"


def _published_table(rng: random.Random, n: int, running: bool) -> tuple[list[str], RequestTable]:
    ids = [f"p{rng.getrandbits(24)}" for _ in range(n)]
    prompt = [rng.randint(1, 3000) for _ in range(n)]
    out = [rng.randint(1, 300) if running else 0 for _ in range(n)]
    computed = [p + o - rng.randint(0, 1) if running else 0
                for p, o in zip(prompt, out, strict=True)]
    return ids, RequestTable(ids, prompt, computed, out, [rng.randint(1, 500) for _ in range(n)])


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_forecasts_from_a_published_snapshot_equal_its_merged_snapshots(seed, asynchronous):
    """The forecaster the instance keeps over its published snapshot and its ledger answers as
    a fresh one of the merged snapshot, through random publications, dispatches (some of
    requests the snapshot holds), first tokens and ends; dated now, not the millisecond
    before."""
    rng = random.Random(seed)
    s = _state(max_age_s=3600.0)  # (fresh however slowly the test runs)
    cfg = dataclasses.replace(s.instance.config, async_scheduling=asynchronous,
                              num_gpu_blocks=20_000)
    model = s.instance.spec.batch_time
    t0 = time.monotonic()
    ids: list[str] = []
    live: dict[str, Attempt] = {}

    used: set[str] = set()
    pub_time = 0.0

    def publish(now: float) -> None:
        nonlocal ids, pub_time
        ids_r, run = _published_table(rng, rng.randint(0, 40), running=True)
        ids_w, wait = _published_table(rng, rng.randint(0, 12), running=False)
        ids = ids_r + ids_w
        lag = rng.uniform(0.0, 0.03)  # (the snapshot was taken that long before it came)
        s.published.set(Snapshot(cfg, model, time=50.0, running=run, waiting=wait),
                        instance_clock=50.0 + lag, sent=now, received=now)
        pub_time = now - lag

    publish(t0)
    checked = 0
    for k in range(600):
        now = t0 + 1e-4 * k
        op = rng.random()
        if op < 0.04:
            publish(now)
        elif op < 0.4:
            fid = rng.choice(ids) if ids and rng.random() < 0.3 else f"x{k}"
            if fid not in used:  # (an id is dispatched once: the shadow replica keeps ids)
                used.add(fid)
                live[fid] = dispatch(s, fid, rng.randint(1, 3000), rng.randint(1, 300), now,
                                     None)
        elif op < 0.55 and live:
            a = live[rng.choice(sorted(live))]
            if a.flight.first_token is None:
                first_token(a, now)
                progress(a, rng.randint(1, 5))
        elif op < 0.7 and live:
            end(live.pop(rng.choice(sorted(live))), now)
        assert s.source() == "published"
        fc = s.forecaster()
        fresh = Forecaster(s.published.merged(now, s.ledger).at(max(pub_time, now)))
        assert pub_time - 1e-9 <= fc.time <= max(pub_time, time.monotonic()) + 1e-9
        fc = s.published.forecaster(now, s.ledger)
        assert fc.time == fresh.time and fc.streams == fresh.streams
        for p in (rng.randint(1, 200), rng.randint(200, 6000)):
            assert fc.ttft(p).estimate_s == fresh.ttft(p).estimate_s, (k, p)
            checked += 1
    assert checked == 1200


def test_a_published_snapshot_holding_more_blocks_than_the_instance_forecasts_nothing():
    """A published state whose running requests hold more KV blocks than the instance has is
    refused at every probe, as a snapshot's replay refuses it (the router's estimator then
    reads it as unservable), and the next publication is served again."""
    s = _state(max_age_s=3600.0)
    cfg = dataclasses.replace(s.instance.config, num_gpu_blocks=101)
    model = s.instance.spec.batch_time
    now = time.monotonic()
    over = Snapshot(cfg, model, time=1.0, running=[ResidentRequest("big", 3000, 3000, 1, 5)])
    s.published.set(over, instance_clock=1.0, sent=now, received=now)
    with pytest.raises(ForecastError):
        Forecaster(s.published.merged(now, s.ledger))
    for _ in range(2):
        with pytest.raises(ForecastError, match="more KV blocks"):
            s.forecaster().ttft(10)
    assert SfsEstimator().ttft(s, 10, now) == float("inf")
    ok = Snapshot(cfg, model, time=2.0, running=[ResidentRequest("small", 30, 30, 1, 5)])
    s.published.set(ok, instance_clock=2.0, sent=now, received=now)
    assert s.forecaster().ttft(10).estimate_s == Forecaster(
        s.published.merged(now, s.ledger)).ttft(10).estimate_s
