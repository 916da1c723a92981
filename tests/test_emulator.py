"""The emulated vLLM server: timing follows the engine, vLLM's API and metrics, failures.

Real servers (uvicorn on loopback, port 0) where streaming, timing or disconnects matter;
``httpx.ASGITransport`` in-process for plain request/response endpoints. Every test runs under
an overall timeout; timing checks have generous upper bounds (a loaded 2-core machine) and
strict lower bounds (the emulator must never be faster than its engine).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest

from duetime import Snapshot
from duetime.cli import main
from duetime.emulator import Faults, create_app, emulator_from_profile
from duetime.engine import forecast
from duetime.web.server import AppServer
from duetime.web.tokens import chat_tokens, text_tokens

SLACK_S = 0.35  # allowed extra latency (HTTP, event loop, a busy test machine)


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def serve(emu) -> AppServer:
    return await AppServer(create_app(emu)).start()


async def sse_events(resp: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    out = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
        else:
            assert line == "", line
    return out


async def first_token_time(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first content chunk, seconds to the end) of a streamed completion."""
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first, time.perf_counter() - t0


# -- timing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("speed", [1.0, 4.0])
def test_ttft_on_an_idle_emulator_is_the_engine_forecast(speed):
    prompt, out = 8000, 12

    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=speed)
        server = await serve(emu)
        try:
            expect_first = forecast(emu.snapshot(), prompt).estimate_s
            expect_end = forecast(emu.snapshot(), prompt, out, until="finish").estimate_s
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                await c.get("/health")  # connection set up before timing
                first, end = await first_token_time(c, {
                    "prompt": [1] * prompt, "max_tokens": out, "ignore_eos": True,
                    "stream": True})
            return expect_first, expect_end, first, end
        finally:
            await server.stop()

    expect_first, expect_end, first, end = run(go())
    # qwen3-8b at speed 1: ~0.21 s to the first token of an 8000-token prompt
    assert expect_first == pytest.approx(0.208 / speed, rel=0.05)
    assert 0.95 * expect_first <= first <= expect_first + SLACK_S
    assert 0.95 * expect_end <= end <= expect_end + SLACK_S


def test_queued_requests_wait_for_the_batch_ahead():
    """Two long prompts sent together: the second's first token comes a whole prefill later
    (the 32768-token budget holds one 30000-token prompt per step). The prompts differ (an
    identical one would reuse the first's cached blocks)."""
    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=4.0)
        server = await serve(emu)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                await c.get("/health")
                a, b = await asyncio.gather(*(first_token_time(c, {
                    "prompt": [tok] * 30000, "max_tokens": 2, "stream": True})
                    for tok in (1, 2)))
            return emu, sorted([a[0], b[0]])
        finally:
            await server.stop()

    emu, (first, second) = run(go())
    one = forecast(emu.snapshot(), 30000).estimate_s  # an idle prefill, ~0.33 s at speed 4
    assert second >= first + 0.8 * one
    assert second <= 2 * one + 0.05 + SLACK_S


# -- the API ------------------------------------------------------------------------------------

def test_streaming_chat_format():
    async def go():
        server = await serve(emulator_from_profile("qwen3-0.6b", speed=8.0))
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                body = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 5, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    assert r.headers["content-type"].startswith("text/event-stream")
                    return await sse_events(r)
        finally:
            await server.stop()

    events = run(go())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "qwen3-0.6b"
               for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert [t["choices"][0]["delta"]["content"] for t in tokens] == ["tok "] * 5
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * 4 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    prompt = chat_tokens([{"role": "user", "content": "hi"}])
    assert usage["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5,
                              "total_tokens": prompt + 5}


def test_streaming_completions_without_usage():
    async def go():
        server = await serve(emulator_from_profile("qwen3-0.6b", speed=8.0))
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                body = {"prompt": "hello world", "max_tokens": 3, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return await sse_events(r)
        finally:
            await server.stop()

    events = run(go())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["choices"] for c in chunks)  # no usage chunk unless asked
    assert "".join(c["choices"][0]["text"] for c in chunks) == "tok " * len(chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(chunks) <= 3


def test_non_streaming_and_seeded_lengths():
    async def lengths(seed: int) -> list[dict[str, Any]]:
        emu = emulator_from_profile("qwen3-0.6b", speed=20.0, seed=seed, output_median=12)
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu",
                                     timeout=10) as c:
            out = []
            for _ in range(4):
                r = await c.post("/v1/completions", json={"prompt": "abcdefgh"})
                assert r.status_code == 200
                out.append(r.json())
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            out.append(r.json())
        await emu.close()
        return out

    a, b, c = run(lengths(5)), run(lengths(5)), run(lengths(6))
    n = [r["usage"]["completion_tokens"] for r in a]
    assert n == [r["usage"]["completion_tokens"] for r in b]  # same seed, same lengths
    assert n != [r["usage"]["completion_tokens"] for r in c]
    for r in a[:4]:
        assert r["object"] == "text_completion"
        assert r["usage"]["prompt_tokens"] == text_tokens("abcdefgh") == 2
        assert r["choices"][0]["text"] == "tok " * r["usage"]["completion_tokens"]
        assert r["choices"][0]["finish_reason"] == "stop"
    chat = a[4]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "tok " * min(
        2, chat["usage"]["completion_tokens"])}
    assert chat["usage"]["completion_tokens"] <= 2


