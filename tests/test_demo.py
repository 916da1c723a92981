"""The SFS demo's API (duetime.service.demo): the simulator panel's numbers (the four routers
on one trace, the queues derived from the requests' records, the sweep), the batch panel's
term breakdown and its fixed-total sweep, the 400s, one simulation at a time, and ``duetime
serve`` serving ``/demo`` while the gateway keeps answering."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette

from duetime.service import Service
from duetime.service.demo import (
    ROUTERS,
    BatchIn,
    OneAtATime,
    SimulateIn,
    batch_report,
    demo_routes,
    simulate,
)
from duetime.service.pool import demo_pool, pool_from_dict
from duetime.web.errors import ApiError

PAPER4 = {"b0": 0.004, "b1": 2e-5, "b2": 3e-8, "b3": 5e-9}


@pytest.fixture(scope="module")
def at6() -> dict:
    """The four routers at 6 q/s on 600 requests of the demo workload, sfs in detail."""
    return simulate(SimulateIn(rate=6.0, requests=600, router="sfs", sweep_rates=[4.0, 8.0],
                               sweep_requests=100))


def test_simulate_table_has_the_four_routers_and_sfs_leads(at6: dict) -> None:
    rows = {r["router"]: r for r in at6["table"]}
    assert list(rows) == list(ROUTERS)
    for r in rows.values():
        assert 0 < r["mean_ttft_s"] <= r["p95_ttft_s"]
        assert 0 <= r["on_time"] <= 1
    # the page's point: SFS keeps latency-agnostic's utility and round-robin's timeliness
    assert rows["sfs"]["ontime_utility"] >= rows["latency-agnostic"]["ontime_utility"]
    assert rows["sfs"]["ontime_utility"] > rows["round-robin"]["ontime_utility"]
    assert rows["sfs"]["on_time"] > rows["latency-agnostic"]["on_time"]
    assert rows["latency-agnostic"]["p95_ttft_s"] > 2 * rows["sfs"]["p95_ttft_s"]


def test_simulate_timeline_matches_the_table(at6: dict) -> None:
    reqs = at6["detail"]["requests"]
    assert len(reqs["arrival_s"]) == 600 and reqs["arrival_s"][0] == 0.0
    assert np.all(np.diff(reqs["arrival_s"]) >= 0)
    ttft = np.array(reqs["ttft_s"])
    sfs = next(r for r in at6["table"] if r["router"] == "sfs")
    assert ttft.mean() == pytest.approx(sfs["mean_ttft_s"])
    assert np.mean(reqs["on_time"]) == pytest.approx(sfs["on_time"])
    assert np.array_equal(reqs["on_time"], ttft <= np.array(reqs["target_s"]))
    assert set(reqs["instance"]) <= {0, 1, 2} and len(at6["instances"]) == 3


def test_queues_are_exact_counts_of_the_records(at6: dict) -> None:
    """Little's law holds exactly for a step function of exact counts: the area under each
    instance's awaiting-first-token curve is the sum of its requests' TTFTs, and under its
    decoding curve the sum of their first-token-to-finish times."""
    q, reqs = at6["detail"]["queue"], at6["detail"]["requests"]
    t = np.array(q["t"])
    dt = np.diff(t)
    inst = np.array(reqs["instance"])
    ttft = np.array(reqs["ttft_s"])
    for k in range(3):
        waiting, decoding = np.array(q["awaiting_first_token"][k]), np.array(q["decoding"][k])
        assert waiting.min() >= 0 and decoding.min() >= 0
        assert waiting[-1] == 0 and decoding[-1] == 0  # every request drained
        assert np.sum(waiting[:-1] * dt) == pytest.approx(ttft[inst == k].sum(), rel=1e-9)
        assert decoding.max() > 0 or not (inst == k).any()


def test_simulate_sweep(at6: dict) -> None:
    sw = at6["sweep"]
    assert sw["rates"] == [4.0, 8.0] and sw["requests"] == 100
    assert set(sw["ontime_utility"]) == set(ROUTERS)
    for values in sw["ontime_utility"].values():
        assert len(values) == 2 and all(-1 < v <= 1 for v in values)
    assert at6["timing"]["total_s"] > 0


def test_simulate_lambda_delta_and_sfs_soft() -> None:
    """sfs-soft joins the table when chosen; with delta = 0 it is latency-agnostic; a larger
    lambda costs utility (routing and the metric both use it)."""
    small = dict(rate=5.0, requests=150, sweep_rates=[5.0], sweep_requests=40)
    soft = simulate(SimulateIn(router="sfs-soft", delta=0.0, **small))
    rows = {r["router"]: r for r in soft["table"]}
    assert list(rows) == [*ROUTERS, "sfs-soft"]
    assert rows["sfs-soft"]["utility"] == pytest.approx(rows["latency-agnostic"]["utility"])
    assert rows["sfs-soft"]["mean_ttft_s"] == pytest.approx(rows["latency-agnostic"]
                                                            ["mean_ttft_s"])
    pricey = simulate(SimulateIn.model_validate({"lambda": 5e-3, **small}))
    assert pricey["lambda"] == 5e-3
    cheap = {r["router"]: r for r in simulate(SimulateIn(**small))["table"]}
    costly = {r["router"]: r for r in pricey["table"]}
    assert costly["round-robin"]["utility"] < cheap["round-robin"]["utility"]


def paper4_pool():
    return pool_from_dict({"instances": [
        {"name": "p4", "model": "qwen3-8b", "url": "http://127.0.0.1:9",
         "profile": "qwen3-8b", "batch_time": {"model": "paper4", "coefficients": PAPER4}},
        {"name": "s6", "model": "qwen3-32b", "url": "http://127.0.0.1:9",
         "profile": "qwen3-32b"}]}, "test")


def test_batch_terms_sum_to_the_models_duration() -> None:
    """5 decode sequences of context 2048 and one 512-token prefill chunk after 0: the features
    by hand, each instance's terms summing to its model's duration."""
    pool = paper4_pool()
    r = batch_report(pool, BatchIn(decode_seqs=5, decode_context=2048, prefill_tokens=512,
                                   prefill_requests=1, prefill_context=0))
    f = r["batch"]["features"]
    assert f == {"n_dec": 5, "n_pre": 512, "pre_sq": 512 ** 2, "pre_attn": 512 * 513 // 2,
                 "dec_ctx": 5 * 2048, "len_sum": 5 * 2049 + 512,
                 "len_sq": 5 * 2049 ** 2 + 512 ** 2}
    assert r["batch"]["total_tokens"] == 517
    for inst, spec in zip(r["instances"], pool.instances, strict=True):
        assert sum(t["seconds"] for t in inst["terms"]) == pytest.approx(inst["total_s"],
                                                                         rel=1e-12)
        assert inst["total_s"] == pytest.approx(spec.batch_time.duration(**f), rel=1e-12)
        assert inst["per_decode_token_s"] == pytest.approx(inst["total_s"] / 5)
        assert inst["prefill_tokens_per_s"] == pytest.approx(512 / inst["total_s"])
    p4 = {t["name"]: t for t in r["instances"][0]["terms"]}
    assert set(p4) == {"b0", "b1", "b2", "b3"}
    assert p4["b2"]["seconds"] == pytest.approx(PAPER4["b2"] * 5 * 2048)
    assert p4["b3"]["seconds"] == pytest.approx(PAPER4["b3"] * 512 * 513 / 2)
    assert p4["b1"]["feature"] == 517
    assert {t["name"] for t in r["instances"][1]["terms"]} == {"c0", "cp", "cpsq", "cd", "cs",
                                                               "css"}


@pytest.mark.parametrize("knob", ["decode_context", "prefill_context", "decode_share",
                                  "prefill_requests"])
def test_batch_sweep_holds_total_tokens(knob: str) -> None:
    q = BatchIn(decode_seqs=40, decode_context=4096, prefill_tokens=1000, prefill_requests=4,
                prefill_context=2048, vary=knob, points=9)
    r = batch_report(paper4_pool(), q)
    s = r["sweep"]
    assert s["knob"] == knob and len(s["x"]) >= 2 and s["x"] == sorted(s["x"])
    assert set(s["total_tokens"]) == {1040}
    assert s["current"] == (40 if knob == "decode_share" else getattr(q, knob))
    for inst in r["instances"]:
        assert len(inst["sweep_s"]) == len(s["x"])
        assert all(v > 0 for v in inst["sweep_s"])
        if knob in ("decode_context", "prefill_context"):  # more context: never faster
            assert inst["sweep_s"] == sorted(inst["sweep_s"])
            assert inst["sweep_s"][-1] > inst["sweep_s"][0]


def test_batch_same_tokens_different_times() -> None:
    """The panel's point: the same token count, a longer decode context, a slower batch."""
    pool = demo_pool()
    short = batch_report(pool, BatchIn(decode_context=256))
    long = batch_report(pool, BatchIn(decode_context=30000))
    for a, b in zip(short["instances"], long["instances"], strict=True):
        assert b["total_s"] > a["total_s"]
    assert short["batch"]["total_tokens"] == long["batch"]["total_tokens"]


