"""Gateway replicas sharing live state through a real Redis (``state.store``), in one process:
one replica's requests join the other's shadow replicas and change its routing; a key's rate
limit holds across replicas; without the store each replica sees only its own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import httpx

from duetime.gateway.config import Pool
from duetime.service import Service
from duetime.service.pool import pool_from_dict
from redis_server import RedisServer
from test_auth import ALICE, auth_header, keys_files
from test_gateway import chat, config, long_streams, run, wait_for


def without_emulators(pool: Pool, **state: Any) -> Pool:
    """The same instances (their URLs), as a replica that does not start them sees them."""
    return dataclasses.replace(
        pool, state=pool.state.model_copy(update=state),
        instances=tuple(dataclasses.replace(i, emulate=None) for i in pool.instances))


@contextlib.asynccontextmanager
async def service(pool: Pool) -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    svc = await Service(pool, drain_timeout_s=3.0).start()
    try:
        async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
            yield svc, c
    finally:
        await svc.stop()


def test_a_replica_routes_around_load_another_replica_sent(redis_server: RedisServer):
    """Replica A sends eight long prompts to a; replica B (same Redis) sees them in its replica
    of a and sends a 100 ms chat to b; replica C (no store) thinks a idle and picks it."""
    n_long = 8

    async def go() -> dict[str, Any]:
        state = {"source": "shadow", "store": redis_server.url, "store_sync_s": 0.01}
        cfg = config(state=state, a={"emulate": {"speed": 1.0}})
        # (B and C need A's pool: its emulators' URLs)
        async with service(pool_from_dict(cfg, "test")) as (sa, ca):  # noqa: SIM117
            async with service(without_emulators(sa.pool)) as (sb, cb), \
                    service(without_emulators(sa.pool, store=None)) as (_, cc):
                tasks = long_streams(ca, n_long)
                b_a = sb.gateway.instances[0]
                assert await wait_for(lambda: len(b_a.remote_flights) == n_long, 10.0)
                desc = (await cb.get("/duetime/instances")).json()
                snap = b_a.snapshot()
                r_b = await cb.post("/v1/chat/completions", json=chat(),
                                    headers={"x-duetime-ttft-ms": "100"})
                metrics = (await cb.get("/metrics")).text
                still_busy = not any(t.done() for t in tasks)
                # (C's chat waits behind the long prompts: it is sent after the check)
                r_c = await cc.post("/v1/chat/completions", json=chat(),
                                    headers={"x-duetime-ttft-ms": "100"})
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                drained = await wait_for(lambda: not b_a.remote_flights, 10.0)
                return {"desc": desc, "queued": len(snap.running_table)
                        + len(snap.waiting_table), "b": r_b, "c": r_c, "busy": still_busy,
                        "metrics": metrics, "drained": drained}

    out = run(go(), 90.0)
    assert out["busy"], "premise: a's long prompts should outlast B's chat"
    a = next(d for d in out["desc"]["instances"] if d["name"] == "a")
    assert (a["in_flight"], a["in_flight_all"]) == (0, n_long)
    assert out["desc"]["store"]["kind"] == "redis" and out["desc"]["store"]["up"] is True
    assert len(out["desc"]["store"]["peers"]) == 1  # (A; C has no store)
    assert out["queued"] == n_long  # B's replica of a holds A's requests
    assert out["b"].status_code == 200 and out["b"].headers["x-duetime-instance"] == "b"
    assert out["c"].status_code == 200 and out["c"].headers["x-duetime-instance"] == "a"
    assert 'duetime_in_flight_remote{instance="a"} 8.0' in out["metrics"]
    assert out["drained"], "A's ended requests should leave B's view"


def test_a_keys_rate_limit_holds_across_replicas(redis_server: RedisServer, tmp_path):
    async def go() -> list[int]:
        cfg = config(state={"store": redis_server.url},
                     auth=keys_files(tmp_path, rpm=3))
        async with service(pool_from_dict(cfg, "test")) as (sa, ca):  # noqa: SIM117
            async with service(without_emulators(sa.pool)) as (_, cb):
                codes = []
                for c in (ca, cb, ca, cb):
                    r = await c.post("/v1/chat/completions", json=chat(),
                                     headers=auth_header(ALICE))
                    codes.append(r.status_code)
                return codes

    codes = run(go(), 90.0)
    assert codes == [200, 200, 200, 429]  # 3 a minute for the deployment, not per replica


def test_an_ejection_on_one_replica_holds_on_the_other(redis_server: RedisServer):
    async def go() -> tuple[bool, bool, bool]:
        cfg = config(state={"store": redis_server.url}, health={"interval_s": 60.0})
        async with service(pool_from_dict(cfg, "test")) as (sa, _):  # noqa: SIM117
            async with service(without_emulators(sa.pool)) as (sb, cb):
                a_on_a, a_on_b = sa.gateway.instances[0], sb.gateway.instances[0]
                a_on_a.health.eject("test: five 5xx in a row")
                out = await wait_for(lambda: not a_on_b.healthy, 10.0)
                r = await cb.post("/v1/chat/completions", json=chat(model="big"))
                routed = r.headers.get("x-duetime-instance")
                a_on_a.health.readmit()
                back = await wait_for(lambda: a_on_b.healthy, 10.0)
                return out, back, routed == "a"

    out, back, fail_open = run(go(), 90.0)
    assert out, "B should take a out of rotation when A ejects it"
    assert fail_open  # (model big has no other instance: B fails open to it, as alone)
    assert back, "B should put a back when A readmits it"


def test_a_sessions_binding_holds_on_every_replica(redis_server: RedisServer):
    async def go() -> tuple[str | None, str | None, str | None]:
        cfg = config(state={"store": redis_server.url}, policy="session-affinity")
        async with service(pool_from_dict(cfg, "test")) as (sa, ca):  # noqa: SIM117
            async with service(without_emulators(sa.pool)) as (sb, cb):
                h = {"x-session-id": "conversation-7"}
                r = await ca.post("/v1/chat/completions", json=chat(), headers=h)
                first = r.headers.get("x-duetime-instance")
                bindings = sb.gateway.policies.default.bindings
                await wait_for(lambda: "conversation-7" in bindings, 10.0)
                r = await cb.post("/v1/chat/completions", json=chat(), headers=h)
                return first, bindings.get("conversation-7"), r.headers.get(
                    "x-duetime-instance")

    first, seen, second = run(go(), 90.0)
    assert first is not None and seen == first and second == first


def test_a_bad_store_url_is_a_one_line_error(capsys):
    from duetime.cli import main

    assert main(["serve", "--store", "http://x", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--store 'http://x': a Redis URL" in err
