"""The gateway's non-streaming answers against vLLM's own (CPU build, one tiny random model).

The gateway always streams from upstream and reassembles the chunks for a client that asked
``stream: false``. Each test here sends the same non-streaming request to vLLM directly and
through the gateway and compares the two bodies field by field. The requests are greedy
(``temperature: 0``, a fixed ``seed``, ``ignore_eos`` where the length matters), so both answers
are the same tokens: vLLM computes a request the same way whether it streams it or not.

What legitimately differs, and is not compared:

* ``id``, ``created`` and each tool call's ``id``: vLLM draws them per request;
* ``usage.prompt_tokens_details`` cache counts: the second of the two requests finds the first's
  prompt in vLLM's prefix cache;
* a field that one body holds as ``null`` and the other leaves out: vLLM's non-streaming body
  lists every field of its schema (``refusal``, ``audio``, ``kv_transfer_params``, ...), its
  stream leaves out the unset ones, so the gateway cannot know them; to an OpenAI client,
  ``null`` and absent are the same;
* logprobs are compared to 1e-4: the second request's prefill reads the cached prefix, which may
  round differently in the last bits (the tokens themselves must be equal).

One vLLM server serves the module (``--enable-auto-tool-choice --tool-call-parser pythonic``:
vLLM answers a named ``tool_choice`` only with a tool parser; the pythonic one needs no special
tokens, which the tiny model's tokenizer lacks). For a named tool_choice vLLM forces the
arguments with structured outputs, so even random weights make a (JSON-prefix) tool call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import VllmServer, one_server
from .gateway_pool import pool_config
from .test_gateway_vllm import GatewayThread, running_gateway

pytestmark = pytest.mark.e2e

MODEL = "tiny-small"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
GREEDY = {"temperature": 0, "seed": 7, "ignore_eos": True}
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOTE = {"type": "function", "function": {
    "name": "take_note", "parameters": {"type": "object",
                                        "properties": {"text": {"type": "string"}}}}}

# paths not compared ("*": any list index); see the module's docstring for why
IGNORED = {
    ("id",), ("created",),
    ("choices", "*", "message", "tool_calls", "*", "id"),
    ("usage", "prompt_tokens_details", "cached_tokens"),
    ("usage", "prompt_tokens_details", "created_cache_tokens"),
}
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(vllm_python: Path) -> Iterator[VllmServer]:
    with one_server(MODEL, "test_answers", TOOL_FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(server: VllmServer) -> Iterator[GatewayThread]:
    cfg = pool_config([server], quality={"workload": None, "tasks": {"default": {MODEL: 0.5}},
                                         "default_task": "default"})
    with running_gateway(cfg) as gw:
        yield gw


def differences(got: Any, want: Any, path: tuple[Any, ...] = ()) -> list[str]:
    """Where two JSON bodies differ (``IGNORED`` paths left out; ``null`` == absent)."""
    if path in IGNORED:
        return []
    if isinstance(got, dict) and isinstance(want, dict):
        return [d for k in sorted(got.keys() | want.keys())
                for d in differences(got.get(k), want.get(k), (*path, k))]
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, vLLM {len(want)}"]
        return [d for g, w in zip(got, want, strict=True)
                for d in differences(g, w, (*path, "*"))]
    if isinstance(got, float) and isinstance(want, float | int) and not isinstance(want, bool):
        if math.isclose(got, want, rel_tol=LOGPROB_TOLERANCE, abs_tol=LOGPROB_TOLERANCE):
            return []
    elif got == want and type(got) is type(want):
        return []
    return [f"{path}: {got!r}, vLLM {want!r}"]


def both(server: VllmServer, gateway: GatewayThread, path: str, body: dict[str, Any]
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same non-streaming request answered by the gateway and by vLLM directly."""
    body = {"model": MODEL, **body, "stream": False}
    with httpx.Client(timeout=TIMEOUT) as c:
        want = c.post(server.base_url + path, json=body)
        got = c.post(gateway.url + path, json=body)
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("application/json")
    return got.json(), want.json()


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    diffs = differences(got, want)
    assert not diffs, "\n".join(diffs)


def chat(content: str, max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            **GREEDY, **kw}


def completion(prompt: str, max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, **GREEDY, **kw}


def test_plain_chat(server, gateway):
    got, want = both(server, gateway, "/v1/chat/completions", chat("what is the key"))
    assert want["choices"][0]["message"]["content"]  # (something to compare)
    assert_same(got, want)
    assert "tool_calls" not in got["choices"][0]["message"]


def test_chat_logprobs_with_top_logprobs(server, gateway):
    got, want = both(server, gateway, "/v1/chat/completions",
                     chat("name a colour", logprobs=True, top_logprobs=3))
    content = want["choices"][0]["logprobs"]["content"]
    assert len(content) == 8 and all(len(t["top_logprobs"]) == 3 for t in content)
    assert_same(got, want)


def test_completion_logprobs(server, gateway):
    got, want = both(server, gateway, "/v1/completions",
                     completion("the value of the key is", logprobs=2))
    lp = want["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["text_offset"]) == 8 and lp["text_offset"][0] == 0
    assert_same(got, want)


@pytest.mark.parametrize("chat_api", [True, False], ids=["chat", "completions"])
def test_return_token_ids(server, gateway, chat_api):
    path = "/v1/chat/completions" if chat_api else "/v1/completions"
    body = (chat("count to three", return_token_ids=True) if chat_api
            else completion("one two three", return_token_ids=True, logprobs=1))
    got, want = both(server, gateway, path, body)
    ch = want["choices"][0]
    assert len(ch["token_ids"]) == 8
    # vLLM puts the prompt's ids at the top of a chat answer, in the choice of a completion
    assert (want if chat_api else ch)["prompt_token_ids"]
    assert_same(got, want)


def test_named_tool_choice(server, gateway):
    body = chat("what is the weather in Paris", max_tokens=12, tools=[WEATHER, NOTE],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    got, want = both(server, gateway, "/v1/chat/completions", body)
    calls = want["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"].startswith("{")
    assert_same(got, want)
    g = got["choices"][0]
    assert g["message"]["tool_calls"][0]["id"]  # an id, if not vLLM's (drawn per request)
    # a named tool call is "stop" (or "length") in OpenAI's API, not "tool_calls"
    assert g["finish_reason"] == want["choices"][0]["finish_reason"] != "tool_calls"


def test_stop_reason_with_logprobs_and_token_ids_together(server, gateway):
    """Everything at once, ended by a stop string: each piece of each chunk lands in place."""
    base = completion("tell me about the key", max_tokens=12)
    with httpx.Client(timeout=TIMEOUT) as c:
        free = c.post(server.base_url + "/v1/completions", json={"model": MODEL, **base})
    text = free.json()["choices"][0]["text"]
    stop = next((ch for ch in text[len(text) // 2:] if not ch.isspace()), None)
    if stop is None:
        pytest.skip(f"no usable stop character in {text!r}")
    got, want = both(server, gateway, "/v1/completions",
                     {**base, "stop": [stop], "ignore_eos": False, "logprobs": 1,
                      "return_token_ids": True})
    assert want["choices"][0]["stop_reason"] == stop
    assert_same(got, want)
