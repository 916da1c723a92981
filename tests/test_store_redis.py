"""The shared store of gateway replicas, against a real Redis: flights published by one replica
reach another's listeners (dispatch, first token, progress, end), a dead replica's flights
expire, rate limits hold across replicas, and Redis going away degrades to local state and
resyncs when it returns."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from duetime.gateway.backends.redis_connection import RedisConnection
from duetime.gateway.backends.redis_flights import RedisFlightStore
from duetime.gateway.backends.redis_limits import RedisLimitStore
from duetime.gateway.intake.ratelimit import Draw
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import Flight
from redis_server import RedisServer


class Recorder:
    """A PeerListener that writes down what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.ejected: str | None = None

    def on_peer_dispatch(self, f: Flight, now: float) -> None:
        self.events.append(("dispatch", f.id))

    def on_peer_first_token(self, f: Flight, now: float) -> None:
        self.events.append(("first", f.id))

    def on_peer_end(self, f: Flight, now: float) -> None:
        self.events.append(("end", f.id))

    def on_peer_eject(self, by: str) -> None:
        self.ejected = by

    def on_peer_readmit(self) -> None:
        self.ejected = None


def store(url: str, replica: str, **kw: Any) -> RedisFlightStore:
    return RedisFlightStore(RedisConnection(url, prefix="t"), replica=replica, **kw)


async def until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_one_replicas_flights_reach_the_others_listener(redis_server: RedisServer):
    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        rec = Recorder()
        b.listen("x", rec)
        b.conn.metrics = GatewayMetrics()
        now = time.monotonic()
        f = Flight("r1-0", 120, 30, now - 0.5, 0.2, hashes=[7, -8])
        a.add("x", f)
        await a.sync()
        await b.sync()
        (mirrored,) = b.remote("x").values()
        assert mirrored.id == "a/r1-0" and mirrored.prompt_tokens == 120
        assert mirrored.predicted == 30 and mirrored.hashes == [7, -8]
        assert mirrored.dispatched == pytest.approx(f.dispatched, abs=0.01)
        assert rec.events == [("dispatch", "a/r1-0")] and b.peers() == ["a"]
        assert b.remote("y") == {} and a.remote("x") == {}  # (a's own are not mirrored)
        # (its age when b first saw it: at least the half second since its dispatch)
        assert b.conn.metrics.registry.get_sample_value("duetime_store_staleness_seconds_sum") >= 0.5
        f.first_token, f.tokens = now, 1
        a.update("x", f)
        await a.sync()
        await b.sync()
        assert rec.events[-1] == ("first", "a/r1-0")
        f.tokens = 9
        a.update("x", f)
        await a.sync()
        await b.sync()
        assert mirrored.tokens == 9 and len(rec.events) == 2  # (progress: no event)
        a.remove("x", "r1-0", time.monotonic())
        await a.sync()
        await b.sync()
        assert rec.events[-1] == ("end", "a/r1-0") and b.remote("x") == {}
        for s in (a, b):
            await s.close()
    asyncio.run(go())


def test_a_flights_adapter_reaches_the_other_replicas(redis_server: RedisServer):
    """A flight on a LoRA adapter is mirrored with it (the other replicas' shadows run it on
    the adapter); a base-model flight is packed as before adapters (six fields)."""
    from duetime.gateway.backends.redis_flights import _pack

    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        now = time.monotonic()
        a.add("x", Flight("r1-0", 50, 10, now, None, lora=123456))
        a.add("x", Flight("r2-0", 50, 10, now, None))
        await a.sync()
        await b.sync()
        got = {f.id: f.lora for f in b.remote("x").values()}
        assert got == {"a/r1-0": 123456, "a/r2-0": 0}
        for s in (a, b):
            await s.close()
    asyncio.run(go())
    assert len(json.loads(_pack(Flight("r", 5, 1, 0.0, None), 0.0))) == 6


def test_nothing_changed_reads_nothing_and_a_closed_replica_is_forgotten_at_once(
        redis_server: RedisServer):
    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        rec = Recorder()
        b.listen("x", rec)
        a.add("x", Flight("r1", 10, 5, time.monotonic(), None))
        await a.sync()
        await b.sync()
        await b.sync()  # (a's version did not move: nothing read, nothing told)
        assert rec.events == [("dispatch", "a/r1")]
        await a.close()  # (its flights rewritten as none; it leaves the set of replicas)
        await b.sync()
        assert rec.events[-1] == ("end", "a/r1")
        await asyncio.sleep(b.sync_s)  # (the set of replicas is read at b's heartbeat)
        await b.sync()
        assert b.peers() == []
        await b.close()
    asyncio.run(go())


def test_a_silent_replicas_flights_expire_after_the_ttl(redis_server: RedisServer):
    async def go() -> None:
        a = store(redis_server.url, "a", ttl_s=0.3)
        b = store(redis_server.url, "b", ttl_s=0.3)
        rec = Recorder()
        b.listen("x", rec)
        a.add("x", Flight("r1", 10, 5, time.monotonic(), None))
        t0 = time.monotonic()  # (a's last heartbeat is stamped after this)
        await a.sync()  # ...and a syncs no more (a crashed replica)
        await b.sync()
        assert b.remote("x")

        async def gone() -> bool:
            await b.sync()
            return not b.remote("x")
        while not await gone():
            assert time.monotonic() - t0 < 20.0, "a's flights never expired"
            await asyncio.sleep(0.05)
        assert time.monotonic() - t0 >= 0.25  # (not before its TTL, 0.3 s)
        assert rec.events[-1] == ("end", "a/r1")
        await b.close()
        await a.close()
    asyncio.run(go())


