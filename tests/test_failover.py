"""Mid-stream failover: a stream whose instance breaks after the client got part of the answer
continues on another instance of the same model (`duetime.gateway.relay.resumption`), and the
client reads one stream — one id, no error event, one `[DONE]`, usage over the whole answer.

Instances are real emulators on loopback; `a` breaks every stream after three tokens (the
emulator's `break` fault: the connection drops), `b` serves the same model. Round-robin sends
the first request to `a`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from duetime.emulator import Faults
from duetime.gateway.relay.resumption import Continuation, Sent, not_resumable
from test_gateway import PRICE, gateway, metric, run

MODEL = "m"


def pool(a_faults: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    a = {"name": "a", "model": MODEL, "profile": "qwen3-8b", "price_usd_per_mtok": PRICE,
         "emulate": {"speed": 4.0, **(a_faults or {"fail_rate": 1.0, "fail_kinds": ["break"]})}}
    b = {"name": "b", "model": MODEL, "profile": "qwen3-8b", "price_usd_per_mtok": PRICE,
         "emulate": {"speed": 4.0}}
    return {"policy": "round-robin", "instances": [a, b],
            "quality": {"workload": None, "tasks": {"chat": {MODEL: 0.9}}},
            "health": {"interval_s": 30.0, "eject_after": 100},
            "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0}, **kw}


async def read_stream(c: httpx.AsyncClient, path: str, body: dict[str, Any]
                      ) -> tuple[httpx.Response, list[dict[str, Any]], list[str]]:
    """The response, its decoded chunks and its raw data lines."""
    chunks, raw = [], []
    async with c.stream("POST", path, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return r, chunks, raw


def text_of(chunks: list[dict[str, Any]], chat: bool) -> str:
    out = []
    for ch in chunks:
        for c in ch.get("choices") or ():
            out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text", ""))
    return "".join(out)


def test_a_chat_stream_broken_mid_way_continues_on_another_instance():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 12, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def go():
        async with gateway(pool()) as (svc, c):
            out = await read_stream(c, "/v1/chat/completions", body)
            metrics = (await c.get("/metrics")).text
            svc.emulators["a"].faults = Faults()
            plain = await read_stream(c, "/v1/chat/completions", body)  # (unbroken)
            return out, plain, metrics

    (r, chunks, raw), (_, plain_chunks, _), metrics = run(go())
    assert r.status_code == 200 and r.headers["x-duetime-instance"] == "a"
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1
    assert not any("error" in ch for ch in chunks), chunks
    assert text_of(chunks, True) == "tok " * 12  # three from a, nine from b
    assert len({ch["id"] for ch in chunks}) == 1 and len({ch["model"] for ch in chunks}) == 1
    roles = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("role")]
    assert len(roles) == 1  # (b's role chunk is not repeated)
    usage, plain_usage = chunks[-1]["usage"], plain_chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage == plain_usage  # (the same request answered whole: the same totals)
    assert metric(metrics, 'duetime_stream_breaks_total{outcome="continued"}') == 1
    assert metric(metrics, "duetime_retries_total") == 1


def test_a_completion_stream_continues_with_the_text_appended_to_the_prompt():
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True,
            "stream": True}

    async def go():
        async with gateway(pool()) as (_svc, c):
            return await read_stream(c, "/v1/completions", body)

    _r, chunks, raw = run(go())
    assert raw[-1] == "[DONE]" and not any("error" in ch for ch in chunks)
    assert text_of(chunks, False) == "tok " * 10
    assert all("usage" not in ch or ch["usage"] is None for ch in chunks)  # (not asked for)


def test_a_stream_that_broke_after_its_answer_ended_is_closed_not_continued():
    """Two tokens asked: `a` sends both (the last with its finish reason) and drops before the
    usage and `[DONE]`; the gateway closes the stream itself, usage counted."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def go():
        async with gateway(pool()) as (_svc, c):
            out = await read_stream(c, "/v1/chat/completions", body)
            return out, (await c.get("/metrics")).text

    (r, chunks, raw), metrics = run(go())
    assert r.headers["x-duetime-instance"] == "a" and raw[-1] == "[DONE]"
    assert text_of(chunks, True) == "tok tok "
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["id"] == chunks[0]["id"] and chunks[-1]["choices"] == []
    assert metric(metrics, 'duetime_stream_breaks_total{outcome="ended"}') == 1
    assert metric(metrics, "duetime_retries_total") == 0


