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
