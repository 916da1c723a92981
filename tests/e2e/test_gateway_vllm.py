"""The gateway in front of real vLLM servers (CPU build, tiny random models; ``vllm_pool``).

One gateway (:class:`duetime.service.Service`, in-process on its own event-loop thread) serves
the module; the retry test starts a second one with a dead instance, the CLI test a subprocess.
Everything is on loopback and every network call has a timeout. The models have random
weights: requests use ``temperature: 0`` and ``ignore_eos: true`` so that output lengths are
exact and outputs repeatable; long prompts are lists of token ids (the gateway counts those
exactly; a fresh random list per request would keep a prefix cache out of the timings, should
the servers run with one). Timing is never asserted tightly: where a test depends on how fast
the servers are, it measures that first. Forecast fidelity is asserted in ``test_fidelity``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from duetime.gateway import pool_from_dict
from duetime.service import Service

from .conftest import MAX_MODEL_LEN
from .gateway_pool import instance_config, pool_config

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
MODELS = {"tiny-small", "tiny-large"}
INSTANCE_OF = {"tiny-small": "small", "tiny-large": "large"}
GREEDY = {"temperature": 0, "ignore_eos": True}

_rng = random.Random(20240611)
_ids = itertools.count()


def fresh_ids(n: int) -> list[int]:
    """A prompt of ``n`` token ids that no earlier prompt of this session shares a prefix block
    with (vLLM caches prefixes by block)."""
    k = next(_ids)
    return [10 + k % 1000, *(_rng.randrange(10, 2000) for _ in range(n - 1))]


def chat_body(content: str, max_tokens: int, model: str = "auto", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **GREEDY, **kw}


def completion_body(prompt: Any, max_tokens: int, model: str = "auto",
                    **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY, **kw}


def path_of(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


# -- the gateway on a thread of its own ------------------------------------------------------------

class GatewayThread:
    """A :class:`Service` on an event loop in a daemon thread, for synchronous tests."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway",
                                       daemon=True)
        self.thread.start()
        self.service: Service | None = None
        try:
            self.service = self._call(Service(pool_from_dict(cfg, "e2e pool"),
                                              drain_timeout_s=5.0).start(), 120.0)
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        assert self.service is not None
        return self.service.url

    def close(self) -> None:
        try:
            if self.service is not None:
                self._call(self.service.stop(), 30.0)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        if not self.thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def running_gateway(cfg: dict[str, Any]) -> Iterator[GatewayThread]:
    gw = GatewayThread(cfg)
    try:
        yield gw
    finally:
        gw.close()


@pytest.fixture(scope="module")
def servers(vllm_pool) -> dict[str, Any]:
    return {s.name: s for s in vllm_pool}


@pytest.fixture(scope="module")
def gateway(vllm_pool) -> Iterator[GatewayThread]:
    with running_gateway(pool_config(vllm_pool)) as gw:
        yield gw


@pytest.fixture
def client(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as c:
        yield c


# -- helpers: metrics, SSE, TTFT ---------------------------------------------------------------------

def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples at ``url``/metrics: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def vllm_running(base_url: str) -> float:
    m = scrape(base_url)
    return sum(v for (n, _), v in m.items() if n == "vllm:num_requests_running")


def vllm_generated(base_url: str) -> float:
    m = scrape(base_url)
    return sum(v for (n, _), v in m.items() if n == "vllm:generation_tokens_total")


def sse_events(text: str) -> list[str]:
    """The data of each SSE event of a whole response body; asserts the framing (every event
    is one ``data: ...`` line, events end with a blank line)."""
    assert text.endswith("\n\n"), f"stream does not end with an event terminator: {text[-200:]!r}"
    events = []
    for ev in text.removesuffix("\n\n").split("\n\n"):
        lines = ev.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), f"bad SSE event {ev!r}"
        events.append(lines[0].removeprefix("data: "))
    return events


