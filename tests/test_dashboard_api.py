"""The explanation API and the dashboard's data: ``POST /duetime/route`` (a dry run),
``x-duetime-explain``, ``x-duetime-policy`` / ``x-duetime-lambda``, ``GET /duetime/dashboard``
and its event stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from test_gateway import config, gateway, run

CHAT = {"model": "auto", "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 4}


def decisions(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("duetime_decisions_total{"))


def test_a_dry_run_explains_the_choice_and_sends_nothing():
    async def go():
        async with gateway(config()) as (_svc, c):
            before = decisions((await c.get("/metrics")).text)
            r = await c.post("/duetime/route", json=CHAT, headers={"x-duetime-ttft-ms": "5000"})
            assert r.status_code == 200, r.text
            e = r.json()
            assert e["policy"] == "sfs" and e["admission"] == "on_time"
            assert e["request_target_ms"] == 5000
            assert {c_["instance"] for c_ in e["candidates"]} == {"a", "b"}
            chosen = [c_ for c_ in e["candidates"] if c_["chosen"]]
            assert len(chosen) == 1 and chosen[0]["instance"] == e["chosen"]
            for c_ in e["candidates"]:
                # (the target the policy saw: what is left of it after the gateway's own time)
                assert 4900 < c_["target_ms"] <= 5000 and c_["feasible"] is True
                assert c_["forecast_ttft_ms"] > 0 and c_["cost"] > 0
                assert c_["quality"] in (0.5, 0.9) or 0 < c_["quality"] < 1
            # sfs at a loose target: the best utility (a: quality 0.9 vs 0.5 at one price)
            assert e["chosen"] == "a" and "meets the target" in e["rule"]
            # a text completion too, and a tight target changes the verdict
            r = await c.post("/duetime/route", json={"model": "small", "prompt": "hi"},
                             headers={"x-duetime-ttft-ms": "0.001"})
            e = r.json()
            assert [c_["instance"] for c_ in e["candidates"]] == ["b"]
            assert e["admission"] == "late" and e["candidates"][0]["feasible"] is False
            assert "least forecast" in e["rule"]
            # nothing was dispatched
            assert decisions((await c.get("/metrics")).text) == before
            inst = (await c.get("/duetime/instances")).json()["instances"]
            assert all(i["in_flight"] == 0 for i in inst)
    run(go())


def test_dry_runs_leave_a_stateful_policy_where_it_was():
    async def go():
        async with gateway(config()) as (_svc, c):
            rr = {"x-duetime-policy": "round-robin"}
            first = (await c.post("/duetime/route", json=CHAT, headers=rr)).json()["chosen"]
            for _ in range(3):  # previews do not turn the cursor
                assert (await c.post("/duetime/route", json=CHAT, headers=rr)
                        ).json()["chosen"] == first
            served = []
            for _ in range(3):
                r = await c.post("/v1/chat/completions", json=CHAT, headers=rr)
                served.append(r.headers["x-duetime-instance"])
            assert served[0] == first and served[1] != first and served[2] == first
            e = (await c.post("/duetime/route", json=CHAT, headers=rr)).json()
            assert e["policy"] == "round-robin" and e["chosen"] != first
            assert all(c_["forecast_ttft_ms"] is None and c_["score"] is None
                       for c_ in e["candidates"])
    run(go())


def test_a_real_request_carries_its_explanation_when_asked():
    async def go():
        async with gateway(config()) as (_svc, c):
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert "x-duetime-explain" not in r.headers
            for stream in (False, True):
                r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                                 headers={"x-duetime-explain": "1",
                                          "x-duetime-policy": "latency-agnostic",
                                          "x-duetime-lambda": "0",
                                          "x-duetime-task": "chat"})
                assert r.status_code == 200
                e = json.loads(r.headers["x-duetime-explain"])
                assert e["policy"] == "latency-agnostic"
                assert e["chosen"] == r.headers["x-duetime-instance"] == "a"
                assert e["score"] == "utility"
                util = {c_["instance"]: c_["utility"] for c_ in e["candidates"]}
                # lambda 0: the utility is the task's quality itself
                assert util == {"a": 0.9, "b": 0.5}
    run(go())


def test_bad_policy_headers_are_400s():
    async def go():
        async with gateway(config()) as (_svc, c):
            for h, param in (({"x-duetime-policy": "fastest"}, "x-duetime-policy"),
                             ({"x-duetime-lambda": "-1"}, "x-duetime-lambda"),
                             ({"x-duetime-lambda": "nan"}, "x-duetime-lambda")):
                for path in ("/v1/chat/completions", "/duetime/route"):
                    r = await c.post(path, json=CHAT, headers=h)
                    assert r.status_code == 400, (path, h)
                    err = r.json()["error"]
                    assert err["param"] == param and err["code"] == "invalid_header"
            r = await c.post("/duetime/route", content=b"{not json")
            assert r.status_code == 400 and "error" in r.json()
            r = await c.post("/duetime/route", json={**CHAT, "model": "nope"})
            assert r.status_code == 404
    run(go())


def test_the_dashboard_state_follows_the_traffic():
    async def go():
        async with gateway(config()) as (_svc, c):
            empty = (await c.get("/duetime/dashboard")).json()
            assert [i["name"] for i in empty["instances"]] == ["a", "b"]
            assert sum(empty["series"]["requests"]) == 0 and empty["decisions"] == []
            assert all(i["probe_ttft_ms"] > 0 for i in empty["instances"])
            await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT)
                                   for _ in range(6)))
            s = (await c.get("/duetime/dashboard")).json()
            assert sum(s["series"]["requests"]) == 6
            assert sum(sum(v) for v in s["series"]["decisions"].values()) == 6
            assert any(x is not None for x in s["series"]["ttft_p50_ms"])
            assert len(s["decisions"]) == 6
            assert all(d["ttft_ms"] > 0 and d["forecast_ms"] > 0 for d in s["decisions"])
            assert sum(i["first_tokens_1m"] for i in s["instances"]) == 6
            assert all(i["on_time_1m"] is None or 0 <= i["on_time_1m"] <= 1
                       for i in s["instances"])
            # nobody watched: no decision was explained
            assert not any(d["explained"] for d in s["decisions"]) and s["explained"] == []
    run(go())


def test_the_event_stream_updates_explains_while_watched_and_ends_on_stop():
    async def go():
        svc_cm = gateway(config())
        svc, c = await svc_cm.__aenter__()
        try:
            bad = await c.get("/duetime/dashboard/events?interval=0")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval"
            events: list[dict] = []

            async def watch():
                async with c.stream("GET", "/duetime/dashboard/events?interval=0.2") as r:
                    assert r.headers["content-type"].startswith("text/event-stream")
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(json.loads(line[6:]))
            watcher = asyncio.create_task(watch())
            while not events:
                await asyncio.sleep(0.05)
            for _ in range(3):
                await c.post("/v1/chat/completions", json=CHAT)
                await asyncio.sleep(0.3)
            n = len(events)
            while len(events) < n + 2:  # later updates carry the decisions
                await asyncio.sleep(0.05)
            last = events[-1]
            assert len(last["decisions"]) == 3
            explained = last["explained"]  # (one each 2 s at most, with its numbers)
            assert explained and all(d["explanation"]["chosen"] == d["instance"]
                                     for d in explained)
            flagged = {d["id"] for d in last["decisions"] if d["explained"]}
            assert flagged <= {d["id"] for d in explained}
            assert all("explanation" not in d for d in last["decisions"])
            # the server stops with the stream open: the stream ends, nothing is cut
            cut = await asyncio.wait_for(svc.stop(), 20)
            assert cut == 0
            await asyncio.wait_for(watcher, 10)
        finally:
            await c.aclose()
            await svc.stop()
    run(go(), timeout=60)


def test_pages_are_served_with_their_assets():
    async def go():
        async with gateway(config()) as (_svc, c):
            for path in ("/dashboard", "/playground"):
                r = await c.get(path)
                assert r.status_code == 200 and r.headers["content-type"].startswith(
                    "text/html") and "/static/duetime.js" in r.text
            r = await c.get("/static/vendor/uPlot.iife.min.js")
            assert r.status_code == 200 and len(r.content) > 40_000
            assert (await c.get("/static/vendor/uPlot.LICENSE")).text.startswith(
                "The MIT License")
            r = await c.get("/", follow_redirects=False)
            assert r.status_code == 307 and r.headers["location"] == "/dashboard"
            assert (await c.get("/static/nope.js")).status_code == 404
    run(go())




def test_the_explanation_header_keeps_the_chosen_and_the_best_within_its_size():
    from duetime.gateway.routing.explain_header import EXPLAIN_HEADER_BYTES, explain_header

    cands = [{"instance": f"i{k}", "chosen": k == 7, "score": float(k), "utility": None,
              "pad": "x" * 100} for k in range(300)]
    e = {"policy": "p", "chosen": "i7", "better": "higher", "candidates": cands}
    (name, raw), = explain_header(e)
    got = json.loads(raw)
    assert name == b"x-duetime-explain" and len(raw) <= EXPLAIN_HEADER_BYTES
    kept = [c["instance"] for c in got["candidates"]]
    assert kept[0] == "i7" and kept[1:4] == ["i299", "i298", "i297"]
    assert got["truncated"] == 300 - len(kept)
    lower = json.loads(explain_header({**e, "better": "lower"})[0][1])
    assert [c["instance"] for c in lower["candidates"]][:3] == ["i7", "i0", "i1"]
    small = {**e, "candidates": cands[:3]}
    assert json.loads(explain_header(small)[0][1]) == small  # (whole when it fits)


def test_each_instance_minute_forgets_without_a_reader():
    from duetime.gateway.observe.observatory import Observatory

    obs = Observatory(["a"])
    for k in range(1000):  # ten minutes at 100 first tokens a minute, never read
        obs.record_first_token(f"f{k}", "a", 0.1, 0.2 if k % 2 else 0.05, 0.1, 0.1, k * 0.6)
    m = obs.minutes["a"]
    assert len(m.firsts) <= 101 and len(m.errors) == len(m.firsts)
    read = obs.minute("a", 999 * 0.6)
    assert read["first_tokens_1m"] == len(m.firsts)
    assert read["on_time_1m"] == pytest.approx(0.5, abs=0.02)
    assert read["forecast_error_1m"] == 0.0


def test_the_latest_explanations_outlive_the_latest_decisions():
    """At a high rate an explained decision leaves the latest 20 within a second: the
    explained ones are kept apart, so that each reaches the dashboard."""
    from duetime.gateway.observe.observatory import DecisionRecord, Observatory

    obs = Observatory(["a"])
    for k in range(100):
        obs.record_decision(DecisionRecord(f"d{k}", 1000.0 + k / 100, "a", "m", "sfs", 1.0, 100.0, 1,
                             {"chosen": "a"} if k in (10, 40) else None), k / 100)
    assert [d.id for d in obs.explained] == ["d10", "d40"]
    assert "d10" not in {d.id for d in obs.recent} and len(obs.recent) == 50
