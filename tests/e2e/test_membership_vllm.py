"""Membership while serving, with real vLLM: `duetime serve --config` (its own process) over
the e2e suite's `tiny-small` server; the pool file gains the `tiny-large` server, which joins
once its /health passes and serves its model, then loses it while a stream to it is open: the
stream ends whole, no later request reaches it, and it leaves. A broken file (and SIGHUP) is
refused with the pool kept.

The stream must still be open when the gateway sees the file change, on any machine: its length
comes from the decode speed measured on a first stream and the time the join took (the watch's
pick-up plus a probe), not from a fixed token count."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from typing import Any

import httpx
import pytest
import yaml

from .gateway_pool import pool_config, serve
from .test_gateway_vllm import GREEDY

pytestmark = pytest.mark.e2e


async def wait_for(cond: Any, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await cond():
            return True
        await asyncio.sleep(0.1)
    return False


def test_a_real_vllm_joins_serves_and_drains(vllm_pool, tmp_path):
    full = pool_config(vllm_pool, discovery={"watch_s": 0.2})
    one = {**full, "instances": [i for i in full["instances"] if i["name"] == "small"]}
    path = tmp_path / "pool.yaml"
    chat = {"model": "tiny-large", "messages": [{"role": "user", "content": "Tell a story."}],
            **GREEDY}

    def write(cfg: dict[str, Any]) -> None:
        tmp = tmp_path / "pool.yaml.tmp"
        tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
        tmp.replace(path)

    async def go(url: str, proc) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def phases() -> dict[str, str]:
                body = (await c.get("/duetime/instances")).json()
                return {i["name"]: i["phase"] for i in body["instances"]}

            out["before"] = (await c.post("/v1/chat/completions",
                                          json={**chat, "max_tokens": 4})).status_code
            write(full)
            joined_from = time.monotonic()
            out["joined"] = await wait_for(
                lambda: _is(phases, {"small": "serving", "large": "serving"}))
            out["join_s"] = time.monotonic() - joined_from
            served, per_token = await _timed_stream(c, {**chat, "max_tokens": 32})
            out["served"] = served
            # a stream to large, open when large is removed: long enough to outlast the pick-up
            # of the change many times over, at this machine's measured decode speed
            hold_s = max(5.0, 10 * out["join_s"])
            out["max_tokens"] = min(MAX_STREAM, max(48, math.ceil(hold_s / per_token)))
            events = []
            async with c.stream("POST", "/v1/chat/completions", json={
                    **chat, "max_tokens": out["max_tokens"], "stream": True,
                    "stream_options": {"include_usage": True}}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            write(one)
                            out["draining"] = await wait_for(
                                lambda: _is(phases, {"small": "serving",
                                                     "large": "draining"}), hold_s)
            out["stream"] = events
            out["left"] = await wait_for(lambda: _is(phases, {"small": "serving"}))
            after = await c.post("/v1/chat/completions", json={**chat, "max_tokens": 4})
            out["after"] = after.status_code
            path.write_text("instances: [")  # (broken YAML) and SIGHUP
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(1.0)
            metrics = (await c.get("/metrics")).text
            out["refused"] = 'duetime_config_reloads_total{outcome="refused"}' in metrics
            out["still"] = (await c.post("/v1/chat/completions", json={
                **chat, "model": "tiny-small", "max_tokens": 4})).status_code
        return out

    write(one)
    with serve(one, tmp_path) as (proc, url):
        out = asyncio.run(asyncio.wait_for(go(url, proc), 300))
    assert out["before"] == 404  # (no instance of tiny-large yet)
    assert out["joined"] and out["served"] == (200, "large")
    assert out["draining"] and out["left"], out
    events = out["stream"]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    assert json.loads(events[-2])["usage"]["completion_tokens"] == out["max_tokens"]
    assert out["after"] == 404  # (its model left with it)
    assert out["refused"] and out["still"] == 200


MAX_STREAM = 1800  # (output tokens: the servers' max_model_len is 2048)


async def _timed_stream(c: httpx.AsyncClient, body: dict[str, Any]) -> tuple[tuple[int, str | None],
                                                                           float]:
    """(status, instance) of a streamed chat and its seconds per output token after the first."""
    stamps: list[float] = []
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        head = (s.status_code, s.headers.get("x-duetime-instance"))
        async for line in s.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                stamps.append(time.monotonic())
    per_token = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) if len(stamps) > 1 else 0.01
    return head, max(per_token, 1e-4)


async def _is(phases, want: dict[str, str]) -> bool:
    return await phases() == want