def parse_stream(text: str, chat: bool) -> dict[str, Any]:
    """Content pieces, usage chunks and finish reason of an OpenAI SSE stream body."""
    events = sse_events(text)
    assert events[-1] == "[DONE]", f"last event is not [DONE]: {events[-1]!r}"
    assert "[DONE]" not in events[:-1]
    pieces: list[str] = []
    token_ids: list[int] = []  # with return_token_ids (a vLLM extension)
    usage: list[dict[str, Any]] = []
    finish = None
    for data in events[:-1]:
        chunk = json.loads(data)
        assert "error" not in chunk, f"error event in the stream: {data}"
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        if chunk.get("usage"):
            assert chunk["choices"] == [], f"usage on a chunk with choices: {data}"
            usage.append(chunk["usage"])
            continue
        for ch in chunk["choices"]:
            if chat:
                delta = ch["delta"]
                if delta.get("role") and not delta.get("content"):
                    continue  # the role chunk
                if "content" in delta:
                    pieces.append(delta["content"])
            else:
                pieces.append(ch["text"])
            token_ids += ch.get("token_ids") or []
            finish = ch.get("finish_reason") or finish
    return {"pieces": pieces, "text": "".join(pieces), "token_ids": token_ids, "usage": usage,
            "finish": finish, "events": events}


