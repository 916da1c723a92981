"""The emulator's LoRA adapters, as vLLM 0.32 serves them with ``--enable-lora``: the flags,
adapters as models (``/v1/models``, requests by name), runtime loading and unloading,
``vllm:lora_requests_info``, block keys per adapter, and the engine's ``max_loras`` rule.

Real servers (uvicorn on loopback, port 0) where streams matter; in-process ASGI otherwise.
Scheduling is asserted on the order of the engine's own times (each request's first-token and
finish times as the emulator records them), never on wall-clock durations.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from duetime import Snapshot
from duetime.cli import build_parser, main
from duetime.emulator import Emulator, EmuRequest, create_app
from duetime.emulator.core import LoraModule, parse_lora_module
from duetime.engine.profiles import load_profile
from duetime.web.server import AppServer

BASE = "base-model"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def lora_emulator(max_loras: int = 1, *, speed: float = 1.0,
                  modules: tuple[LoraModule, ...] = (LoraModule("A", "/adapters/a"),
                                                     LoraModule("B", "/adapters/b", "other")),
                  ) -> Emulator:
    """A qwen3-0.6b emulator with LoRA on and adapters A (id 1) and B (id 2)."""
    p = load_profile("qwen3-0.6b")
    return Emulator(p.batch_time, p.config, model_name=BASE, speed=speed,
                    max_loras=max_loras, lora_modules=modules)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://emu",
                             timeout=20)


def metric_lines(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def recording(emu: Emulator) -> dict[str, EmuRequest]:
    """The emulator's requests by id as they are submitted (their engine times stay readable
    after they finish)."""
    seen: dict[str, EmuRequest] = {}
    submit = emu.submit

    def spy(*args: Any, **kwargs: Any) -> EmuRequest:
        r = submit(*args, **kwargs)
        seen[r.id] = r
        return r
    emu.submit = spy  # type: ignore[method-assign]
    return seen


async def until(cond: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    """Wait (polling the loop) until ``cond()``; the limit only bounds a broken run."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


# -- the flags ------------------------------------------------------------------------------------

