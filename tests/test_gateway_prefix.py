"""The gateway's estimated view of each instance's prefix cache: its shadow replica caches the
blocks of the requests the gateway sent, so forecasts price the hits (embedded emulators on
loopback; issue "prefix caching live")."""

from __future__ import annotations

import asyncio

import httpx

from duetime.service.pool import pool_from_dict
from test_gateway import config, gateway, run

SYSTEM = "You answer questions about the history of tea. " * 80  # ~4,000 characters


def _turns(answer: str) -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where was tea first grown?"}]
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And when did it reach Europe?"}]
    return first, second


def _forecast_ms(r: httpx.Response) -> float:
    assert r.status_code == 200, r.text
    return float(r.headers["x-duetime-forecast-ttft-ms"])


def test_a_conversations_next_turn_is_forecast_with_its_cached_prefix() -> None:
    """Turn two of a conversation, to the instance that served turn one, is forecast from
    the blocks turn one left cached: a visibly smaller TTFT forecast. With caching off in
    the emulator options, the replica caches nothing and both forecasts price the whole
    prompt."""
    def one(caching: bool) -> tuple[float, float, str]:
        cfg = config(b={"emulate": {"speed": 2.0, "seed": 1,
                                    "enable_prefix_caching": caching}},
                     a={"emulate": {"speed": 2.0, "enable_prefix_caching": caching}})

        async def go():
            # (the pool read as `duetime serve` reads it: embedded instances cache as their
            # emulator options say)
            async with gateway(cfg, pool_from_dict) as (_svc, c):
                first, _ = _turns("")
                r1 = await c.post("/v1/chat/completions", json={
                    "model": "big", "messages": first, "max_tokens": 8})
                answer = r1.json()["choices"][0]["message"]["content"]
                _, second = _turns(answer)
                r2 = await c.post("/v1/chat/completions", json={
                    "model": "big", "messages": second, "max_tokens": 8})
                return _forecast_ms(r1), _forecast_ms(r2), r2.headers["x-duetime-instance"]
        return run(go())

    f1, f2, inst = one(True)
    assert inst == "a"
    assert f2 < 0.5 * f1, (f1, f2)
    g1, g2, _ = one(False)
    assert g2 >= g1  # (a longer prompt, nothing cached)
    assert f1 == g1 or abs(f1 - g1) < 0.1 * g1  # the first turn: nothing cached either way


def test_prefix_load_sends_a_conversation_back_to_its_cache() -> None:
    """llm-d's scorer in the gateway reads each replica's cache: two conversations that start
    at once land on the two replicas of one model (the queue scorer), and each next turn goes
    back to the replica that holds its prefix (with no index, both would score alike)."""
    inst = {"model": "big", "profile": "qwen3-8b", "price_usd_per_mtok": {"prompt": 0.1,
                                                                          "output": 0.3}}
    cfg = {"policy": "prefix-load",
           "quality": {"workload": None, "tasks": {"chat": {"big": 0.9}}},
           "instances": [{"name": "a", **inst, "emulate": {"speed": 2.0}},
                         {"name": "b", **inst, "emulate": {"speed": 2.0, "seed": 1}}],
           "health": {"interval_s": 0.1, "eject_after": 1},
           "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0},
           # (load from the replicas, which see each dispatch at once: scraped gauges are up
           # to 50 ms old, and two requests sent together would both see idle instances)
           "state": {"source": "shadow"}}

    async def go():
        async with gateway(cfg, pool_from_dict) as (_svc, c):
            convs = [[{"role": "system", "content": f"Tenant {k}. " + SYSTEM},
                      {"role": "user", "content": "Where was tea first grown?"}]
                     for k in range(2)]
            first = await asyncio.gather(*(c.post("/v1/chat/completions", json={
                "model": "big", "messages": m, "max_tokens": 64}) for m in convs))
            placed = [r.headers["x-duetime-instance"] for r in first]
            again = []
            for m, r in zip(convs, first, strict=True):
                m2 = [*m, {"role": "assistant",
                           "content": r.json()["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And when did it reach Europe?"}]
                r2 = await c.post("/v1/chat/completions", json={
                    "model": "big", "messages": m2, "max_tokens": 8})
                again.append(r2.headers["x-duetime-instance"])
            return placed, again

    placed, again = run(go())
    assert sorted(placed) == ["a", "b"]
    assert again == placed


def test_the_gateway_sizes_its_view_from_the_instances_cache_config() -> None:
    """An instance behind a URL reports its KV cache in ``vllm:cache_config_info``: the gateway
    adopts its block size, KV blocks and prefix caching over the pool config's (the profile's
    here), so its replica estimates a cache of the instance's size."""
    from duetime.emulator import Emulator, create_app
    from duetime.engine import Paper4, SchedulerConfig
    from duetime.web.server import AppServer
    from test_gateway import PRICE, wait_for

    async def go():
        emu = Emulator(Paper4(b0=1e-3, b1=1e-6, b2=0.0, b3=0.0),
                       SchedulerConfig(max_model_len=4096, num_gpu_blocks=300, block_size=32),
                       model_name="qwen3-0.6b", enable_prefix_caching=True)
        upstream = await AppServer(create_app(emu)).start()
        try:
            cfg = {"instances": [{"name": "u", "model": "qwen3-0.6b", "url": upstream.url,
                                  "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE}],
                   "health": {"interval_s": 0.1}}
            async with gateway(cfg, pool_from_dict) as (svc, c):
                inst = svc.gateway.instances[0]
                before = svc.gateway.pool.instances[0].config  # (the pool config's)
                ok = await wait_for(lambda: inst.instance.config.num_gpu_blocks == 300)
                r = await c.post("/v1/completions", json={"prompt": [1] * 100,
                                                          "max_tokens": 2})
                return before, ok, inst, r
        finally:
            await upstream.stop()

    before, ok, inst, r = run(go())
    assert (before.num_gpu_blocks, before.block_size) != (300, 32)
    cfg = inst.instance.config
    assert ok and (cfg.block_size, cfg.enable_prefix_caching) == (32, True)
    assert inst.shadow.engine.config.num_gpu_blocks == 300 and inst.prefix_index is not None
    assert r.status_code == 200


def test_adopting_the_cache_config_keeps_the_requests_in_flight() -> None:
    """Adopted while requests are in flight: the rebuilt replica holds them again (the
    running one as running), with the instance's numbers."""
    import time

    from attempts import dispatch, first_token
    from duetime.gateway.backends.memory import MemoryStore
    from duetime.gateway.config import pool_from_dict as gateway_pool
    from duetime.gateway.prometheus import GatewayMetrics
    from duetime.gateway.state.instance import InstanceState
    from test_gateway import PRICE

    pool = gateway_pool({"instances": [{"name": "u", "model": "qwen3-0.6b", "url": "http://h",
                                        "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE}]})
    now = time.monotonic()
    inst = InstanceState(pool.instances[0], pool, GatewayMetrics(), MemoryStore(), now)
    a = dispatch(inst, "a", 500, 10, now, None)
    dispatch(inst, "b", 300, 10, now, None)
    first_token(a, now)
    assert inst.adopt_cache_config({"num_gpu_blocks": 900, "block_size": 32,
                                    "enable_prefix_caching": True})
    assert not inst.adopt_cache_config({"num_gpu_blocks": 900})  # (nothing new)
    eng = inst.shadow.engine
    assert eng.config.num_gpu_blocks == 900 and eng.caching and inst.prefix_index is not None
    assert eng.running_ids() == ["a"] and eng.waiting_ids() == ["b"]