def app_client() -> httpx.AsyncClient:
    app = Starlette(routes=demo_routes(paper4_pool()))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("simulate", {"rate": 0}, "rate"),
    ("simulate", {"rate": 99}, "rate"),
    ("simulate", {"requests": 100000}, "requests"),
    ("simulate", {"router": "fastest"}, "router"),
    ("simulate", {"lambda": -1}, "lambda"),
    ("simulate", {"sweep_rates": [3, 50]}, "sweep_rates"),
    ("simulate", {"sweep_rates": list(range(1, 11))}, "sweep_rates"),
    ("simulate", {"colour": "blue"}, "colour"),
    ("simulate", [1, 2], None),
    ("batch", {"decode_seqs": 0, "prefill_tokens": 0}, None),
    ("batch", {"decode_seqs": 512, "prefill_tokens": 32768}, None),
    ("batch", {"prefill_tokens": 3, "prefill_requests": 4}, None),
    ("batch", {"decode_context": -1}, "decode_context"),
    ("batch", {"vary": "colour"}, "vary"),
])
def test_bad_input_is_a_400(path: str, body, param: str | None) -> None:
    async def go() -> httpx.Response:
        async with app_client() as c:
            return await c.post(f"/duetime/demo/{path}", json=body)

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}


def test_not_json_is_a_400() -> None:
    async def go() -> httpx.Response:
        async with app_client() as c:
            return await c.post("/duetime/demo/batch", content=b"{nope",
                                headers={"content-type": "application/json"})

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_one_simulation_at_a_time() -> None:
    """While one runs, one more waits; beyond that a 429 (no timing: events only)."""
    async def go() -> None:
        gate = OneAtATime(queued=1)
        started, release = threading.Event(), threading.Event()
        order: list[int] = []

        def slow() -> int:
            started.set()
            release.wait(60)
            order.append(1)
            return 1

        first = asyncio.create_task(gate.run(slow))
        while not started.is_set():
            await asyncio.sleep(0.01)
        second = asyncio.create_task(gate.run(lambda: order.append(2) or 2))
        while gate.waiting < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as e:
            await gate.run(lambda: 3)
        assert e.value.status == 429 and e.value.body()["error"]["code"] == "demo_busy"
        assert order == []
        release.set()
        assert await first == 1 and await second == 2
        assert order == [1, 2]

    asyncio.run(go())


