"""The gateway's admission queue in AdmissionOrder's order (duetime.gateway.intake.admission):
the client served least recently first, fed by the attempt lifecycle; the earliest deadline
within a client; a full queue displacing a heavy client's waiter; the per-key series.

The queue runs on an injected clock where time matters, so no test sleeps on a premise about
the machine's speed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from duetime.gateway.intake.admission import Admission, AdmissionQueue
from duetime.gateway.intake.controls import Controls
from duetime.gateway.keys import ApiKey
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome
from test_gateway import metric


def key(name: str) -> ApiKey:
    return ApiKey(name, "0" * 64, None, None, None)


def serve(lifecycle: Lifecycle, name: str, prompt: int, output: int, t: float) -> None:
    """One attempt of key ``name`` through the lifecycle: dispatched, first token, ended."""
    a = lifecycle.dispatch(Attempt(Flight(f"{name}-{t}", prompt, output, t, None),
                                   SimpleNamespace(subscribers=()), 1, t, 1.0, "t", "s",
                                   key=key(name), client=f"key:{name}"))
    lifecycle.record_first_token(a, t)
    lifecycle.end(a, t, Outcome.OK, output_tokens=output)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_light_key_is_released_before_a_heavy_key_s_earlier_waiters() -> None:
    """The heavy key was served 20x the light key's tokens (the lifecycle told the queue):
    its three waiters, queued first and with earlier deadlines, go after the light key's."""
    clock = [100.0]

    async def go() -> tuple[list[str], dict[str, float]]:
        q = AdmissionQueue(10, GatewayMetrics(), clock=lambda: clock[0])
        lifecycle = Lifecycle([q])
        for _ in range(20):
            serve(lifecycle, "heavy", 900, 100, clock[0])
        serve(lifecycle, "light", 900, 100, clock[0])
        released: list[str] = []

        async def waiter(client: str, tag: str, deadline: float) -> None:
            assert await q.wait(client, 30.0, deadline=deadline)
            released.append(tag)

        tasks = [asyncio.create_task(waiter("key:heavy", f"h{k}", 101.0 + k)) for k in range(3)]
        await settle()
        tasks.append(asyncio.create_task(waiter("key:light", "l0", 120.0)))
        await settle()
        for _ in range(4):
            q.poke()
            await settle()
        await asyncio.gather(*tasks)
        return released, q.attained()

    released, attained = asyncio.run(go())
    assert released == ["l0", "h0", "h1", "h2"]
    assert attained == {"heavy": 20_000.0, "light": 1_000.0}


def test_the_light_key_keeps_going_first_until_it_has_caught_up() -> None:
    """Service is in tokens, not requests: a light key's one 10,000-token request weighs more
    than a heavy key's five 1,000-token ones; until it was served, the light key goes first."""
    async def go() -> list[str]:
        q = AdmissionQueue(10, GatewayMetrics(), clock=lambda: 0.0)
        lifecycle = Lifecycle([q])
        for _ in range(5):
            serve(lifecycle, "many", 900, 100, 0.0)
        out: list[str] = []

        async def waiter(client: str, tag: str) -> None:
            assert await q.wait(client, 30.0)
            out.append(tag)

        tasks = [asyncio.create_task(waiter(c, t)) for c, t in
                 [("key:many", "m0"), ("key:big", "b0"), ("key:big", "b1")]]
        await settle()
        q.poke()  # b0 (big: nothing served yet)
        await settle()
        serve(lifecycle, "big", 9_000, 1_000, 0.0)  # b0 served: 10,000 tokens; pokes once
        await settle()
        await asyncio.gather(*tasks)
        return out

    assert asyncio.run(go()) == ["b0", "m0", "b1"]


def test_within_a_client_the_earliest_deadline_goes_first() -> None:
    """Admission orders a client's waiters by the end-to-end deadline where the request has
    one, else by when its TTFT target runs out."""
    clock = [50.0]

    async def go() -> list[str]:
        q = AdmissionQueue(10, GatewayMetrics(), clock=lambda: clock[0])
        admission = Admission(q, GatewayMetrics())
        out: list[str] = []

        async def request(tag: str, target_s: float, deadline_s: float | None) -> None:
            ctl = Controls(target_s, frozenset(), None, "*", "critical",
                           deadline_s=deadline_s, client="key:a")
            assert not await admission.admit(100.0, target_s, ctl, waited=False)
            out.append(tag)

        tasks = [asyncio.create_task(request("ttft-20s", 20.0, None)),   # expires at 70
                 asyncio.create_task(request("e2e-40s", 30.0, 40.0)),    # deadline at 90
                 asyncio.create_task(request("e2e-5s", 25.0, 5.0))]      # deadline at 55
        await settle()
        for _ in range(3):
            q.poke()
            await settle()
        await asyncio.gather(*tasks)
        return out

    assert asyncio.run(go()) == ["e2e-5s", "ttft-20s", "e2e-40s"]


def test_a_full_queue_of_a_heavy_key_does_not_lock_a_light_one_out() -> None:
    """The queue holds two, both the heavy key's: another heavy waiter is turned away, a light
    one displaces the heavy waiter with the latest deadline (whose wait ends: False)."""
    async def go() -> tuple[bool, bool, bool, bool, int]:
        q = AdmissionQueue(2, GatewayMetrics(), clock=lambda: 0.0)
        serve(Lifecycle([q]), "heavy", 1000, 0, 0.0)
        h0 = asyncio.create_task(q.wait("key:heavy", 30.0, deadline=1.0))
        h1 = asyncio.create_task(q.wait("key:heavy", 30.0, deadline=2.0))
        await settle()
        turned_away = await q.wait("key:heavy", 30.0, deadline=0.5)
        light = asyncio.create_task(q.wait("key:light", 30.0, deadline=9.0))
        await settle()
        displaced = await h1
        size = len(q)
        q.poke()
        q.poke()
        return turned_away, displaced, await light, await h0, size

    assert asyncio.run(go()) == (False, False, True, True, 2)


