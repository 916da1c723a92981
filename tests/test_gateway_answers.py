"""Complete OpenAI answers for non-streaming clients, without vLLM.

The gateway streams from upstream and merges the chunks (:mod:`duetime.gateway.relay.reassembly`).
These tests feed it chunk sequences in vLLM 0.32's shape (the fields, their order and their
nulls as vLLM's stream writes them): tool-call deltas of two tools over several chunks, logprobs
over chunks, token ids; once through the gateway from a recorded upstream, once through the
gateway over the emulator. ``tests/e2e/test_answers.py`` checks the same against real vLLM.
Also here: ``GET /v1/models/{id}`` and the refusal of ``n`` / ``best_of`` above 1.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from duetime.gateway import pool_from_dict
from duetime.gateway.relay.reassembly import Reassembly
from duetime.web.server import AppServer
from duetime.web.sse import payload, split_events
from test_gateway import chat, config, gateway

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
        "model": "m"}
CMPL = {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m"}
USAGE = {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4,
         "prompt_tokens_details": {"cached_tokens": 0}}


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def chunk(head: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {**head, "choices": [{"index": 0, **choice}]}


def delta(d: dict[str, Any], finish: str | None = None, **kw: Any) -> dict[str, Any]:
    """A chat chunk as vLLM streams it (``stop_reason`` only on the last one)."""
    extra = {"stop_reason": None} if finish else {}
    return chunk(HEAD, delta=d, logprobs=kw.pop("logprobs", None), finish_reason=finish,
                 **extra, **kw)


def role(**top: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": None, "prompt_text": None, **top}


def usage_chunk(head: dict[str, Any] = HEAD) -> dict[str, Any]:
    return {**head, "choices": [], "usage": USAGE, "system_fingerprint": "vllm-0.32.0-x"}


def reassemble(chunks: Iterable[dict[str, Any]], *, chat: bool = True,
               tool_choice: Any = None) -> dict[str, Any]:
    r = Reassembly()
    for c in chunks:
        r.add(c)
    return r.body(chat=chat, model="fallback", tool_choice=tool_choice)


def call(index: int, args: str, *, id: str | None = None, name: str | None = None
         ) -> dict[str, Any]:
    """A tool-call delta: the first of a call names it, every one carries argument text."""
    first = {"id": id, "type": "function"} if id else {}
    fn = {"name": name, "arguments": args} if name else {"arguments": args}
    return {**first, "index": index, "function": fn}


TWO_TOOLS = [
    role(),
    delta({"tool_calls": [call(0, '{"ci', id="call-a", name="get_weather")]}),
    delta({"tool_calls": [call(1, "{", id="call-b", name="take_note")]}),
    delta({"tool_calls": [call(0, 'ty": "Paris"}')]}),
    delta({"tool_calls": [call(1, '"text": "hi"'), call(1, "}")]}),
    delta({}, finish="tool_calls"),
    usage_chunk(),
]


def test_two_tool_calls_streamed_over_chunks_merge_by_index():
    body = reassemble(TWO_TOOLS)
    assert body == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{
            "index": 0,
            # auto tool calls with no text: vLLM's content is null
            "message": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call-a", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call-b", "type": "function",
                 "function": {"name": "take_note", "arguments": '{"text": "hi"}'}}]},
            "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}],
        "usage": USAGE, "system_fingerprint": "vllm-0.32.0-x"}


def test_a_forced_tool_call_keeps_empty_content_and_text_around_auto_calls_stays():
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = reassemble(TWO_TOOLS[:2] + TWO_TOOLS[3:4] + [delta({}, finish="stop")],
                        tool_choice=named)
    msg = forced["choices"][0]["message"]
    assert msg["content"] == "" and forced["choices"][0]["finish_reason"] == "stop"
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"city": "Paris"}']
    said = reassemble([role(), delta({"content": "Let me look."}), *TWO_TOOLS[1:]])
    assert said["choices"][0]["message"]["content"] == "Let me look."


def lp(token: str, logprob: float, *alts: tuple[str, float]) -> dict[str, Any]:
    """One chat logprobs entry: the token, its logprob and bytes, the top alternatives."""
    entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {**entry, "top_logprobs": [entry] + [
        {"token": t, "logprob": p, "bytes": list(t.encode())} for t, p in alts]}


def test_chat_logprobs_and_token_ids_over_chunks():
    steps = [lp("Hi", -0.5, ("Hey", -1.5)), lp(" there", -0.25, (" you", -2.0)),
             lp("!", -0.125, (".", -3.0))]
    chunks = [role(prompt_token_ids=[1, 2, 3, 4, 5]),
              delta({"content": "Hi"}, logprobs={"content": steps[:1]}, token_ids=[10]),
              # vLLM packs several tokens into one chunk when it falls behind
              delta({"content": " there!"}, logprobs={"content": steps[1:]},
                    token_ids=[11, 12]),
              delta({"content": ""}, finish="length", logprobs={"content": []}, token_ids=[13]),
              usage_chunk()]
    choice = reassemble(chunks)["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "Hi there!"},
                      "logprobs": {"content": steps}, "finish_reason": "length",
                      "stop_reason": None, "token_ids": [10, 11, 12, 13]}
    assert reassemble(chunks)["prompt_token_ids"] == [1, 2, 3, 4, 5]


def cmpl(text: str, offset: int, token_id: int, *, first: bool = False,
         finish: str | None = None, stop: Any = None) -> dict[str, Any]:
    """A completion chunk as vLLM streams it with ``logprobs: 1, return_token_ids: true``."""
    return chunk(CMPL, text=text,
                 logprobs={"text_offset": [offset], "token_logprobs": [-1.0 - offset],
                           "tokens": [text], "top_logprobs": [{text: -1.0 - offset}]},
                 finish_reason=finish, stop_reason=stop,
                 prompt_token_ids=[7, 8, 9] if first else None, token_ids=[token_id])


COMPLETION = [cmpl("The", 0, 100, first=True), cmpl(" key", 3, 101), cmpl(" is", 7, 102),
              cmpl("", 10, 103, finish="stop", stop="\n"), usage_chunk(CMPL)]


def test_completion_logprobs_token_ids_and_stop_reason():
    body = reassemble(COMPLETION, chat=False)
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{
            "index": 0, "text": "The key is",
            "logprobs": {"text_offset": [0, 3, 7, 10], "token_logprobs": [-1.0, -4.0, -8.0, -11.0],
                         "tokens": ["The", " key", " is", ""],
                         "top_logprobs": [{"The": -1.0}, {" key": -4.0}, {" is": -8.0},
                                          {"": -11.0}]},
            "finish_reason": "stop", "stop_reason": "\n", "token_ids": [100, 101, 102, 103],
            "prompt_token_ids": [7, 8, 9]}],
        "usage": USAGE, "system_fingerprint": "vllm-0.32.0-x"}


def test_reasoning_is_concatenated_like_content():
    chunks = [role(), delta({"reasoning": "Think"}), delta({"reasoning": "ing."}),
              delta({"content": "Done."}, finish="stop")]
    msg = reassemble(chunks)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Done.", "reasoning": "Thinking."}


def test_an_empty_stream_still_answers_one_choice():
    body = reassemble([], chat=False)
    assert body["model"] == "fallback" and body["choices"] == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None}]


# -- through the gateway -------------------------------------------------------------------------

def sse(chunks: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def recorded_upstream(streams: dict[str, bytes]) -> Starlette:
    """An upstream that answers each path with its recorded stream, sent in 7-byte pieces
    (events split anywhere, as TCP may); also the /health and /metrics the gateway polls."""
    async def complete(request: Request) -> Response:
        data = streams[request.url.path]

        async def pieces() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 7):
                yield data[i:i + 7]
        return StreamingResponse(pieces(), media_type="text/event-stream")

    async def ok(request: Request) -> Response:
        return PlainTextResponse("")
    return Starlette(routes=[Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"]),
                             Route("/health", ok), Route("/metrics", ok)])


def test_the_gateway_reassembles_a_recorded_vllm_stream():
    streams = {"/v1/chat/completions": sse(TWO_TOOLS), "/v1/completions": sse(COMPLETION)}

    async def go():
        upstream = await AppServer(recorded_upstream(streams)).start()
        try:
            cfg = {"instances": [{"name": "u", "model": "m", "url": upstream.url,
                                  "profile": "qwen3-0.6b",
                                  "price_usd_per_mtok": {"prompt": 0.1, "output": 0.1}}],
                   "quality": {"workload": None, "tasks": {"chat": {"m": 0.5}}},
                   "health": {"interval_s": 5.0}}
            async with gateway(cfg, pool_from_dict) as (_svc, c):
                r1 = await c.post("/v1/chat/completions", json=chat(model="m"))
                r2 = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
                r3 = await c.post("/v1/completions",
                                  json={"model": "m", "prompt": "x", "stream": True})
                return r1, r2, r3
        finally:
            await upstream.stop()

    r1, r2, r3 = run(go())
    assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
    assert r1.json() == reassemble(TWO_TOOLS)
    assert r2.json() == reassemble(COMPLETION, chat=False)
    # a streaming client gets the chunks as sent (no usage chunk: it did not ask for one)
    events = [payload(e) for e in split_events(r3.content)[0]]
    assert [json.loads(e) for e in events[:-1]] == COMPLETION[:-1] and events[-1] == b"[DONE]"


def test_the_gateway_answers_as_the_emulator_does():
    """The emulator sends no tool calls, logprobs or token ids: the reassembly of its stream is
    its own non-streaming body, but for the ids and times drawn per request."""
    import httpx

    async def go():
        async with gateway(config()) as (svc, c):
            direct = svc.emulator_servers["a"].url
            out = []
            for path, body in (("/v1/chat/completions", chat(model="big", ignore_eos=True)),
                               ("/v1/completions", {"model": "big", "prompt": "x" * 40,
                                                    "max_tokens": 5, "ignore_eos": True})):
                async with httpx.AsyncClient(timeout=10) as d:
                    want = await d.post(direct + path, json=body)
                out.append(((await c.post(path, json=body)).json(), want.json()))
            return out

    for got, want in run(go()):
        for k in ("id", "created"):
            got.pop(k), want.pop(k)
        assert got == want


# -- GET /v1/models/{id}; n and best_of -----------------------------------------------------------

def test_retrieve_model():
    async def go():
        async with gateway(config()) as (_svc, c):
            listed = (await c.get("/v1/models")).json()["data"]
            one = {m["id"]: (await c.get(f"/v1/models/{m['id']}")) for m in listed}
            missing = await c.get("/v1/models/no-such-model")
            return listed, one, missing

    listed, one, missing = run(go())
    assert {m["id"] for m in listed} >= {"auto", "big", "small"}
    for m in listed:
        r = one[m["id"]]
        assert r.status_code == 200
        got = r.json()
        assert abs(got.pop("created") - m.pop("created")) <= 2 and got == m
    assert missing.status_code == 404
    assert missing.json() == {"error": {
        "message": "The model 'no-such-model' does not exist", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", chat(n=2), "n"),
    ("/v1/completions", {"model": "auto", "prompt": "x", "n": 3}, "n"),
    ("/v1/completions", {"model": "auto", "prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"model": "auto", "prompt": "x", "n": 1, "best_of": 4}, "best_of"),
])
def test_more_than_one_answer_is_refused_before_routing(path, body, param):
    async def go():
        async with gateway(config()) as (svc, c):
            r = await c.post(path, json=body)
            served = sum(e.finished + e.aborted for e in svc.emulators.values())
            return r, served

    r, served = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "invalid_value"
    assert served == 0