def test_models_tokenize_health_metrics_snapshot_endpoints():
    async def go():
        emu = emulator_from_profile("qwen3-8b", model_name="my-model", speed=10.0)
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu",
                                     timeout=10) as c:
            models = (await c.get("/v1/models")).json()
            tok = (await c.post("/tokenize", json={"prompt": "x" * 41})).json()
            tok_chat = (await c.post("/tokenize", json={
                "messages": [{"role": "user", "content": "x" * 8}]})).json()
            health = await c.get("/health")
            r = await c.post("/v1/completions", json={"model": "my-model", "prompt": "hi",
                                                      "max_tokens": 4})
            assert r.status_code == 200
            metrics = (await c.get("/metrics")).text
            snap = await c.get("/snapshot")
        await emu.close()
        return models, tok, tok_chat, health, metrics, snap

    models, tok, tok_chat, health, metrics, snap = run(go())
    assert [m["id"] for m in models["data"]] == ["my-model"]
    assert tok["count"] == 11 and len(tok["tokens"]) == 11
    assert tok_chat["count"] == 3 + 4 + 2
    assert health.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total"):
        assert name in metrics, name
    assert 'vllm:time_to_first_token_seconds_count{model_name="my-model"} 1.0' in metrics
    assert 'vllm:request_success_total{finished_reason="length",model_name="my-model"} 1.0' \
        in metrics or 'vllm:request_success_total{finished_reason="stop",model_name="my-model"}' \
        in metrics
    assert snap.status_code == 200 and float(snap.headers["x-duetime-clock"]) > 0
    s = Snapshot.from_dict(snap.json())
    assert not s.running and not s.waiting
    # speed 10: the published batch-time model is the profile's, ten times faster
    assert s.model.coefficients["c0"] == pytest.approx(0.0072959 / 10)


def test_snapshot_of_a_busy_emulator_validates_and_shows_the_request():
    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=2.0)
        server = await serve(emu)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                body = {"prompt": [7] * 3000, "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", "/v1/completions", json=body,
                                    headers={"x-request-id": "mine"}) as r:
                    assert r.headers["x-request-id"] == "mine"
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {")
                        if seen == 5:
                            break
                    snap = await c.get("/snapshot")
            return snap
        finally:
            await server.stop()

    snap = run(go())
    s = Snapshot.from_dict(snap.json())
    (req,) = s.running
    assert req.id == "mine" and req.prompt_tokens == 3000
    assert req.predicted_output_tokens == 400  # the emulator knows the true stop
    # the H100 profile schedules asynchronously: between steps its next token is in flight,
    # already computed (vLLM's placeholder token)
    assert s.config.async_scheduling
    assert req.output_tokens >= 5 and req.computed_tokens == 3000 + req.output_tokens


# -- bad input and failures ---------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("/v1/chat/completions", b'{"prompt": "x"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages[0]"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "x", "model": "other"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 200000}', 400, "prompt"),
])
def test_bad_input_gets_an_openai_error(path, body, status, param):
    async def go():
        emu = emulator_from_profile("qwen3-0.6b")
        transport = httpx.ASGITransport(app=create_app(emu))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            return await c.post(path, content=body,
                                headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["param"] == param


def test_client_disconnect_aborts_the_request():
    async def go():
        emu = emulator_from_profile("qwen3-8b", speed=2.0)
        server = await serve(emu)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                body = {"prompt": "x" * 2000, "max_tokens": 5000, "ignore_eos": True,
                        "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: {")
                        if n == 3:
                            break
                # the connection is closed here: the emulator must abort within moments
                for _ in range(200):
                    if emu.aborted:
                        break
                    await asyncio.sleep(0.01)
                metrics = (await c.get("/metrics")).text
            return emu, metrics
        finally:
            await server.stop()

    emu, metrics = run(go())
    assert emu.aborted == 1 and emu.engine.idle
    assert 'finished_reason="abort"' in metrics


def test_injected_failures():
    async def go():
        emu = emulator_from_profile("qwen3-0.6b", speed=8.0,
                                    faults=Faults(rate=1.0, kinds=("5xx",)))
        server = await serve(emu)
        out = {}
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                body = {"prompt": "x", "max_tokens": 2, "stream": True}
                r = await c.post("/v1/completions", json=body)
                out["5xx"] = (r.status_code, r.json())
                r = await c.post("/emulator/faults", json={"rate": 0})
                assert r.json()["rate"] == 0
                with pytest.raises(httpx.RemoteProtocolError):
                    async with c.stream("POST", "/v1/completions", json=body,
                                        headers={"x-emulator-fault": "disconnect"}) as r:
                        async for _ in r.aiter_lines():
                            pass
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json=body, timeout=httpx.Timeout(
                        10, read=0.3), headers={"x-emulator-fault": "timeout"})
                await c.post("/emulator/faults", json={"healthy": False})
                out["health"] = (await c.get("/health")).status_code
                out["dead"] = (await c.post("/v1/completions", json=body)).status_code
                await c.post("/emulator/faults", json={"healthy": True})
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                out["ok"] = r.status_code
            return out
        finally:
            await server.stop()

    out = run(go())
    status, body = out["5xx"]
    assert status == 500 and body["error"]["type"] == "server_error"
    assert out["health"] == 503 and out["dead"] == 503 and out["ok"] == 200