def test_the_per_key_series() -> None:
    """Each wait is observed under its key's name (empty: a client without a key), and each
    key's attained service is read, decayed, when scraped."""
    clock = [0.0]

    async def go() -> str:
        metrics = GatewayMetrics()
        q = AdmissionQueue(10, metrics, half_life_s=10.0, clock=lambda: clock[0])
        serve(Lifecycle([q]), "alice", 300, 100, 0.0)
        waits = [asyncio.create_task(q.wait(c, 30.0)) for c in ("key:alice", "10.0.0.7")]
        await settle()
        clock[0] = 10.0  # (alice's 400 tokens are half as recent)
        q.poke()
        q.poke()
        assert await asyncio.gather(*waits) == [True, True]
        return generate_latest(metrics.registry).decode()

    text = asyncio.run(go())
    assert metric(text, 'duetime_attained_service_tokens{key="alice"}') == 200.0
    assert metric(text, 'duetime_admission_wait_seconds_count{key="alice"}') == 1
    assert metric(text, 'duetime_admission_wait_seconds_count{key=""}') == 1
    assert metric(text, 'duetime_admission_wait_seconds_sum{key=""}') == 10.0
    assert metric(text, "duetime_admission_queued") == 0


def test_the_serving_gateway_counts_each_key_s_tokens(tmp_path) -> None:
    """Wired: a keyed request's prompt and output tokens reach the queue through the serving
    gateway's lifecycle, and /metrics shows them under the key's name."""
    from test_auth import ALICE, ROOT, auth_header, keys_files
    from test_auth import config as auth_config
    from test_gateway import gateway, run

    async def go():
        async with gateway(auth_config(keys_files(tmp_path))) as (_svc, c):
            r = await c.post("/v1/chat/completions", headers=auth_header(ALICE), json={
                "model": "auto", "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4})
            return r, (await c.get("/metrics", headers=auth_header(ROOT))).text

    r, text = run(go())
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    served = metric(text, 'duetime_attained_service_tokens{key="alice"}')
    # (decayed by the moments between the answer and the scrape: a minute's half-life takes
    # 10% off in 9 s)
    assert 0.9 * usage["total_tokens"] <= served <= usage["total_tokens"] * (1 + 1e-9)
    assert 'duetime_attained_service_tokens{key=""}' not in text  # (no client without a key)


def test_the_half_life_is_configured_and_validated() -> None:
    from duetime.gateway import ConfigError, pool_from_dict
    from duetime.gateway.app import Gateway
    from test_auth import config as auth_config

    cfg = auth_config(emulate=False)
    gw = Gateway(pool_from_dict({**cfg, "admission": {"fairness_half_life_s": 30}}, "test"))
    assert gw.queue.order.service.half_life_s == 30.0
    assert Gateway(pool_from_dict(cfg, "test")).queue.order.service.half_life_s == 60.0
    for bad in (0, -1, "soon"):
        with pytest.raises(ConfigError, match="fairness_half_life_s"):
            pool_from_dict({**cfg, "admission": {"fairness_half_life_s": bad}}, "test")


def test_a_wait_that_ends_unreleased_goes_late_or_is_rejected() -> None:
    """A critical request whose wait ends without a release (a full queue here: no clock
    premise) goes to the best forecast once decided again (``expired: late``), or is refused
    with a 429 (``reject``)."""
    from duetime.gateway.intake.admission import Shed, shed_error

    ctl = Controls(1.0, frozenset(), None, "*", "critical", client="key:a")

    async def turned_away(expired: str) -> tuple[bool | None, Shed | None, GatewayMetrics]:
        m = GatewayMetrics()
        admission = Admission(AdmissionQueue(0, m), m, expired)  # (a queue that holds none)
        try:
            assert not await admission.admit(100.0, 1.0, ctl, waited=False)  # (turned away)
            return await admission.admit(100.0, 1.0, ctl, waited=True), None, m  # (late)
        except Shed as e:
            return None, e, m

    late, shed, m = asyncio.run(turned_away("late"))
    assert late is True and shed is None
    assert m.registry.get_sample_value("duetime_admission_total", {
        "priority": "critical", "outcome": "late"}) == 1
    late, shed, m = asyncio.run(turned_away("reject"))
    assert late is None and shed is not None and shed.priority == "critical"
    err = shed_error(shed)
    assert err.status == 429 and "critical request" in err.message
    assert m.registry.get_sample_value("duetime_admission_total", {
        "priority": "critical", "outcome": "rejected"}) == 1


def test_a_client_without_a_key_is_charged_by_its_address() -> None:
    """The attempt carries the client as the intake named it: an address where there is no
    key, so keyless clients are told apart too (their series share the empty ``key`` label)."""
    m = GatewayMetrics()
    q = AdmissionQueue(10, m)
    lifecycle = Lifecycle([q])
    a = lifecycle.dispatch(Attempt(Flight("r", 100, 20, 0.0, None),
                                   SimpleNamespace(subscribers=()), 1, 0.0, 1.0, "t", "s",
                                   client="10.0.0.7"))
    lifecycle.record_first_token(a, 0.0)
    lifecycle.end(a, 0.0, Outcome.OK, output_tokens=20)
    got = q.order.service.values(q.clock())
    assert set(got) == {"10.0.0.7"} and got["10.0.0.7"] == pytest.approx(120, rel=0.01)
    assert q.attained() == {"": pytest.approx(120, rel=0.01)}
