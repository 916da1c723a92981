"""The gateway's precise view of an instance's prefix cache: vLLM's KV events (here from a
fake publisher that speaks vLLM's wire, ``test_kv_events.FakePublisher``) correct the
instance's shadow replica; the e2e suite does the same against a real vLLM."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from duetime.engine import Engine, Paper4, SchedulerConfig
from duetime.gateway.config import KvEventsSpec
from duetime.gateway.state.event_cache import EventCache
from duetime.web.prefix_keys import token_block_keys
from test_kv_events import AllBlocksCleared, FakePublisher, encode, h, stored, wait_for

BS = 16
CFG = SchedulerConfig(max_model_len=4096, num_gpu_blocks=400, block_size=BS,
                      enable_prefix_caching=True)
MODEL = Paper4(b0=2e-3, b1=2e-5, b2=0.0, b3=0.0)


@pytest.fixture
def publisher():
    ctx = zmq.Context()
    pub = FakePublisher(ctx, topic="")
    yield pub
    pub.close()
    ctx.term()


def _live(pub: FakePublisher, ev: EventCache) -> None:
    """Probe until the subscription hears the publisher (ZMQ's slow joiner)."""
    deadline = time.monotonic() + 5
    while not ev.live:
        assert time.monotonic() < deadline, "the subscription never heard the publisher"
        pub.publish(encode([]))
        time.sleep(0.01)


def _store(pub: FakePublisher, tokens: list[int], first: int, parent=None) -> list:
    """Publish the full blocks of ``tokens`` as stored (engine hashes h(first), ...)."""
    n = len(tokens) // BS
    hashes = [h(first + i) for i in range(n)]
    pub.publish(encode([stored(hashes, parent, tokens[:n * BS], block_size=BS)]))
    return hashes


def test_events_correct_the_replica_and_unconfirmed_predictions_expire(publisher) -> None:
    ev = EventCache("i", KvEventsSpec(endpoint=publisher.endpoint, topic="", expire_s=1.0))
    ev.start()
    try:
        _live(publisher, ev)
        eng = Engine(CFG, MODEL)
        prompt = list(range(1000, 1200))  # 12 full blocks
        keys = token_block_keys(prompt, BS)
        seen = ev.subscriber.batches
        hashes = _store(publisher, prompt, 0)
        wait_for(lambda: ev.subscriber.batches > seen)
        ev.apply(eng, now=0.0)
        assert eng.cached_prefix(keys) == 12  # another client's prompt, told by its events
        publisher.publish(encode([stored([], None, [])]))  # (an empty store: nothing)
        seen = ev.subscriber.batches
        from duetime.gateway.state.kv_events import BlockRemoved
        publisher.publish(encode([BlockRemoved(tuple(hashes[6:]), "GPU")]))
        wait_for(lambda: ev.subscriber.batches > seen)
        ev.apply(eng, now=0.0)
        assert eng.cached_prefix(keys) == 6  # evicted at the instance: gone here too
        # a prediction (the replica cached a routed request's blocks) that no event confirms
        mine = token_block_keys(list(range(5000, 5100)), BS)
        eng.cache_store(mine)
        ev.predicted(mine, now=10.0)
        ev.apply(eng, now=10.9)
        assert eng.cached_prefix(mine) == len(mine)  # within expire_s: it stands
        ev.apply(eng, now=11.1)
        assert eng.cached_prefix(mine) == 0 and ev.expired == len(mine)
        # confirmed ones stay
        seen = ev.subscriber.batches
        _store(publisher, list(range(5000, 5100)), 100)
        wait_for(lambda: ev.subscriber.batches > seen)
        ev.predicted(mine, now=20.0)
        ev.apply(eng, now=30.0)
        assert eng.cached_prefix(mine) == len(mine)
        # the instance's cache reset: the replica's too
        seen = ev.subscriber.batches
        publisher.publish(encode([AllBlocksCleared()]))
        wait_for(lambda: ev.subscriber.batches > seen)
        ev.apply(eng, now=30.0)
        assert eng.cached_blocks == 0
        eng.check_invariants()
        # events not live (the publisher is gone): predictions stand, the estimate rules
        publisher.close_pub()
        wait_for(lambda: not ev.live)
        eng.cache_store(mine)
        ev.predicted(mine, now=40.0)
        ev.apply(eng, now=99.0)
        assert eng.cached_prefix(mine) == len(mine)
    finally:
        ev.close()


def test_the_gateway_prices_hits_its_events_report(publisher) -> None:
    """A prompt another client left cached (reported by events only) is forecast with its
    hits and its cached tokens are told in ``x-duetime-cached-tokens``; an eviction the events
    report counts too; with the events gone, requests still succeed (estimated view)."""
    from duetime.emulator import Emulator, create_app
    from duetime.web.server import AppServer
    from test_gateway import PRICE, gateway, run

    prompt = list(range(1000, 1200))  # 200 tokens: 12 full blocks of 16
    other = list(range(3000, 3200))

    async def go():
        emu = Emulator(MODEL, CFG, model_name="m", enable_prefix_caching=True)
        upstream = await AppServer(create_app(emu)).start()
        cfg = {"policy": "sfs",
               "quality": {"workload": None, "tasks": {"chat": {"m": 0.5}}},
               "instances": [{"name": "u", "model": "m", "url": upstream.url,
                              "batch_time": {"model": "paper4", "coefficients": {
                                  "b0": 2e-3, "b1": 2e-5, "b2": 0.0, "b3": 0.0}},
                              "config": CFG.to_dict(), "price_usd_per_mtok": PRICE,
                              "kv_events": {"endpoint": publisher.endpoint, "topic": ""}}],
               "health": {"interval_s": 0.2}}
        try:
            async with gateway(cfg) as (svc, c):
                inst = svc.gateway.instances[0]
                _live(publisher, inst.events)

                async def ask(tokens: list[int]) -> httpx.Response:
                    r = await c.post("/v1/completions", json={"model": "m", "prompt": tokens,
                                                              "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    return r

                seen = inst.events.subscriber.batches
                hashes = _store(publisher, prompt, 0)
                wait_for(lambda: inst.events.subscriber.batches > seen)
                warm = await ask(prompt)
                cold = await ask(other)
                source = inst.cache_source
                from duetime.gateway.state.kv_events import BlockRemoved
                seen = inst.events.subscriber.batches
                publisher.publish(encode([BlockRemoved(tuple(hashes[6:]), "GPU")]))
                wait_for(lambda: inst.events.subscriber.batches > seen)
                half = await ask(prompt)
                publisher.close_pub()
                wait_for(lambda: not inst.events.live)
                after = await ask(prompt)
                described = (await c.get("/duetime/instances")).json()
                return warm, cold, source, half, after, inst.cache_source, described
        finally:
            await upstream.stop()

    warm, cold, source, half, after, source_after, described = run(go())
    assert source == "kv-events" and source_after == "estimated"
    assert warm.headers["x-duetime-cached-tokens"] == "192"
    assert cold.headers["x-duetime-cached-tokens"] == "0"
    assert float(warm.headers["x-duetime-forecast-ttft-ms"]) < 0.5 * float(
        cold.headers["x-duetime-forecast-ttft-ms"])
    # blocks 6.. were evicted: 6 blocks left, unless the replica cached the prompt again from
    # the gateway's own request (a prediction, which the events have not yet contradicted)
    assert int(half.headers["x-duetime-cached-tokens"]) in (96, 192)
    assert after.status_code == 200
    pc = described["instances"][0]["prefix_cache"]
    assert pc["source"] == "estimated" and pc["kv_events"]["batches"] >= 3