def stream_ttft(c: httpx.Client, url: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[float, httpx.Response, str]:
    """POST a streaming request; (seconds to the first data event, response, whole body)."""
    body = {**body, "stream": True}
    t0 = time.perf_counter()
    ttft = math.nan
    parts = []
    with c.stream("POST", url + path_of(body), json=body, headers=headers or {}) as r:
        for chunk in r.iter_text():
            if math.isnan(ttft) and "data: " in chunk:
                ttft = time.perf_counter() - t0
            parts.append(chunk)
    return ttft, r, "".join(parts)


def forecast_ms(r: httpx.Response) -> float:
    raw = r.headers.get("x-duetime-forecast-ttft-ms")
    assert raw is not None, f"no x-duetime-forecast-ttft-ms header: {dict(r.headers)}"
    value = float(raw)
    assert math.isfinite(value) and value > 0, f"forecast header {raw!r}"
    return value


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert "code" in err, body
    return err


def wait_until(cond, timeout: float, interval: float = 0.05) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(interval)
    return cond()


# -- 1. routing -------------------------------------------------------------------------------------

def test_routing_headers_concrete_model_and_unknown_model(client):
    r = client.post("/v1/chat/completions", json=chat_body("hello world, what is the time", 4))
    assert r.status_code == 200, r.text
    model = r.headers["x-duetime-model"]
    assert model in MODELS
    assert r.headers["x-duetime-instance"] == INSTANCE_OF[model]
    assert r.json()["model"] == model
    forecast_ms(r)
    assert r.headers["x-duetime-attempts"] == "1"

    for body in (chat_body("tell me about the route", 2, model="tiny-large"),
                 completion_body("the fast model", 2, model="tiny-large")):
        for target in ("1", "5000"):  # a concrete model wins over any target
            r = client.post(path_of(body), json=body, headers={"x-duetime-ttft-ms": target})
            assert r.status_code == 200, r.text
            assert r.headers["x-duetime-model"] == "tiny-large"
            assert r.headers["x-duetime-instance"] == "large"

    for body in (chat_body("hi", 2, model="tiny-medium"),
                 completion_body("hi", 2, model="tiny-medium")):
        r = client.post(path_of(body), json=body)
        assert r.status_code == 404, r.text
        err = assert_openai_error(r)
        assert err["code"] == "model_not_found"
        assert "tiny-medium" in err["message"]
        assert "x-duetime-instance" not in r.headers


LONG_PROMPT = 1000  # tokens: tiny-large takes tens of times tiny-small's prefill time on a CPU


def forecasts(client: httpx.Client, n: int) -> dict[str, float]:
    """The gateway's TTFT forecast (ms) for an ``n``-token prompt on each idle instance (a
    concrete model restricts the candidates to its instance; the forecast of an idle instance
    depends on the prompt's length only)."""
    out = {}
    for model in ("tiny-small", "tiny-large"):
        r = client.post("/v1/completions", json=completion_body(fresh_ids(n), 1, model=model))
        assert r.status_code == 200, r.text
        out[model] = forecast_ms(r)
    return out


def measured(servers, n: int, tries: int = 2) -> dict[str, float]:
    """The best TTFT (ms) of an ``n``-token prompt, measured on each server directly."""
    with httpx.Client(timeout=TIMEOUT) as c:
        return {name: 1000 * min(stream_ttft(c, servers[name].base_url, completion_body(
            fresh_ids(n), 1, model=name))[0] for _ in range(tries))
                for name in ("tiny-small", "tiny-large")}


def test_routing_sfs_prefers_quality_when_the_target_allows(client, servers):
    """Quality table tiny-large 0.8 > tiny-small 0.5, equal prices: with a target tiny-large
    meets (ten times its own forecast, so: on any machine) sfs takes tiny-large, for a short and
    for a long prompt; and the long prompt's forecast is not far from what tiny-large takes."""
    for n in (16, LONG_PROMPT):
        generous = 10 * forecasts(client, n)["tiny-large"]
        r = client.post("/v1/completions", json=completion_body(fresh_ids(n), 1),
                        headers={"x-duetime-ttft-ms": f"{generous:.1f}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-duetime-model"] == "tiny-large", dict(r.headers)
        assert forecast_ms(r) <= generous
        assert float(r.headers["x-duetime-ttft-target-ms"]) == pytest.approx(generous, abs=0.1)
    best = measured(servers, LONG_PROMPT)["tiny-large"]
    print(f"\ntiny-large, {LONG_PROMPT} tokens: forecast {forecast_ms(r):.0f} ms, best measured "
          f"{best:.0f} ms")
    assert forecast_ms(r) > best / 3, "batch-time model of tiny-large far too optimistic"


def test_routing_sfs_tight_target_picks_the_model_that_can_meet_it(client, servers):
    """A ~1000-token prompt with a target tiny-large cannot meet but tiny-small can: sfs gives
    up quality for the target. The target is derived from this machine: the geometric middle of
    the two instances' forecasts (tens of times apart), and the premise is measured on
    the servers first: tiny-small's best TTFT is under the target, tiny-large's over it."""
    fc = forecasts(client, LONG_PROMPT)
    tight = math.sqrt(fc["tiny-small"] * fc["tiny-large"])
    # (best of five: on two cores a server's stream is sometimes held for 100s of ms while
    # the engine's processes and the kernel's workers take both; two tries once both met one)
    best = measured(servers, LONG_PROMPT, tries=5)
    print(f"\n{LONG_PROMPT}-token prompt: forecasts {fc}, best measured {best}; target "
          f"{tight:.0f} ms")
    assert best["tiny-small"] < tight < best["tiny-large"], (
        f"premise: tiny-small must meet the target and tiny-large not ({best}, {tight:.0f} ms)")

    r = client.post("/v1/completions", json=completion_body(fresh_ids(LONG_PROMPT), 1),
                    headers={"x-duetime-ttft-ms": f"{tight:.1f}"})
    assert r.status_code == 200, r.text
    assert r.headers["x-duetime-model"] == "tiny-small", dict(r.headers)
    assert forecast_ms(r) <= tight
    # and the same prompt length with a target tiny-large meets still goes to tiny-large
    r = client.post("/v1/completions", json=completion_body(fresh_ids(LONG_PROMPT), 1),
                    headers={"x-duetime-ttft-ms": f"{10 * fc['tiny-large']:.1f}"})
    assert r.status_code == 200 and r.headers["x-duetime-model"] == "tiny-large"


# -- 2. streaming pass-through ----------------------------------------------------------------------

@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("model", ["tiny-small", "tiny-large"])
def test_streaming_passthrough_and_usage_chunk(client, servers, chat, model):
    """Chunks pass through as vLLM sent them. vLLM coalesces the deltas of several tokens into
    one chunk when its HTTP side lags the engine (tiny-small makes a token every few ms), so
    the tokens are counted with ``return_token_ids`` (vLLM's per-chunk token ids), not chunks."""
    n = 6
    ids = {"return_token_ids": True}
    make = ((lambda **kw: chat_body("please write a list of numbers", n, model=model, **ids,
                                    **kw))
            if chat else
            (lambda **kw: completion_body("one two three four", n, model=model, **ids, **kw)))
    # what vLLM streams directly, for the same greedy request
    with httpx.Client(timeout=TIMEOUT) as d:
        _, r, text = stream_ttft(d, servers[model].base_url, make())
    assert r.status_code == 200
    direct = parse_stream(text, chat)
    assert len(direct["token_ids"]) == n, direct["events"]

    for include_usage in (False, True):
        kw = {"stream_options": {"include_usage": True}} if include_usage else {}
        _, r, text = stream_ttft(client, "", make(**kw))
        assert r.status_code == 200, text
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-duetime-instance"] == INSTANCE_OF[model]
        got = parse_stream(text, chat)
        assert len(got["token_ids"]) == n, got["events"]
        assert got["token_ids"] == direct["token_ids"]
        assert 1 <= len(got["pieces"]) <= n, got["events"]
        assert got["text"] == direct["text"]
        assert got["finish"] == "length"
        if include_usage:
            assert len(got["usage"]) == 1, got["events"]
            assert got["usage"][0]["completion_tokens"] == n
            assert got["usage"][0]["prompt_tokens"] > 0
            assert json.loads(got["events"][-2]).get("usage"), "usage is not the last chunk"
        else:
            # the gateway asks upstream for usage always; the client did not, so it is dropped
            assert got["usage"] == [], got["events"]
            assert '"usage"' not in text


def test_streaming_keeps_vllm_continuous_usage_stats(client, servers):
    body = completion_body("one two three", 4, model="tiny-small", stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    with httpx.Client(timeout=TIMEOUT) as d:
        _, r, text = stream_ttft(d, servers["tiny-small"].base_url, body)
    assert r.status_code == 200, text
    direct = [json.loads(e) for e in sse_events(text)[:-1]]
    assert all(c.get("usage") for c in direct if c["choices"]), "vLLM sent no per-chunk usage"
    _, r, text = stream_ttft(client, "", body)
    assert r.status_code == 200, text
    got = [json.loads(e) for e in sse_events(text)[:-1]]
    # (chunk counts may differ: vLLM packs several tokens into a chunk when it falls behind)
    assert got and all(c.get("usage") for c in got), [bool(c.get("usage")) for c in got]
    assert got[-1]["usage"]["completion_tokens"] == 4


# -- 3. reassembly -------------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("model", ["tiny-small", "tiny-large"])
def test_non_streaming_reassembly_matches_vllm(client, servers, chat, model):
    n = 8
    body = (chat_body("what is the value of the key", n, model=model) if chat
            else completion_body("the value of the key is", n, model=model))
    with httpx.Client(timeout=TIMEOUT) as d:
        want = d.post(servers[model].base_url + path_of(body), json=body)
    assert want.status_code == 200, want.text
    r = client.post(path_of(body), json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    got, want = r.json(), want.json()
    assert got["object"] == want["object"] == ("chat.completion" if chat else "text_completion")
    assert got["model"] == model
    assert len(got["choices"]) == 1
    g, w = got["choices"][0], want["choices"][0]
    if chat:
        assert g["message"]["role"] == "assistant"
        assert g["message"]["content"] == w["message"]["content"]
    else:
        assert g["text"] == w["text"]
    assert g["finish_reason"] == w["finish_reason"] == "length"
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: got["usage"][k] for k in keys} == {k: want["usage"][k] for k in keys}
    assert got["usage"]["completion_tokens"] == n


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_non_streaming_reassembly_keeps_the_stop_reason(client, servers, chat):
    """A stop string ends the output: finish_reason "stop" and vLLM's stop_reason (the string)
    come back through the gateway as vLLM gives them directly."""
    model = "tiny-large"
    make = chat_body if chat else completion_body
    base = make("tell me about the key", 12, model=model)
    with httpx.Client(timeout=TIMEOUT) as d:
        free = d.post(servers[model].base_url + path_of(base), json=base)
        assert free.status_code == 200, free.text
        ch = free.json()["choices"][0]
        text = ch["message"]["content"] if chat else ch["text"]
        stop = next((c for c in text[len(text) // 2:] if not c.isspace()), None)
        if stop is None:
            pytest.skip(f"no usable stop character in {text!r}")
        body = {**base, "stop": [stop], "ignore_eos": False}
        want = d.post(servers[model].base_url + path_of(body), json=body).json()
    got = client.post(path_of(body), json=body)
    assert got.status_code == 200, got.text
    g, w = got.json()["choices"][0], want["choices"][0]
    assert w["finish_reason"] == "stop" and w["stop_reason"] == stop
    assert (g["finish_reason"], g["stop_reason"]) == (w["finish_reason"], w["stop_reason"])
    assert (g["message"]["content"] if chat else g["text"]) == \
        (w["message"]["content"] if chat else w["text"])


# -- 4. metrics ------------------------------------------------------------------------------------------

def test_metrics_count_requests_decisions_ttft_and_forecast_error(client, gateway):
    before = scrape(gateway.url)
    for model in ("tiny-small", "tiny-large"):
        r = client.post("/v1/chat/completions", json=chat_body("hello", 2, model=model))
        assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json=completion_body("hello", 2, stream=True))
    assert r.status_code == 200
    after = scrape(gateway.url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("duetime_requests_total", route="chat", status="200") == 2
    assert delta("duetime_requests_total", route="completions", status="200") == 1
    for inst, model in (("small", "tiny-small"), ("large", "tiny-large")):
        assert delta("duetime_decisions_total", instance=inst, model=model) >= 1
        assert delta("duetime_ttft_seconds_count", instance=inst) >= 1
        assert delta("duetime_ttft_seconds_sum", instance=inst) > 0
        assert delta("duetime_forecast_ttft_error_seconds_count", instance=inst) >= 1
        assert delta("duetime_forecast_ttft_ratio_count", instance=inst) >= 1
        ratio_sum = delta("duetime_forecast_ttft_ratio_sum", instance=inst)
        assert math.isfinite(ratio_sum) and ratio_sum > 0
        assert sample(after, "duetime_instance_healthy", instance=inst) == 1
    decisions = sum(delta("duetime_decisions_total", instance=i, model=m)
                    for i, m in (("small", "tiny-small"), ("large", "tiny-large")))
    assert decisions == 3
    assert delta("duetime_routing_seconds_count") == 3


def test_metrics_forecast_error_has_a_signed_sum(client, gateway):
    """A histogram with negative buckets has no _sum in the exposition (prometheus_client
    leaves it out): the signed sum of the errors is its own gauge, so the mean bias can be read."""
    r = client.post("/v1/chat/completions", json=chat_body("hello", 2, model="tiny-small"))
    assert r.status_code == 200
    m = scrape(gateway.url)
    assert sample(m, "duetime_forecast_ttft_error_seconds_count", instance="small") >= 1
    assert ("duetime_forecast_ttft_error_sum_seconds", (("instance", "small"),)) in m


# -- 5. retries --------------------------------------------------------------------------------------------

def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_retry_on_a_dead_instance_then_eject_it(vllm_pool, servers):
    """An extra tiny-large instance on a closed port, listed before the live one: equal utility
    and forecasts, so sfs tries it first (health probes are slowed so that they do not find it
    dead before the first request)."""
    dead = instance_config(servers["tiny-large"], name="dead",
                           url=f"http://127.0.0.1:{closed_port()}")
    insts = [instance_config(servers["tiny-small"]), dead,
             instance_config(servers["tiny-large"])]
    cfg = pool_config(vllm_pool, instances=insts, retries=1,
                      health={"interval_s": 60.0, "eject_after": 3, "timeout_s": 1.0})
    with running_gateway(cfg) as gw, httpx.Client(base_url=gw.url, timeout=TIMEOUT) as c:
        attempts = []
        for body in (completion_body("hello", 2, model="tiny-large"),
                     chat_body("hello", 2, model="tiny-large"),
                     completion_body("hello", 2, model="tiny-large", stream=True)):
            r = c.post(path_of(body), json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-duetime-instance"] == "large"
            attempts.append(int(r.headers["x-duetime-attempts"]))
        assert attempts == [2, 1, 1]  # the connect error ejected the dead one at once
        states = {i["name"]: i for i in c.get("/duetime/instances").json()["instances"]}
        assert states["dead"]["healthy"] is False
        assert "connect" in (states["dead"]["last_error"] or "")
        assert states["large"]["healthy"] is True
        m = scrape(gw.url)
        assert sample(m, "duetime_upstream_errors_total", instance="dead", kind="connect") == 1
        assert sample(m, "duetime_retries_total") == 1
        assert sample(m, "duetime_ejections_total", instance="dead") == 1
        assert sample(m, "duetime_instance_healthy", instance="dead") == 0


# -- 6. upstream 4xx ----------------------------------------------------------------------------------

def test_a_request_no_instance_can_hold_is_refused_by_the_gateway(client, gateway, servers):
    """Beyond max_model_len: the gateway answers vLLM's status itself (it never routes a
    request to an instance that cannot hold it), nothing goes upstream."""
    cases = [
        chat_body("hi", 5000),  # max_tokens > max_model_len
        completion_body(fresh_ids(2100), 4),  # a prompt longer than max_model_len
    ]
    for body in cases:
        before = scrape(gateway.url)
        r = client.post(path_of(body), json=body)
        after = scrape(gateway.url)
        err = assert_openai_error(r)
        assert "x-duetime-instance" not in r.headers
        assert err["code"] == "context_length_exceeded", err
        assert str(MAX_MODEL_LEN) in err["message"]
        with httpx.Client(timeout=TIMEOUT) as d:  # vLLM's own answer to the same request
            want = d.post(servers["tiny-small"].base_url + path_of(body),
                          json={**body, "model": "tiny-small"})
        assert r.status_code == want.status_code == 400
        assert sum(sample(after, "duetime_decisions_total", instance=i, model=m)
                   - sample(before, "duetime_decisions_total", instance=i, model=m)
                   for m, i in INSTANCE_OF.items()) == 0


def test_upstream_4xx_is_relayed_and_not_retried(client, gateway, servers):
    cases = [
        chat_body("hi", 4, temperature=-1.0),  # vLLM's own validation
        chat_body("hi", 4, temperature=-1.0, stream=True),
        completion_body(fresh_ids(20), 4, top_p=2.0),
    ]
    for body in cases:
        before = scrape(gateway.url)
        r = client.post(path_of(body), json=body)
        after = scrape(gateway.url)
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = assert_openai_error(r)
        inst = r.headers.get("x-duetime-instance")
        assert inst in INSTANCE_OF.values(), dict(r.headers)
        model = next(m for m, i in INSTANCE_OF.items() if i == inst)
        # vLLM's own answer to the same request
        with httpx.Client(timeout=TIMEOUT) as d:
            want = d.post(servers[model].base_url + path_of(body), json={**body, "model": model})
        assert r.status_code == want.status_code
        assert err == want.json()["error"]

        def delta(name: str, m0=before, m1=after, **labels: str) -> float:
            return sample(m1, name, **labels) - sample(m0, name, **labels)

        assert sum(delta("duetime_decisions_total", instance=i, model=m)
                   for m, i in INSTANCE_OF.items()) == 1, "a 4xx was retried"
        assert delta("duetime_retries_total") == 0
        assert delta("duetime_requests_total", route="chat" if "messages" in body
                     else "completions", status=str(r.status_code)) == 1
        for i in INSTANCE_OF.values():
            assert sample(after, "duetime_instance_healthy", instance=i) == 1


# -- 7. client disconnect ---------------------------------------------------------------------------

def test_client_disconnect_cancels_the_upstream_request(gateway, servers):
    large = servers["tiny-large"].base_url
    assert wait_until(lambda: vllm_running(large) == 0, 10.0), "tiny-large is busy"
    before = scrape(gateway.url)
    generated = vllm_generated(large)
    # As many tokens as the context holds, and the client leaves at its first token: the
    # request outlives the disconnect by all the rest (tiny-large makes ~2,000 tokens a second
    # on a 2-core machine, so nothing slow, not even a /metrics scrape, may come in between)
    most = MAX_MODEL_LEN - 16
    body = completion_body("count to ten", most, model="tiny-large", stream=True)
    with httpx.Client(base_url=gateway.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # hold the iterator: a dropped httpx line iterator closes the response at once
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            lines.close()
        t_closed = time.monotonic()  # leaving the block closed the unfinished response
    assert '"text"' in first, first
    assert wait_until(lambda: vllm_running(large) == 0, 5.0), (
        "tiny-large still runs the request after the client went away")
    print(f"\nupstream request gone {time.monotonic() - t_closed:.2f} s after the disconnect"
          f" ({vllm_generated(large) - generated:.0f} of {most} tokens made)")
    made = vllm_generated(large) - generated
    time.sleep(0.5)
    assert vllm_generated(large) - generated == made, "tiny-large still generates"
    assert 0 < made < most, (
        f"tiny-large made {made:.0f} of the request's {most} tokens: the disconnect did not "
        "reach it before the request ended")

    def counted() -> bool:
        m = scrape(gateway.url)
        return (sample(m, "duetime_client_disconnects_total")
                - sample(before, "duetime_client_disconnects_total") == 1
                and sample(m, "duetime_requests_total", route="completions", status="499")
                - sample(before, "duetime_requests_total", route="completions",
                         status="499") == 1)

    assert wait_until(counted, 5.0)
    state = {i["name"]: i for i in httpx.get(f"{gateway.url}/duetime/instances",
                                             timeout=10.0).json()["instances"]}
    assert state["large"]["in_flight"] == 0


# -- 8. the CLI ----------------------------------------------------------------------------------------

def test_cli_serve_over_real_vllm_and_sigint(vllm_pool, tmp_path):
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(yaml.safe_dump(pool_config(vllm_pool), sort_keys=False))
    proc = subprocess.Popen(
        [sys.executable, "-m", "duetime", "serve", "--config", str(cfg), "--port", "0",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        cwd=REPO)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    out: list[str] = []

    def read_until(pattern: str, timeout: float) -> re.Match[str] | None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                line = lines.get(timeout=max(0.01, t_end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            out.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        return None

    try:
        m = read_until(r"listening on (http://127\.0\.0\.1:\d+)", 30.0)
        assert m, f"no 'listening on' line; output:\n{''.join(out)}"
        url = m.group(1)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            r = c.post("/v1/chat/completions", json=chat_body("hello there", 3))
            assert r.status_code == 200, r.text
            assert r.headers["x-duetime-model"] in MODELS
            body = r.json()
            assert body["object"] == "chat.completion"
            assert body["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30.0)
        read_until(r"stopped", 5.0)
        assert rc == 0, f"exit status {rc}; output:\n{''.join(out)}"
        assert any("duetime serve: stopped" in line for line in out), "".join(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10.0)