def test_a_stream_that_cannot_continue_exactly_ends_with_an_error_event():
    """Log probabilities asked for: not resumable, so the break reaches the client as an error
    event after the tokens it got (as before failover existed)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 10, "ignore_eos": True,
            "stream": True, "logprobs": 1}

    async def go():
        async with gateway(pool()) as (_svc, c):
            out = await read_stream(c, "/v1/completions", body)
            return out, (await c.get("/metrics")).text

    (r, chunks, raw), metrics = run(go())
    assert r.status_code == 200 and raw[-1] != "[DONE]"
    assert chunks[-1]["error"]["code"] == "upstream_broken"
    assert text_of(chunks[:-1], False) == "tok " * 3
    assert metric(metrics, 'duetime_stream_breaks_total{outcome="not_resumable"}') == 1


def test_no_instance_left_to_continue_ends_the_stream_with_an_error_event():
    """Both instances break streams: the answer continues on b, breaks again, and the retry
    budget (1 here) is spent; the client's stream ends with one error event, nothing lost
    of what it got."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True,
            "stream": True}
    cfg = pool(retries=1)
    cfg["instances"][1]["emulate"].update(fail_rate=1.0, fail_kinds=["break"])

    async def go():
        async with gateway(cfg) as (_svc, c):
            out = await read_stream(c, "/v1/completions", body)
            return out, (await c.get("/metrics")).text

    (_r, chunks, raw), metrics = run(go())
    assert raw[-1] != "[DONE]" and chunks[-1]["error"]["type"] == "upstream_error"
    assert text_of(chunks[:-1], False) == "tok " * 6  # three from each
    assert metric(metrics, 'duetime_stream_breaks_total{outcome="continued"}') == 1
    assert metric(metrics, 'duetime_stream_breaks_total{outcome="exhausted"}') == 1


# -- the continuation's request, without servers ---------------------------------------------

class _Ctx:
    """The fields of a RequestContext that the resumption reads."""

    def __init__(self, body: dict[str, Any], chat: bool) -> None:
        from duetime.web.requests import parse_completion

        self.req = parse_completion(json.dumps(body).encode(), chat=chat)
        self.chat = chat


def test_what_cannot_be_resumed_is_said_before_the_stream_starts():
    def why(body: dict[str, Any], chat: bool = False) -> str | None:
        return not_resumable(_Ctx({"model": "m", "stream": True, **body}, chat))  # type: ignore[arg-type]

    assert why({"prompt": "x"}) is None
    assert why({"messages": [{"role": "user", "content": "x"}]}, chat=True) is None
    assert why({"prompt": "x", "logprobs": 2}) == "logprobs requested"
    assert why({"prompt": [1, 2, 3]}) == "a prompt other than one string"
    assert why({"messages": [{"role": "user", "content": "x"}], "response_format":
                {"type": "json_object"}}, chat=True) == "response_format requested"
    assert why({"messages": [{"role": "user", "content": "x"}], "response_format":
                {"type": "text"}}, chat=True) is None


def test_the_continuation_carries_the_sent_text_and_the_rest_of_the_budget():
    from duetime.gateway.intake.request import RequestContext

    req_body = {"model": "m", "stream": True, "max_tokens": 10, "min_tokens": 4,
                "temperature": 0.7, "messages": [{"role": "user", "content": "hi"}]}
    ctx = _Ctx(req_body, True)
    full = RequestContext("r", ctx.req, None, 0.0, None, None, None, [], 10, 10,  # type: ignore[arg-type]
                          {}, {}, {}, None)  # type: ignore[arg-type]
    sent = Sent()
    role = b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    tok = b'data: {"id":"c1","created":5,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"}}]}'
    sent.add([role, tok, tok], chat=True)
    assert (sent.text, sent.tokens, sent.id, sent.why_not) == ("HelHel", 2, "c1", None)
    cont = Continuation(full, sent)
    nxt = cont.context()
    b = nxt.req.body
    assert b["messages"][-1] == {"role": "assistant", "content": "HelHel"}
    assert b["continue_final_message"] is True and b["add_generation_prompt"] is False
    assert (b["max_tokens"], b["min_tokens"], b["temperature"]) == (8, 2, 0.7)
    assert nxt.req.prompt_tokens == ctx.req.prompt_tokens + 2 and nxt.predicted == 8
    assert req_body["messages"] == [{"role": "user", "content": "hi"}]  # (not changed)
    # its events read as the first answer's
    other = [b'data: {"id":"c2","created":9,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
             b'data: {"id":"c2","created":9,"model":"m","choices":[{"index":0,"delta":{"content":"lo"}}]}',
             b'data: {"id":"c2","created":9,"model":"m","choices":[],"usage":{"prompt_tokens":14,"completion_tokens":8,"total_tokens":22}}',
             b"data: [DONE]"]
    out = [json.loads(e[6:]) for e in cont.rewrite(other)[:-1]]
    assert len(out) == 2 and {o["id"] for o in out} == {"c1"} and out[0]["created"] == 5
    assert out[1]["usage"]["completion_tokens"] == 10
    assert out[1]["usage"]["prompt_tokens"] == ctx.req.prompt_tokens
    # tool calls streamed: not continued
    tool = b'data: {"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"t","function":{"name":"f","arguments":"{"}}]}}]}'
    s2 = Sent()
    s2.add([tool], chat=True)
    assert s2.why_not == "tool calls were streamed"
