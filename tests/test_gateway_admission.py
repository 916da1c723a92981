"""Admission by priority (x-duetime-priority, llm-d's x-slo-* headers), the admission queue's
fairness, and the gateway's own load in the forecasts (duetime.gateway.intake.admission, duetime.gateway.state.load)."""

from __future__ import annotations

import asyncio

import pytest

from duetime.gateway.intake.admission import AdmissionQueue
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.load import RELAY_SHARE, GatewayLoad
from test_gateway import chat, config, gateway, metric, run


def test_the_queue_releases_clients_in_turn_each_in_arrival_order() -> None:
    async def go() -> list[str]:
        q = AdmissionQueue(10, GatewayMetrics())
        order: list[str] = []

        async def waiter(client: str, tag: str) -> None:
            assert await q.wait(client, 5.0)
            order.append(tag)

        tasks = [asyncio.create_task(waiter(c, t)) for c, t in
                 [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1")]]
        await asyncio.sleep(0)
        assert len(q) == 5
        for _ in range(5):
            q.poke()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert len(q) == 0
        return order

    assert asyncio.run(go()) == ["a1", "b1", "c1", "a2", "a3"]


def test_the_queue_is_bounded_and_a_wait_ends_with_its_timeout() -> None:
    async def go() -> tuple[bool, bool, int]:
        q = AdmissionQueue(1, GatewayMetrics())
        first = asyncio.create_task(q.wait("a", 0.05))
        await asyncio.sleep(0)
        full = await q.wait("b", 5.0)  # (at once: the queue holds one)
        timed_out = await first
        return full, timed_out, len(q)

    assert asyncio.run(go()) == (False, False, 0)


def test_the_queue_is_released_by_first_tokens_and_ends_whatever_counts_the_load() -> None:
    """The queue learns that capacity may have freed from the attempt lifecycle itself: a
    first token releases a waiter, an attempt's end another (before the lifecycle, only the
    gateway's load told it, so with ``admission.gateway_load: false`` a critical request
    waited out its whole target)."""
    from types import SimpleNamespace

    from duetime.gateway.state.flight import Flight
    from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome

    async def go() -> list[bool]:
        q = AdmissionQueue(10, GatewayMetrics())
        lifecycle = Lifecycle([q])  # (no GatewayLoad subscribed)
        waits = [asyncio.create_task(q.wait(c, 5.0)) for c in ("a", "b", "c")]
        await asyncio.sleep(0)
        a = lifecycle.dispatch(Attempt(Flight("x", 10, 4, 0.0, None),
                                       SimpleNamespace(subscribers=()), 1, 0.0, 1.0, "t", "s"))
        lifecycle.record_first_token(a, 0.01)
        lifecycle.end(a, 0.02, Outcome.OK)
        released = await asyncio.wait_for(asyncio.gather(*waits[:2]), 5.0)  # (a, then b)
        still = not waits[2].done()
        waits[2].cancel()
        return [*released, still]

    assert asyncio.run(go()) == [True, True, True]


def _attempt(fid: str, arrival: float, dispatched: float, number: int = 1):
    """An attempt as the lifecycle hands it to subscribers (only what GatewayLoad reads)."""
    from types import SimpleNamespace

    from duetime.gateway.state.flight import Flight

    return SimpleNamespace(flight=Flight(fid, 10, 4, dispatched, None), arrival=arrival,
                           number=number, output_tokens=4)


def test_an_idle_or_lightly_loaded_gateway_adds_little() -> None:
    """Nothing pending and nothing awaiting: nothing. Requests one after another teach the lone
    intake time (arrival to dispatch); a few streams awaiting their first tokens add their
    relays (a share of an intake each, until a busy window measured one), not their engines'
    time."""
    t, cpu, held = [0.0], [5.0], [0]  # (5 s of startup CPU before the first request)
    load = GatewayLoad(1.0, cpu=lambda: cpu[0], clock=lambda: t[0])
    load.count_intake(lambda: held[0])
    assert load.delay_s() == 0.0
    for k in range(4):
        held[0] = 1  # (the request being decided: not pending)
        assert load.pending() == 0
        a = _attempt(f"r{k}", arrival=t[0], dispatched=t[0] + 0.002)
        load.on_dispatch(a)
        load.on_first_token(a)
        load.on_end(a)
        held[0] = 0
        t[0] += 0.1
        cpu[0] += 0.01
    assert load.intake_s == pytest.approx(0.002)
    assert load.delay_s() == 0.0
    held[0] = 3  # three streams awaiting their first tokens, one request being decided
    for k in range(3):
        load.on_dispatch(_attempt(f"s{k}", arrival=t[0], dispatched=t[0] + 0.002))
    held[0] = 4
    assert load.pending() == 0 and load.awaiting == 3
    assert load.delay_s() == pytest.approx(3 * RELAY_SHARE * 0.002)


def test_a_burst_counts_its_whole_queue_at_the_loaded_intake_cost() -> None:
    """500 connections open at once: the first decision already sees them pending (a request
    on each, not read yet); the gaps between dispatches while intakes wait teach the loaded
    intake cost, which replaces the lone one once ``min_gaps`` are in, and is kept for the
    next burst."""
    t, cpu, held = [0.0], [0.0], [0]
    load = GatewayLoad(0.25, cpu=lambda: cpu[0], clock=lambda: t[0], min_gaps=16)
    load.count_intake(lambda: held[0])
    held[0] = 1
    a = _attempt("lone", arrival=0.0, dispatched=0.0005)
    load.on_dispatch(a)
    load.on_first_token(a)
    load.on_end(a)
    assert load.intake_s == pytest.approx(0.0005)
    t[0] = 1.0
    held[0] = 500  # the burst's connections
    assert load.pending() == 499
    assert load.delay_s() == pytest.approx(499 * 0.0005 + 499 * RELAY_SHARE * 0.0005)
    for k in range(100):  # dispatched 2 ms apart while the rest wait
        t[0] = 1.0 + 0.002 * k
        load.on_dispatch(_attempt(f"b{k}", arrival=1.0, dispatched=t[0]))
    assert load.intake_s == pytest.approx(0.002)
    assert load.pending() == 399 and load.awaiting == 100
    assert load.delay_s() == pytest.approx(399 * 0.002 + 499 * RELAY_SHARE * 0.002)


def test_the_relay_cost_is_learnt_from_busy_windows_only() -> None:
    """A window whose CPU time is mostly the process's background (probes, polls) teaches
    nothing about relays; a busy one does: its CPU less its intakes' share, over the first
    tokens it relayed."""
    t, cpu, held = [0.0], [0.0], [0]
    load = GatewayLoad(0.25, cpu=lambda: cpu[0], clock=lambda: t[0], min_relays=8)
    load.count_intake(lambda: held[0])
    held[0] = 1
    first = _attempt("lone", arrival=0.0, dispatched=0.001)
    load.on_dispatch(first)  # (opens the window; lone intake 1 ms)
    for k in range(20):  # a quiet window: 20 relays, 60 ms of CPU in 0.3 s
        t[0] += 0.015
        cpu[0] += 0.003
        load.on_first_token(_attempt(f"q{k}", 0.0, 0.0))
    assert load.relay_s == pytest.approx(RELAY_SHARE * 0.001)  # (not learnt)
    for k in range(100):  # a busy window: 100 relays in 0.3 s of CPU, no intakes
        t[0] += 0.003
        cpu[0] += 0.003
        load.on_first_token(_attempt(f"b{k}", 0.0, 0.0))
    assert load.relay_s == pytest.approx(0.003, rel=0.05)


def test_priorities_when_no_instance_can_meet_the_target() -> None:
    """A target no forecast meets: a sheddable request is refused (429, Retry-After), a
    standard one goes to the best forecast, a critical one waits (here its target, 1 ms, is
    spent at once) and then goes to the best forecast; a reachable target is on time."""
    async def go():
        async with gateway(config()) as (_svc, c):
            out = {}
            for p in ("sheddable", "standard", "critical"):
                out[p] = await c.post("/v1/chat/completions", json=chat(), headers={
                    "x-duetime-priority": p, "x-duetime-ttft-ms": "0.001"})
            out["easy"] = await c.post("/v1/chat/completions", json=chat(), headers={
                "x-duetime-priority": "sheddable", "x-duetime-ttft-ms": "60000"})
            out["bad"] = await c.post("/v1/chat/completions", json=chat(), headers={
                "x-duetime-priority": "urgent"})
            return out, (await c.get("/metrics")).text

    out, metrics = run(go())
    shed = out["sheddable"]
    assert shed.status_code == 429 and int(shed.headers["retry-after"]) >= 1
    assert shed.json()["error"]["code"] == "overloaded"
    assert out["standard"].status_code == 200 and out["critical"].status_code == 200
    assert out["easy"].status_code == 200
    assert out["bad"].status_code == 400
    assert out["bad"].json()["error"]["param"] == "x-duetime-priority"
    for priority, outcome, n in [("sheddable", "shed", 1), ("standard", "late", 1),
                                 ("critical", "late", 1), ("sheddable", "on_time", 1)]:
        assert metric(metrics, f'duetime_admission_total{{outcome="{outcome}",'
                               f'priority="{priority}"}}') == n, (priority, outcome)


def test_a_critical_request_that_waits_out_its_target_may_be_rejected() -> None:
    """``admission.expired: reject``: a critical request no instance could serve before its
    target was spent in the queue is refused (429, ``overloaded``), not sent late; it is
    counted ``rejected``."""
    async def go():
        async with gateway(config(admission={"expired": "reject"})) as (_svc, c):
            late = await c.post("/v1/chat/completions", json=chat(), headers={
                "x-duetime-priority": "critical", "x-duetime-ttft-ms": "0.001"})
            easy = await c.post("/v1/chat/completions", json=chat(), headers={
                "x-duetime-priority": "critical", "x-duetime-ttft-ms": "60000"})
            return late, easy, (await c.get("/metrics")).text

    late, easy, metrics = run(go())
    assert late.status_code == 429 and late.json()["error"]["code"] == "overloaded"
    assert "critical request" in late.json()["error"]["message"]
    assert int(late.headers["retry-after"]) >= 1
    assert easy.status_code == 200
    assert metric(metrics, 'duetime_admission_total{outcome="rejected",'
                           'priority="critical"}') == 1
    assert metric(metrics, 'duetime_admission_total{outcome="late",priority="critical"}') == 0


def test_llm_d_slo_headers_are_targets() -> None:
    """x-slo-ttft-ms sets the TTFT target when x-duetime-ttft-ms is absent (and loses to it);
    x-slo-tpot-ms is counted against each request's time per output token."""
    async def go():
        async with gateway(config()) as (_svc, c):
            r1 = await c.post("/v1/chat/completions", json=chat(max_tokens=8),
                              headers={"x-slo-ttft-ms": "777", "x-slo-tpot-ms": "60000"})
            r2 = await c.post("/v1/chat/completions", json=chat(),
                              headers={"x-slo-ttft-ms": "777", "x-duetime-ttft-ms": "555"})
            r3 = await c.post("/v1/chat/completions", json=chat(),
                              headers={"x-slo-tpot-ms": "-3"})
            return r1, r2, r3, (await c.get("/metrics")).text

    r1, r2, r3, metrics = run(go())
    assert r1.headers["x-duetime-ttft-target-ms"] == "777.0"
    assert r2.headers["x-duetime-ttft-target-ms"] == "555.0"
    assert r3.status_code == 400 and r3.json()["error"]["param"] == "x-slo-tpot-ms"
    assert metric(metrics, 'duetime_tpot_target_total{outcome="on_time"}') == 1


def test_the_gateway_sees_a_burst_by_its_connections_before_reading_it() -> None:
    """The serving gateway's load counts, from its HTTP server, the requests it holds and has
    not sent upstream: one on each connection opened that has not sent its request yet (a
    burst's connections come before the loop reads their requests), and its forecasts have
    the loop's work ahead of a request as a floor (the same for every instance); a dashboard's
    event stream, open as long as its page, is not one of them; the connections that leave
    stop counting."""
    import socket

    import httpx

    from duetime.service import Service
    from duetime.service.pool import demo_pool

    async def go():
        svc = await Service(demo_pool(), drain_timeout_s=3.0).start()
        try:
            host, port = svc.url.removeprefix("http://").split(":")
            dash = httpx.AsyncClient(base_url=svc.url, timeout=60)
            events = await dash.send(dash.build_request("GET", "/duetime/dashboard/events"),
                                     stream=True)
            assert events.status_code == 200
            socks = [socket.create_connection((host, int(port))) for _ in range(6)]
            load = svc.gateway.load
            for _ in range(200):  # (the loop accepts them)
                if load.pending() == 5:
                    break
                await asyncio.sleep(0.01)
            seen = load.pending()
            async with httpx.AsyncClient(base_url=svc.url, timeout=60) as c:
                r = await c.post("/duetime/route", json=chat())
            for sk in socks:
                sk.close()
            await events.aclose()
            await dash.aclose()
            for _ in range(200):
                if load.pending() == 0:
                    break
                await asyncio.sleep(0.01)
            return seen, r, load.pending()
        finally:
            await svc.stop()

    seen, r, after = run(go(), timeout=60)
    assert seen == 5  # (six connections, one request being decided aside)
    assert r.status_code == 200, r.text
    assert after == 0


def test_a_forecast_is_never_below_the_gateway_s_own_delay() -> None:
    """``with_gateway``: the later of the instance's forecast and the gateway's delay, the
    faster engine first where the gateway's delay is the later for every instance."""
    from types import SimpleNamespace

    from duetime.estimate.base import GATEWAY_TIE, with_gateway

    assert with_gateway(SimpleNamespace(), 0.2) == 0.2
    assert with_gateway(SimpleNamespace(gateway_delay_s=0.1), 0.2) == 0.2
    fast = with_gateway(SimpleNamespace(gateway_delay_s=1.0), 0.01)
    slow = with_gateway(SimpleNamespace(gateway_delay_s=1.0), 0.3)
    assert fast == pytest.approx(1.0 + GATEWAY_TIE * 0.01) and fast < slow < 1.001
