"""`duetime epp` behind a real Envoy (docs/envoy/envoy-epp.yaml) over the e2e suite's real vLLM
servers: streamed and plain chats and completions are routed by the picker, relayed by Envoy
and answered by vLLM, with the picker's headers; bad input is the picker's answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from test_envoy import behind_envoy
from test_epp import wait_for

from .gateway_pool import pool_config
from .test_gateway_vllm import GREEDY

pytestmark = pytest.mark.e2e


def test_real_vllm_answers_through_envoy_and_the_picker(vllm_pool, tmp_path):
    cfg = pool_config(vllm_pool)
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, **GREEDY}

    async def go() -> tuple[Any, ...]:
        async with behind_envoy(tmp_path, cfg=cfg) as (svc, _, c):
            plain = await c.post("/v1/chat/completions", json={**chat, "model": "auto"})
            named = await c.post("/v1/completions", json={
                "model": "tiny-small", "prompt": "Once upon a time", "max_tokens": 6, **GREEDY})
            lines = []
            async with c.stream("POST", "/v1/chat/completions", json={
                    **chat, "model": "auto", "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                streamed = r
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
            bad = await c.post("/v1/chat/completions", json={"model": "auto", "messages": []})
            ended = await wait_for(lambda: not any(s.flights
                                                     for s in svc.gateway.instances))
            return plain, named, streamed, lines, bad, ended

    plain, named, streamed, lines, bad, ended = asyncio.run(asyncio.wait_for(go(), 300))
    assert plain.status_code == 200, plain.text[:300]
    inst = plain.headers["x-duetime-instance"]
    assert plain.headers["server"] == "envoy" and inst in ("small", "large")
    body = plain.json()
    assert body["model"] == plain.headers["x-duetime-model"]  # (auto rewritten: vLLM's name)
    assert body["usage"]["completion_tokens"] == 8
    assert named.status_code == 200 and named.headers["x-duetime-instance"] == "small"
    assert named.json()["usage"]["completion_tokens"] == 6
    assert streamed.status_code == 200 and lines[-1] == "[DONE]"
    usage = json.loads(lines[-2])["usage"]
    assert usage["completion_tokens"] == 8
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
    assert ended