def test_lora_modules_parse_both_of_vllms_forms():
    assert parse_lora_module("a=/x/y") == LoraModule("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == \
        LoraModule("b", "/p", "m")
    for bad in ("=/x", "a=", "{not json", '{"name": "b"}', '{"name": "b", "path": "/p", '
                '"rank": 8}'):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    args = build_parser().parse_args(
        ["emulate", "--profile", "qwen3-0.6b", "--enable-lora", "--lora-modules", "a=/x",
         '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z"])
    assert [m.name for m in args.lora_modules] == ["a", "b", "c"]
    assert args.max_loras == 1 and args.max_cpu_loras is None  # vLLM's defaults


@pytest.mark.parametrize(("argv", "start"), [
    (["--lora-modules", "a=/x"], "duetime: error: --lora-modules:"),
    (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"],
     "duetime: error: --max-cpu-loras:"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "duetime: error: --lora-modules:"),
    (["--enable-lora", "--lora-modules", "{oops"], "duetime: error: argument --lora-modules:"),
])
def test_emulate_lora_cli_errors_are_one_line(capsys, argv, start):
    assert main(["emulate", "--profile", "qwen3-0.6b", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1, err


def test_duetime_emulate_serves_its_lora_modules():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "duetime", "emulate", "--profile", "qwen3-0.6b", "--port", "0",
         "--log-level", "warning", "--model-name", BASE, "--enable-lora", "--max-loras", "2",
         "--max-cpu-loras", "4", "--lora-modules", "sql=/w/sql",
         '{"name": "chat", "path": "/w/chat", "base_model_name": "org/base"}'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split("listening on ", 1)[1].split()[0]
        models = httpx.get(f"{url}/v1/models", timeout=20).json()["data"]
        loaded = httpx.post(f"{url}{LOAD}", json={"lora_name": "new", "lora_path": "/w/new"},
                            timeout=20)
        done = httpx.post(f"{url}/v1/completions", timeout=20,
                          json={"model": "chat", "prompt": "hi", "max_tokens": 2})
        text = httpx.get(f"{url}/metrics", timeout=20).text
    finally:
        proc.kill()
        proc.wait()
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        (BASE, BASE, None), ("sql", "/w/sql", BASE), ("chat", "/w/chat", "org/base")]
    assert loaded.status_code == 200  # the environment variable opened the runtime routes
    assert done.status_code == 200 and done.json()["model"] == "chat"
    ((labels, _),) = metric_lines(text, "vllm:lora_requests_info")
    assert labels["max_lora"] == "2"


# -- adapters as models ---------------------------------------------------------------------------

def test_models_list_adapters_and_requests_run_on_them():
    async def go():
        emu = lora_emulator()
        seen = recording(emu)
        async with client(create_app(emu)) as c:
            models = (await c.get("/v1/models")).json()["data"]
            on_a = await c.post("/v1/chat/completions", headers={"x-request-id": "on-a"}, json={
                "model": "A", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3})
            on_b = await c.post("/v1/completions", headers={"x-request-id": "on-b"},
                                json={"model": "B", "prompt": "hi", "max_tokens": 3,
                                      "stream": True})
            on_base = await c.post("/v1/completions", headers={"x-request-id": "on-base"},
                                   json={"model": BASE, "prompt": "hi", "max_tokens": 3})
            unknown = await c.post("/v1/completions",
                                   json={"model": "C", "prompt": "hi", "max_tokens": 3})
        await emu.close()
        return models, on_a, on_b, on_base, unknown, seen

    models, on_a, on_b, on_base, unknown, seen = run(go())
    assert [m["object"] for m in models] == ["model"] * 3
    assert [(m["id"], m.get("root"), m.get("parent")) for m in models] == [
        (BASE, BASE, None), ("A", "/adapters/a", BASE), ("B", "/adapters/b", "other")]
    assert on_a.status_code == 200 and on_a.json()["model"] == "A"  # vLLM names the adapter
    assert on_b.status_code == 200
    chunks = [json.loads(x[6:]) for x in on_b.text.splitlines()
              if x.startswith("data: {")]
    assert chunks and {ch["model"] for ch in chunks} == {"B"}
    assert on_base.status_code == 200 and on_base.json()["model"] == BASE
    # each ran on its adapter's id in the engine (vLLM's lora_int_id, in load order)
    assert [(seen[r].lora, seen[r].lora_id) for r in ("on-a", "on-b", "on-base")] == [
        ("A", 1), ("B", 2), (None, 0)]
    assert unknown.status_code == 404
    err = unknown.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == "The model `C` does not exist."


def test_an_adapter_name_is_a_404_without_lora():
    async def go():
        p = load_profile("qwen3-0.6b")
        emu = Emulator(p.batch_time, p.config, model_name=BASE)
        async with client(create_app(emu, allow_runtime_lora_updating=True)) as c:
            models = (await c.get("/v1/models")).json()["data"]
            r = await c.post("/v1/completions", json={"model": "A", "prompt": "x"})
            load = await c.post(LOAD, json={"lora_name": "A", "lora_path": "/a"})
            text = (await c.get("/metrics")).text
        await emu.close()
        return models, r, load, text

    models, r, load, text = run(go())
    assert [m["id"] for m in models] == [BASE]
    assert r.status_code == 404
    assert load.status_code == 400 and "not enabled" in load.json()["error"]["message"]
    assert "vllm:lora_requests_info" not in text  # only with LoRA on, as vLLM


# -- runtime updates ------------------------------------------------------------------------------

def test_runtime_load_and_unload_as_vllm():
    async def go():
        emu = lora_emulator()
        out: dict[str, httpx.Response] = {}
        async with client(create_app(emu, allow_runtime_lora_updating=True)) as c:
            out["load"] = await c.post(LOAD, json={"lora_name": "C", "lora_path": "/c"})
            out["models"] = await c.get("/v1/models")
            out["on_c"] = await c.post("/v1/completions",
                                       json={"model": "C", "prompt": "x", "max_tokens": 2})
            out["again"] = await c.post(LOAD, json={"lora_name": "C", "lora_path": "/c2"})
            out["inplace"] = await c.post(LOAD, json={"lora_name": "C", "lora_path": "/c2",
                                                      "load_inplace": True})
            ids = {"C": emu.adapters.get("C").id}
            out["no_path"] = await c.post(LOAD, json={"lora_name": "D"})
            out["unload"] = await c.post(UNLOAD, json={"lora_name": "C", "lora_int_id": 4})
            out["gone"] = await c.post("/v1/completions",
                                       json={"model": "C", "prompt": "x", "max_tokens": 2})
            out["unload_again"] = await c.post(UNLOAD, json={"lora_name": "C"})
            out["load_d"] = await c.post(LOAD, json={"lora_name": "D", "lora_path": "/d"})
            ids["D"] = emu.adapters.get("D").id
            out["models_after"] = await c.get("/v1/models")
        await emu.close()
        return out, ids

    out, ids = run(go())
    assert out["load"].status_code == 200
    assert out["load"].text == "Success: LoRA adapter 'C' added successfully."
    assert ("C", "/c", BASE) in [(m["id"], m["root"], m["parent"])
                                 for m in out["models"].json()["data"]]
    assert out["on_c"].status_code == 200 and out["on_c"].json()["model"] == "C"
    assert out["again"].status_code == 400
    assert "already been loaded" in out["again"].json()["error"]["message"]
    assert out["inplace"].status_code == 200
    assert ids["C"] == 4  # A 1, B 2, C 3, C in place 4: ids are never reused
    assert out["no_path"].status_code == 400
    assert out["unload"].status_code == 200
    assert out["unload"].text == "Success: LoRA adapter 'C' removed successfully."
    assert out["gone"].status_code == 404
    assert out["unload_again"].status_code == 404
    err = out["unload_again"].json()["error"]
    assert err["code"] == 404 and err["type"] == "NotFoundError" and "'C'" in err["message"]
    assert ids["D"] == 5
    assert [m["id"] for m in out["models_after"].json()["data"]] == [BASE, "A", "B", "D"]


@pytest.mark.parametrize(("flag", "env", "served"), [
    (None, None, False), (None, "1", True), (None, "TRUE", True), (None, "0", False),
    (False, "1", False), (True, None, True)])
def test_runtime_routes_exist_only_when_allowed(monkeypatch, flag, env, served):
    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)

    async def go():
        emu = lora_emulator()
        async with client(create_app(emu, allow_runtime_lora_updating=flag)) as c:
            load = await c.post(LOAD, json={"lora_name": "C", "lora_path": "/c"})
            unload = await c.post(UNLOAD, json={"lora_name": "A"})
        await emu.close()
        return load, unload, [a.name for a in emu.adapters]

    load, unload, names = run(go())
    if served:
        assert (load.status_code, unload.status_code) == (200, 200)
        assert names == ["B", "C"]
    else:
        assert (load.status_code, unload.status_code) == (404, 404)
        assert names == ["A", "B"]


# -- prefix caching per adapter -------------------------------------------------------------------

def test_a_prompt_cached_under_an_adapter_misses_under_another_and_the_base():
    prompt = [11] * 640  # 40 full blocks

    async def go():
        emu = lora_emulator(max_loras=2)
        hits = []
        async with client(create_app(emu)) as c:
            for model in ("A", "A", "B", BASE, "B", "A"):
                r = await c.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                          "max_tokens": 2})
                assert r.status_code == 200
                hits.append(emu.engine.prefix_hits)
            text = (await c.get("/metrics")).text
        await emu.close()
        return hits, text

    hits, text = run(go())
    gained = [b - a for a, b in zip([0, *hits], hits, strict=False)]
    whole = 640 - 16  # all the blocks but the one holding the prompt's last token
    assert gained == [0, whole, 0, 0, whole, whole]
    assert f'vllm:prefix_cache_hits_total{{model_name="{BASE}"}} {3 * whole}.0' in text


def test_block_keys_carry_the_adapter_name():
    emu = lora_emulator()
    a, b = emu.adapters.get("A"), emu.adapters.get("B")
    keys = [5, -7, 2**62]
    assert a.keyed(keys) == a.keyed(keys)  # the same adapter, the same prefix: shared
    assert a.keyed(keys)[:2] == a.keyed(keys[:2])  # the prefix property holds
    assert set(a.keyed(keys)).isdisjoint(keys) and set(a.keyed(keys)).isdisjoint(b.keyed(keys))
    assert all(-2**63 <= k < 2**63 for k in a.keyed(keys))


# -- the max_loras rule, vllm:lora_requests_info and the snapshot ---------------------------------

def test_lora_requests_info_names_running_and_waiting_adapters():
    """max_loras 2: two requests on A and one on B run, C's waits (skipped). As on vLLM 0.32
    (whose ``LoRARequestStates`` fills both label lists from one table), both lists name the
    adapters of the requests that have been scheduled, once, in the order they arrived: C,
    never scheduled yet, is in neither."""
    async def go():
        emu = lora_emulator(max_loras=2, modules=(LoraModule("A", "/a"), LoraModule("B", "/b"),
                                                  LoraModule("C", "/c")))
        app = create_app(emu)
        ads = {n: emu.adapters.get(n) for n in "ABC"}
        async with client(app) as c:
            idle = (await c.get("/metrics")).text
            for rid, name in (("a1", "A"), ("b1", "B"), ("a2", "A"), ("c1", "C"), ("x", None)):
                emu.submit(100, max_tokens=5000, ignore_eos=True, request_id=rid,
                           adapter=ads[name] if name else None)
            await until(lambda: emu.engine.num_running == 4, "four requests running")
            before = time.time()
            busy = (await c.get("/metrics")).text
            after = time.time()
            snap = (await c.get("/snapshot")).json()
        await emu.close()
        return idle, busy, before, after, snap

    idle, busy, before, after, snap = run(go())
    ((labels, _),) = metric_lines(idle, "vllm:lora_requests_info")
    assert labels == {"max_lora": "2", "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}
    ((labels, value),) = metric_lines(busy, "vllm:lora_requests_info")
    assert labels == {"max_lora": "2", "running_lora_adapters": "A,B",
                      "waiting_lora_adapters": "A,B"}
    assert before <= value <= after  # vLLM's set_to_current_time()
    # the snapshot the gateway polls: version 3, each request's adapter id
    assert snap["version"] == 3 and snap["config"]["max_loras"] == 2
    s = Snapshot.from_dict(snap)
    assert sorted((r.id, r.lora) for r in s.running) == [("a1", 1), ("a2", 1), ("b1", 2),
                                                         ("x", 0)]
    assert [(r.id, r.lora) for r in s.waiting] == [("c1", 3)]


async def _stream(c: httpx.AsyncClient, rid: str, model: str, max_tokens: int,
                  firsts: dict[str, int]) -> None:
    """Stream a completion on ``model``; ``firsts[rid]``: the content chunks seen so far."""
    body = {"model": model, "prompt": f"request {rid} " * 8, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body,
                        headers={"x-request-id": rid}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                firsts[rid] = firsts.get(rid, 0) + 1


@pytest.fixture(scope="module")
def blocked_b() -> dict[str, Any]:
    """max_loras 1: a long request on A runs; B and a second request on A are sent together
    (B first). Recorded: the engine's times of every request, and what the client saw while
    B waited (after the second A finished and A's long one made 20 more tokens)."""
    async def go():
        emu = lora_emulator(max_loras=1)
        seen = recording(emu)
        server = await AppServer(create_app(emu)).start()
        chunks: dict[str, int] = {}
        out: dict[str, Any] = {"emu": emu, "seen": seen}
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                # A long enough that the rest happens while it runs: 2,000 tokens is about
                # 5 s of engine steps at speed 1 (sped up below, once the checks are done)
                long_a = asyncio.create_task(_stream(c, "a-long", "A", 2000, chunks))
                await until(lambda: chunks.get("a-long", 0) > 0, "a-long's first token")
                b = asyncio.create_task(_stream(c, "b", "B", 4, chunks))
                await until(lambda: "b" in seen, "b submitted")
                await _stream(c, "a2", "A", 4, chunks)
                assert not long_a.done(), "A's long request ended too soon for this test"
                n = chunks["a-long"]
                await until(lambda: chunks["a-long"] >= n + 20, "20 more steps of a-long")
                out["b_chunks_while_a_runs"] = chunks.get("b", 0)
                out["waiting"] = emu.engine.waiting_ids()
                out["metrics"] = (await c.get("/metrics")).text
                emu.set_speed(200.0)  # let A finish, quickly
                await long_a
                await b
        finally:
            await server.stop()
        return out

    return run(go())


def test_max_loras_holds_another_adapter_until_the_running_one_finishes(blocked_b):
    seen = blocked_b["seen"]
    a_long, b, a2 = seen["a-long"], seen["b"], seen["a2"]
    assert (a_long.lora_id, b.lora_id, a2.lora_id) == (1, 2, 1)
    # B, ahead of the second A in the queue, waited there while A ran
    assert blocked_b["b_chunks_while_a_runs"] == 0 and blocked_b["waiting"] == ["b"]
    assert a_long.produced == 2000 and b.produced == 4 and not a_long.aborted
    # the engine's times: the second A ran beside the first; B only once the first ended
    assert a2.arrival > b.arrival
    assert a2.first_token_time < a2.finish_time < a_long.finish_time <= b.first_token_time


def test_lora_requests_info_while_an_adapter_waits(blocked_b):
    ((labels, value),) = metric_lines(blocked_b["metrics"], "vllm:lora_requests_info")
    assert labels == {"max_lora": "1", "running_lora_adapters": "A",
                      "waiting_lora_adapters": "A"}
    assert value > 1.6e9  # a Unix time


def test_the_light_snapshot_of_a_caching_lora_emulator_is_version_3_without_the_cache():
    async def go():
        emu = lora_emulator()
        async with client(create_app(emu)) as c:
            r = await c.post("/v1/completions", json={"model": "A", "prompt": [3] * 320,
                                                      "max_tokens": 2})
            assert r.status_code == 200
            light = (await c.get("/snapshot")).json()
            full = (await c.get("/snapshot?version=2")).json()
        await emu.close()
        return light, full

    light, full = run(go())
    assert light["version"] == 3 and light["prefix_cache_omitted"] is True
    assert light["config"]["enable_prefix_caching"] is False and "prefix_cache" not in light
    assert full["version"] == 3 and full["config"]["enable_prefix_caching"] is True
    assert full["prefix_cache"]["cached_free"]  # the finished request's blocks, cached
    for d in (light, full):
        assert Snapshot.from_dict(d).config.max_loras == 1
