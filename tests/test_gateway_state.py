"""Per-instance live state in the gateway, without a network: reads change nothing, time moves
only on refresh and on recorded events, the in-flight ledger sits behind a store."""

from __future__ import annotations

import time

import pytest

from duetime.engine import ResidentRequest, SchedulerConfig, Sfs6, Snapshot
from duetime.gateway import InstanceState, MemoryStore, pool_from_dict
from duetime.gateway.inflight import DONE_MEMORY_S, Flight, InFlight
from duetime.gateway.metrics import GatewayMetrics


def _state(**state) -> InstanceState:
    pool = pool_from_dict({"state": state, "instances": [
        {"name": "a", "model": "qwen3-8b", "url": "http://127.0.0.1:9", "profile": "qwen3-8b"}]})
    return InstanceState(pool.instances[0], pool, GatewayMetrics(), MemoryStore(),
                         time.monotonic())


def test_reads_have_no_side_effects_and_refresh_moves_time():
    s = _state()
    t = time.monotonic()
    s.dispatch("x", 20000, 50, t, None)
    s.dispatch("y", 100, 50, t, None)
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
    f = s.dispatch("x", 100, 20, t0, 0.01)
    assert s.flights == {"x": f} and f.shadowed
    s.first_token(f, t0 + 0.05)
    s.progress(f, 5)
    s.refresh(t0 + 0.05)
    r = s.shadow.engine.request("x")
    assert (r["output_tokens"], r["computed_tokens"]) == (5, 104)  # corrected by the stream
    s.complete(f, t0 + 0.1, output_tokens=5)
    assert not s.flights and "x" in s.inflight.done and s.shadow.idle
    st = s.stats
    assert (st.arrivals, st.ttft_count, st.output_tokens_sum) == (1, 1, 5)
    assert st.mean_ttft == pytest.approx(0.05)
    s.complete(f, t0 + 0.2)  # twice: nothing happens
    assert s.stats.e2e_count == 1


def test_memory_store_remembers_recent_completions_for_a_while():
    store = MemoryStore()
    led = InFlight("a", store)
    for k in range(100):
        f = Flight(f"r{k}", 10, 5, float(k), None)
        led.dispatch(f)
        led.complete(f, float(k), 5)
    done = store.done("a")
    assert "r99" in done and "r0" not in done
    assert len(done) <= 65  # bounded: the oldest, older than DONE_MEMORY_S, are forgotten
    assert all(f"r{k}" in done for k in range(99 - int(DONE_MEMORY_S), 100))
    assert store.flights("a") == {} and store.remove("a", "r5", 200.0) is None


def test_a_published_snapshot_is_merged_with_what_the_gateway_did_since():
    s = _state()
    cfg, model = SchedulerConfig(), Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0, css=0.0)
    now = time.monotonic()
    f_done = s.dispatch("old", 10, 5, now, None)
    f_new = s.dispatch("new", 30, 5, now, None)
    s.complete(f_done, now)
    pub = Snapshot(cfg, model, time=100.0, running=[ResidentRequest("old", 10, 9, 1, 5)],
                   waiting=[ResidentRequest("other", 40, 0, 0, 5)])
    s.published.set(pub, instance_clock=100.0, sent=now, received=now)
    assert s.source() == "published"
    merged = s.snapshot()
    assert [r.id for r in merged.running] == []  # "old" finished since
    assert [r.id for r in merged.waiting] == ["other", "new"]  # "new" not seen there yet
    assert merged.time >= now
    s.first_token(f_new, time.monotonic())
    assert [r.id for r in s.snapshot().running] == ["new"]
    assert _state(source="shadow").source() == "shadow"
