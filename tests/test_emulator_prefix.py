"""The emulator's prefix caching (vLLM's automatic prefix caching, on by default): prompts'
block keys, cache hits in time and in vLLM's metrics, the switch, and the version-2 snapshot.

Real servers (uvicorn on loopback) where first-token times are measured; in-process ASGI
otherwise. Hit counts are exact (whole blocks, all but the prompt's last token); times have
the generous bounds of tests/test_emulator.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest

from duetime import Snapshot
from duetime.cli import build_parser
from duetime.emulator import create_app, emulator_from_profile
from duetime.emulator.options import EmulatorOptions
from duetime.engine import forecast
from duetime.engine.profiles import load_profile
from duetime.web.prefix_keys import (
    chat_text,
    prompt_block_keys,
    text_block_keys,
    token_block_keys,
)
from duetime.web.requests import parse_completion
from duetime.web.server import AppServer
from duetime.web.tokens import chat_tokens

BS = 16
SLACK_S = 0.35


def run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (labels: a subset to match)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the exposition")


def hits(text: str) -> tuple[float, float]:
    return (metric(text, "vllm:prefix_cache_queries_total"),
            metric(text, "vllm:prefix_cache_hits_total"))


def expected_hit(keys: list[int], prompt_tokens: int) -> int:
    """Tokens a prompt finds cached when all its keyed blocks are: whole blocks, never its
    last token (vLLM computes that one again to sample from it)."""
    return min(len(keys), (prompt_tokens - 1) // BS) * BS


async def timed(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> float:
    """Seconds to the first content chunk of a streamed (chat) completion, read to the end."""
    t0 = time.perf_counter()
    first = None
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


def chat_body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 2, "ignore_eos": True}


def conversation() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A chat's first turn and its second (the answer and a new question appended)."""
    system = {"role": "system", "content": "".join(f"rule {i}: be brief. " for i in range(300))}
    turn1 = [system, {"role": "user", "content": "What is " + "very " * 200 + "long?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "tok tok "},
             {"role": "user", "content": "And " + "then " * 300 + "?"}]
    return turn1, turn2


# -- the block keys -------------------------------------------------------------------------------

def test_token_keys_are_chained_blake2b_int64_the_same_in_every_process():
    ids = list(range(40))
    keys = token_block_keys(ids, BS)
    assert keys == [7480080465343500204, -1736471361542835510]  # 2 full blocks; pinned values
    assert token_block_keys(ids[:32], BS) == keys and token_block_keys(ids[:31], BS) == keys[:1]
    assert token_block_keys(ids, BS, limit=1) == keys[:1]
    # a change in block 1 keeps block 0's key; a change in block 0 changes both (chained)
    assert token_block_keys([*ids[:20], 999, *ids[21:]], BS)[0] == keys[0]
    assert token_block_keys([*ids[:20], 999, *ids[21:]], BS)[1] != keys[1]
    changed = token_block_keys([999, *ids[1:]], BS)
    assert changed[0] != keys[0] and changed[1] != keys[1]
    assert token_block_keys([1 << 70] * 16, BS) != token_block_keys([0] * 16, BS)  # no overflow
    assert all(-(1 << 63) <= k < (1 << 63) for k in keys)


def test_text_keys_cut_64_characters_a_block():
    text = "abcdefgh" * 20  # 160 characters: 2 full blocks of 64
    keys = text_block_keys(text, BS)
    assert len(keys) == 2 and text_block_keys(text[:128], BS) == keys
    assert text_block_keys("a" * 64, BS) == [-4818445441216919585]  # pinned
    assert text_block_keys(text[:127], BS) == keys[:1]
    assert text_block_keys(text, BS) != token_block_keys([ord(ch) for ch in text], BS)


def test_prompt_keys_of_requests():
    ids = list(range(100, 200))
    as_ids = parse_completion(b'{"prompt": %s}' % str(ids).encode(), chat=False)
    nested = parse_completion(b'{"prompt": [%s]}' % str(ids).encode(), chat=False)
    assert prompt_block_keys(as_ids, BS) == prompt_block_keys(nested, BS) \
        == token_block_keys(ids, BS)
    text = "x" * 300
    req = parse_completion(b'{"prompt": "%s"}' % text.encode(), chat=False)
    one = parse_completion(b'{"prompt": ["%s"]}' % text.encode(), chat=False)
    assert prompt_block_keys(req, BS) == prompt_block_keys(one, BS) == text_block_keys(text, BS)
    salted = parse_completion(b'{"prompt": "%s", "cache_salt": "tenant-a"}' % text.encode(),
                              chat=False)
    assert len(prompt_block_keys(salted, BS)) == 4
    assert set(prompt_block_keys(salted, BS)).isdisjoint(prompt_block_keys(req, BS))
    # never more blocks than the prompt's estimated full blocks
    turn1, _ = conversation()
    chat = parse_completion(httpx.Request("POST", "/", json=chat_body(turn1)).read(), chat=True)
    keys = prompt_block_keys(chat, BS)
    assert keys == text_block_keys(chat_text(turn1), BS)
    assert 0 < len(keys) <= chat.prompt_tokens // BS


def test_a_conversations_next_turn_starts_with_the_same_blocks():
    turn1, turn2 = conversation()
    assert chat_text(turn2).startswith(chat_text(turn1))
    k1 = text_block_keys(chat_text(turn1), BS)
    k2 = text_block_keys(chat_text(turn2), BS)
    assert len(k2) > len(k1) > 10 and k2[:len(k1)] == k1


# -- caching in the emulator --------------------------------------------------------------------

def test_identical_token_prompts_hit_and_a_different_one_does_not():
    """The same 8000 token ids twice: the second computes one block (its last token's) and
    its first token comes at once; vLLM's counters say 7984 tokens were found cached. Other
    ids: no hit, a whole prefill."""
    prompt = list(range(8000))
    other = list(range(8000, 16000))

    async def go():
        emu = emulator_from_profile("qwen3-8b")
        server = await AppServer(create_app(emu)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                await c.get("/health")
                body = {"max_tokens": 2, "ignore_eos": True}
                uncached = forecast(emu.snapshot(), len(prompt)).estimate_s
                t = [await timed(c, "/v1/completions", {**body, "prompt": prompt})]
                m = [hits((await c.get("/metrics")).text)]
                t.append(await timed(c, "/v1/completions", {**body, "prompt": prompt}))
                m.append(hits((await c.get("/metrics")).text))
                t.append(await timed(c, "/v1/completions", {**body, "prompt": other}))
                m.append(hits((await c.get("/metrics")).text))
                cached = emu.engine.cached_blocks
            return uncached, t, m, cached
        finally:
            await server.stop()

    uncached, (t_a, t_b, t_c), m, cached = run(go())
    assert m == [(8000, 0), (16000, 7984), (24000, 7984)]
    assert 0.95 * uncached <= t_a <= uncached + SLACK_S
    assert 0.95 * uncached <= t_c <= uncached + SLACK_S
    assert t_b < 0.5 * t_a  # one block instead of 500 (~0.2 s at speed 1)
    assert cached >= 2 * 500  # both prompts' blocks stay cached (freed, not evicted)


def test_a_chat_and_its_next_turn_hit_the_cache():
    turn1, turn2 = conversation()
    p1, p2 = chat_tokens(turn1), chat_tokens(turn2)
    k1 = text_block_keys(chat_text(turn1), BS)

    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=2.0)
        server = await AppServer(create_app(emu)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                await c.get("/health")
                out = []
                for msgs in (turn1, turn1, turn2,
                             [{"role": "user", "content": "something else " * 200}]):
                    t = await timed(c, "/v1/chat/completions", chat_body(msgs))
                    out.append((t, hits((await c.get("/metrics")).text)))
            return out
        finally:
            await server.stop()

    (t1, m1), (t1b, m1b), (_, m2), (_, m3) = run(go())
    assert m1 == (p1, 0)
    assert m1b == (2 * p1, expected_hit(k1, p1))  # the same chat again
    assert m2 == (2 * p1 + p2, expected_hit(k1, p1) + len(k1) * BS)  # turn 1's blocks
    assert m3[1] == m2[1]  # another conversation: nothing shared
    assert t1b < t1


def test_kv_usage_counts_cached_free_blocks_as_free():
    async def go():
        emu = emulator_from_profile("qwen3-0.6b", speed=8.0)
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            r = await c.post("/v1/completions", json={"prompt": list(range(3200)),
                                                      "max_tokens": 2})
            assert r.status_code == 200
            text = (await c.get("/metrics")).text
        await emu.close()
        return emu.engine.cached_blocks, text

    cached, text = run(go())
    assert cached >= 200  # the prompt's 200 blocks stay cached, nobody holds them
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0


def test_cache_config_info_as_vllm_labels_it():
    async def go(on: bool):
        emu = emulator_from_profile("qwen3-32b", enable_prefix_caching=on)
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            text = (await c.get("/metrics")).text
        await emu.close()
        return text

    blocks = str(load_profile("qwen3-32b").config.num_gpu_blocks)
    for on in (True, False):
        text = run(go(on))
        assert metric(text, "vllm:cache_config_info", block_size="16", num_gpu_blocks=blocks,
                      enable_prefix_caching=str(on), engine="0") == 1.0
        assert "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of " \
               "number of queried tokens." in text
        assert "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number " \
               "of cached tokens." in text


def test_caching_off_never_hits_and_publishes_version_1():
    async def go():
        emu = emulator_from_profile("qwen3-0.6b", speed=8.0, enable_prefix_caching=False)
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            for _ in range(2):
                r = await c.post("/v1/completions", json={"prompt": list(range(2000)),
                                                          "max_tokens": 2})
                assert r.status_code == 200
            text = (await c.get("/metrics")).text
            snap = (await c.get("/snapshot")).json()
        await emu.close()
        return text, snap

    text, snap = run(go())
    assert hits(text) == (0, 0)
    assert metric(text, "vllm:cache_config_info", enable_prefix_caching="False") == 1.0
    assert snap["version"] == 1 and "prefix_cache" not in snap


def test_the_switch_in_the_cli_and_the_pool_options():
    parse = build_parser().parse_args
    assert parse(["emulate", "--profile", "qwen3-8b"]).enable_prefix_caching is True
    assert parse(["emulate", "--profile", "qwen3-8b", "--no-enable-prefix-caching"]) \
        .enable_prefix_caching is False
    assert parse(["emulate", "--profile", "qwen3-8b", "--enable-prefix-caching"]) \
        .enable_prefix_caching is True
    spec = load_profile("qwen3-0.6b")
    assert EmulatorOptions().emulator(spec, "m").config.enable_prefix_caching is True
    off = EmulatorOptions.model_validate({"enable_prefix_caching": False})
    assert off.emulator(spec, "m").config.enable_prefix_caching is False


def test_duetime_emulate_no_enable_prefix_caching():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "emulate", "--profile",
                             "qwen3-0.6b", "--port", "0", "--log-level", "warning",
                             "--no-enable-prefix-caching"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on " in line, proc.stderr.read() if proc.poll() is not None else line
        assert "prefix caching off" in line
        url = line.split("listening on ", 1)[1].split()[0]
        text = httpx.get(f"{url}/metrics", timeout=20).text
        assert metric(text, "vllm:cache_config_info", enable_prefix_caching="False") == 1.0
    finally:
        proc.kill()
        proc.wait()


# -- the snapshot -------------------------------------------------------------------------------

def test_snapshot_is_version_2_and_a_forecast_from_it_prices_the_cached_prefix():
    """After a request, its prompt's blocks are cached and free: the snapshot of version 2
    (``/snapshot?version=2``) lists them under the keys the emulator gave them,
    ``Snapshot.from_dict`` reads it, and a forecast of the same prompt with those keys is much
    shorter than without. A busy snapshot lists each resident request's keys. The default
    ``/snapshot`` (what the gateway polls) leaves the cache out: version 1."""
    prompt = list(range(5000, 9000))
    keys = token_block_keys(prompt, BS)

    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=4.0)
        server = await AppServer(create_app(emu)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200
                idle = (await c.get("/snapshot?version=2")).json()
                plain = (await c.get("/snapshot")).json()
                task = asyncio.create_task(c.post(
                    "/v1/completions", headers={"x-request-id": "busy"},
                    json={"prompt": [*prompt, *range(4000)], "max_tokens": 400,
                          "ignore_eos": True}))
                busy = None
                for _ in range(200):
                    await asyncio.sleep(0.01)
                    d = (await c.get("/snapshot?version=2")).json()
                    if any(q["id"] == "busy" for q in d["running"]):
                        busy = d
                        break
                task.cancel()
            return idle, plain, busy
        finally:
            await server.stop()

    idle, plain, busy = run(go())
    assert plain["version"] == 1 and plain["prefix_cache_omitted"] is True
    assert plain["config"]["enable_prefix_caching"] is False and "prefix_cache" not in plain
    Snapshot.from_dict(plain)
    assert idle["version"] == 2 and idle["config"]["enable_prefix_caching"] is True
    assert set(keys) <= set(idle["prefix_cache"]["cached_free"])
    snap = Snapshot.from_dict(idle)
    with_keys = forecast(snap, len(prompt), prompt_hashes=keys).estimate_s
    without = forecast(snap, len(prompt)).estimate_s
    assert with_keys < 0.2 * without
    assert busy is not None and busy["version"] == 2
    (req,) = [q for q in busy["running"] if q["id"] == "busy"]
    assert req["block_hashes"][:len(keys)] == keys  # its prompt's keys, then its own
    Snapshot.from_dict(busy)


@pytest.mark.parametrize("on", [True, False])
def test_emulator_from_options_in_a_pool_block(on):
    opts = EmulatorOptions.model_validate({"speed": 2.0, "enable_prefix_caching": on})
    emu = opts.emulator(load_profile("qwen3-8b"), "x")
    assert emu.caching is on and emu.engine.caching is on


def test_tokenize_placeholders_follow_the_text():
    """/tokenize's placeholder ids: the same text, the same ids; other text, other ids (a
    client that builds prompts from them, as `duetime calibrate` does, must not build the same
    prompt every time, or the cache would answer its prefill probes)."""
    async def go():
        emu = emulator_from_profile("qwen3-0.6b")
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            out = [(await c.post("/tokenize", json=body)).json() for body in (
                {"prompt": "the quick brown fox jumps over the lazy dog"},
                {"prompt": "the quick brown fox jumps over the lazy dog"},
                {"prompt": "grey northern skies and merchants counting"},
                {"prompt": [5, 6, 7]},
                {"messages": [{"role": "user", "content": "hello there"}]})]
        await emu.close()
        return out

    a, a2, b, ids, chat = run(go())
    assert a["tokens"] == a2["tokens"] and len(a["tokens"]) == a["count"] == 11
    assert len(set(a["tokens"])) >= 8 and a["tokens"] != b["tokens"]
    assert ids["tokens"] == [5, 6, 7]
    assert len(chat["tokens"]) == chat["count"] == 3 + 4 + 3