def test_emulate_cli_errors(capsys):
    assert main(["emulate", "--profile", "qwen3-8b", "--fail-kinds", "5xx,bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duetime: error: --fail-kinds:") and err.count("\n") == 1


def test_token_estimate_is_documented_rule():
    assert text_tokens("") == 1 and text_tokens("abcd") == 1 and text_tokens("abcde") == 2
    assert chat_tokens([{"role": "user", "content": "a" * 400}]) == 3 + 4 + 100
    parts = [{"type": "text", "text": "abcd"}, {"type": "image_url", "image_url": {}}]
    assert chat_tokens([{"role": "user", "content": parts}]) == 3 + 4 + 1
    assert math.isclose(text_tokens("x" * 4000), 1000)


def test_a_request_that_cannot_fit_the_kv_cache_is_refused_not_queued():
    """A request whose whole sequence (up to max_tokens; without it, up to max_model_len, as
    vLLM defaults) needs more KV blocks than the instance has would block the queue for ever:
    vLLM's 400 instead. One that fits is served."""
    from duetime.emulator import Emulator
    from duetime.engine import Paper4, SchedulerConfig

    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=4096,
                          block_size=16, num_gpu_blocks=65)  # 64 usable blocks: 1024 tokens
    emu = Emulator(Paper4(b0=1e-3, b1=1e-6, b2=0.0, b3=0.0), cfg, model_name="small-cache")

    async def go():
        server = await serve(emu)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
                out = []
                for body in ({"prompt": [7] * 900, "max_tokens": 200},
                             {"prompt": [7] * 10},
                             {"prompt": [7] * 900, "max_tokens": 125, "ignore_eos": True}):
                    r = await c.post("/v1/completions", json=body)
                    out.append((r.status_code, r.json()))
                return out
        finally:
            await server.stop()

    (s1, b1), (s2, b2), (s3, b3) = run(go())
    assert s1 == 400 and "1099 tokens of KV cache" in b1["error"]["message"]
    assert "1024" in b1["error"]["message"]
    assert s2 == 400 and "KV cache" in b2["error"]["message"]  # up to max_model_len
    assert s3 == 200 and b3["usage"]["completion_tokens"] == 125  # 1024 tokens: exactly fits
    assert emu.engine.idle


def test_an_emulator_with_a_frontend_queues_requests_and_holds_tokens_behind_it():
    """``frontend``: the requests sent together reach the engine one API-server hand-off
    apart, and tokens reach the streams only as the server sends their chunks: the k-th
    stream to reach the engine ends no sooner than k+1 hand-offs and a chunk after it was
    sent (lower bounds: the emulator may be slower on a busy machine, never faster). Every
    token and the usage arrive; tokens that reached a stream together came in one chunk (as
    vLLM merges them), each chunk counting the tokens so far (``continuous_usage_stats``)."""
    from duetime.engine.frontend import FrontendModel

    request_s, chunk_s = 0.03, 0.004

    async def go():
        emu = emulator_from_profile("qwen3-0.6b", speed=4.0, frontend=FrontendModel(
            request_s, chunk_s))
        server = await serve(emu)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                body = {"model": "qwen3-0.6b", "prompt": "hello", "max_tokens": 12,
                        "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}}
                async def one():
                    t0 = time.perf_counter()
                    first = None
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        events = await sse_events(r)
                        first = time.perf_counter() - t0
                    return first, events
                got = await asyncio.gather(*(one() for _ in range(4)))
                return got, emu
        finally:
            await server.stop()

    got, emu = run(go())
    merged = 0
    for _, events in got:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 12
        chunks = [json.loads(e) for e in events[:-2]]
        texts = [c["choices"][0]["text"].count("tok ") for c in chunks]
        assert sum(texts) == 12 and all(t >= 1 for t in texts)
        so_far = [c["usage"]["completion_tokens"] for c in chunks]
        assert so_far == [sum(texts[:k + 1]) for k in range(len(texts))]
        merged += sum(t > 1 for t in texts)
    assert merged > 0  # (four streams' chunks at 4 ms each behind one server: some merged)
    ends = sorted(t for t, _ in got)
    # the k-th to reach the engine ends after k+1 hand-offs and its last chunk (its other
    # chunks may have merged while the server sent the other streams')
    for k, t in enumerate(ends):
        assert t >= (k + 1) * request_s + chunk_s
    assert emu.finished == 4 and not emu._active
