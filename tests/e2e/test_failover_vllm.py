"""Mid-stream failover against a real vLLM server: the continuation request the gateway makes
(a chat's text as a final assistant message with ``continue_final_message``; a completion's
appended to its prompt) is accepted by vLLM 0.32, and the client reads one stream whose
length and usage are the unbroken answer's.

The pool has two instances of ``tiny-large``: ``cut`` reaches the server through a loopback
proxy that drops the connection after a few streamed events (an instance dying mid-stream),
``direct`` reaches it directly. Round-robin sends the first request to ``cut``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web

from .gateway_pool import instance_config, pool_config
from .test_gateway_vllm import GREEDY, TIMEOUT, running_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-large"
CUT_AFTER = 5  # events the proxy forwards of a stream before it drops the connection


class CuttingProxy:
    """An HTTP proxy to ``target`` on its own thread: streamed completions are cut after
    :data:`CUT_AFTER` events; everything else passes."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.cut = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", "x-request-id")}
        async with self.session.request(request.method, self.target + request.path_qs,
                                        data=body, headers=headers) as up:
            streamed = up.headers.get("content-type", "").startswith("text/event-stream")
            if not streamed:
                return web.Response(body=await up.read(), status=up.status,
                                    content_type=up.content_type)
            resp = web.StreamResponse(status=up.status,
                                      headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            buf, events = b"", 0
            async for chunk in up.content.iter_any():
                buf += chunk
                while b"\n\n" in buf and events < CUT_AFTER:
                    ev, buf = buf.split(b"\n\n", 1)
                    await resp.write(ev + b"\n\n")
                    events += 1
                if events >= CUT_AFTER:
                    self.cut += 1
                    assert request.transport is not None
                    request.transport.abort()  # (the instance died mid-stream)
                    return resp
            await resp.write_eof()
            return resp

    def close(self) -> None:
        async def stop() -> None:
            await self.session.close()
            await self.runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def setup(vllm_pool) -> Iterator[tuple[Any, CuttingProxy, str]]:
    server = next(s for s in vllm_pool if s.name == MODEL)
    proxy = CuttingProxy(server.base_url)
    cfg = pool_config([server], policy="round-robin", instances=[
        instance_config(server, "cut", url=proxy.url, kv_events=None),
        instance_config(server, "direct", kv_events=None)])
    try:
        with running_gateway(cfg) as gw:
            yield server, proxy, gw.url
    finally:
        proxy.close()


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The response headers and the stream's data lines."""
    with httpx.Client(timeout=TIMEOUT) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        return dict(r.headers), [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def answer(lines: list[str], chat: bool) -> tuple[str, set[str], dict[str, Any] | None]:
    """The text, the chunk ids and the usage of a stream's data lines."""
    text, ids, usage = [], set(), None
    for ln in lines[:-1]:
        ch = json.loads(ln)
        assert "error" not in ch, ch
        ids.add(ch["id"])
        usage = ch.get("usage") or usage
        for c in ch["choices"]:
            text.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(text), ids, usage


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_a_stream_cut_mid_way_continues_on_real_vllm(setup, chat):
    server, proxy, url = setup
    path = "/v1/chat/completions" if chat else "/v1/completions"
    ask = ({"messages": [{"role": "user", "content": "Tell me a story about a cat."}]}
           if chat else {"prompt": "Once upon a time, a cat"})
    body = {**ask, "max_tokens": 24, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True}}
    cuts = proxy.cut
    headers, lines = stream(url, path, {**body, "model": MODEL})
    assert headers["x-duetime-instance"] == "cut" and proxy.cut == cuts + 1
    _, whole = stream(server.base_url, path, {**body, "model": MODEL})  # (unbroken)
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    text, ids, usage = answer(lines, chat)
    want, _, want_usage = answer(whole, chat)
    assert len(ids) == 1 and usage is not None and want_usage is not None
    # one answer of the length asked, counted over the prompt vLLM saw
    assert usage["completion_tokens"] == want_usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
    # the events before the cut are the unbroken answer's (greedy): the rest continues them
    # (random weights: a continuation of re-tokenized text need not pick the same tokens)
    head, _, _ = answer([*lines[:CUT_AFTER], "[DONE]"], chat)
    assert head and want.startswith(head) and text.startswith(head)