def test_redis_away_drops_the_mirror_and_a_restart_resyncs(redis_server: RedisServer):
    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        ma, mb = GatewayMetrics(), GatewayMetrics()
        rec = Recorder()
        b.listen("x", rec)
        a.add("x", Flight("r1", 10, 5, time.monotonic(), None))
        await a.start(ma)
        await b.start(mb)
        await until(lambda: b.remote("x"), "b to see a's flight")
        assert mb.registry.get_sample_value("duetime_store_up") == 1
        redis_server.stop()
        await until(lambda: b.conn.up is False and not b.remote("x"), "b to drop the mirror")
        assert rec.events[-1] == ("end", "a/r1")
        assert mb.registry.get_sample_value("duetime_store_errors_total", {"op": "sync"}) >= 1
        assert mb.registry.get_sample_value("duetime_store_up") == 0
        a.add("x", Flight("r2", 10, 5, time.monotonic(), None))  # (while Redis is away)
        redis_server.start()  # (empty: a's whole state must be written again)
        await until(lambda: len(b.remote("x")) == 2, "b to see both of a's flights again")
        assert b.conn.up and a.conn.up
        await a.close()
        await b.close()
    asyncio.run(go())


def test_a_slow_redis_degrades_without_blocking_the_replica(redis_server: RedisServer):
    async def go() -> None:
        conn = RedisConnection(redis_server.url, prefix="t", timeout_s=0.2)
        a = RedisFlightStore(conn, replica="a")
        limits = RedisLimitStore(conn, timeout_s=0.05)
        await a.start(GatewayMetrics())
        await until(lambda: a.conn.up is True, "the first sync")
        redis_server.pause()
        try:
            t0 = time.monotonic()
            ok, _ = await limits.acquire([Draw("k:requests", 60, 1)], 0.0)
            assert ok and time.monotonic() - t0 < 5.0  # (bounded by the timeout, not Redis)
            await until(lambda: a.conn.up is False, "the sync to give up on Redis")
            t0 = time.monotonic()
            for _ in range(100):  # (Redis known away: this replica's buckets, no waiting)
                await limits.acquire([Draw("k:requests", 6000, 1)], 0.0)
            assert time.monotonic() - t0 < 1.0
        finally:
            redis_server.resume()
        await until(lambda: a.conn.up is True, "the sync to find Redis back")
        await a.close()
    asyncio.run(go())


def test_rate_limits_hold_across_replicas(redis_server: RedisServer):
    async def go() -> None:
        one = RedisLimitStore(RedisConnection(redis_server.url, prefix="t"))
        two = RedisLimitStore(RedisConnection(redis_server.url, prefix="t"))
        req = [Draw("alice:requests", 3, 1)]
        outcomes = [(await s.acquire(req, 0.0))[0] for s in (one, two, one, two)]
        assert outcomes == [True, True, True, False]
        ok, (level,) = await two.acquire(req, 0.0)
        assert not ok and 19.0 < level.wait_s <= 20.0  # (3 a minute: one per 20 s)
        assert level.remaining < 1.0
        # all draws or none: the tokens fit, the requests do not: no tokens are taken
        both = [Draw("bob:requests", 1, 1), Draw("bob:tokens", 100, 60)]
        assert (await one.acquire(both, 0.0))[0]
        ok, levels = await two.acquire(both, 0.0)
        assert not ok and levels[1].remaining == pytest.approx(40.0, abs=0.1)
        # output tokens charged in the background, into debt
        two.charge(Draw("carol:tokens", 100, 150), 0.0)
        await until(lambda: two.pending == 0, "the charge")
        ok, (level,) = await one.acquire([Draw("carol:tokens", 100, 1)], 0.0)
        assert not ok and level.remaining < -49.0
        for s in (one, two):
            await s.conn.close()
    asyncio.run(go())


def test_an_ejection_holds_on_every_replica_until_its_replica_readmits(redis_server):
    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        ra, rb = Recorder(), Recorder()
        a.listen("x", ra)
        b.listen("x", rb)
        a.eject("x", True)
        await a.sync()
        await b.sync()
        assert rb.ejected == "a" and ra.ejected is None  # (a's own: not told back to a)
        a.eject("x", False)
        await a.sync()
        await b.sync()
        assert rb.ejected is None
        for s in (a, b):
            await s.close()
    asyncio.run(go())


def test_session_bindings_reach_the_other_replicas(redis_server):
    async def go() -> None:
        a, b = store(redis_server.url, "a"), store(redis_server.url, "b")
        await a.sync()
        await b.sync()  # (b knows a: bindings made from now on reach it)
        a.bindings["session-1"] = "x"
        await a.sync()
        await b.sync()
        assert b.bindings.get("session-1") == "x" and dict(b.bindings) == {"session-1": "x"}
        b.bindings["session-1"] = "y"  # (rebound on b: a follows)
        await b.sync()
        await a.sync()
        assert a.bindings["session-1"] == "y"
        for s in (a, b):
            await s.close()
    asyncio.run(go())