def test_serve_mounts_the_demo_and_keeps_serving() -> None:
    """``duetime serve``'s Service: /demo is the page, its script is served, the routes answer
    (and are in the OpenAPI document, the page is not), and /health answers while a
    simulation runs in its thread."""
    async def go() -> None:
        svc = await Service(demo_pool(), drain_timeout_s=3.0).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=120) as c:
                page = await c.get("/demo")
                assert page.status_code == 200 and "text/html" in page.headers["content-type"]
                assert "/static/demo.js" in page.text
                assert (await c.get("/static/demo.js")).status_code == 200
                sim = asyncio.create_task(c.post("/duetime/demo/simulate", json={
                    "rate": 4, "requests": 100, "sweep_rates": [4], "sweep_requests": 40}))
                health = await asyncio.gather(*(c.get("/health") for _ in range(5)))
                assert all(h.status_code == 200 for h in health)
                r = await sim
                assert r.status_code == 200, r.text
                assert [x["router"] for x in r.json()["table"]] == list(ROUTERS)
                b = await c.post("/duetime/demo/batch", json={"decode_seqs": 8})
                assert [i["name"] for i in b.json()["instances"]] == [
                    "qwen3-0.6b", "qwen3-8b", "qwen3-32b"]
                paths = (await c.get("/openapi.json")).json()["paths"]
                assert "/duetime/demo/simulate" in paths and "/demo" not in paths
        finally:
            await svc.stop()

    asyncio.run(go())
