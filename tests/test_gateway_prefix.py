"""The gateway's estimated view of each instance's prefix cache: its shadow replica caches the
blocks of the requests the gateway sent, so forecasts price the hits (embedded emulators on
loopback; issue "prefix caching live")."""

from __future__ import annotations

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
