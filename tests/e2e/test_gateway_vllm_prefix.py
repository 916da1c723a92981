"""Prefix caching live against real vLLM (caching on, as users run it; KV events published).

* The gateway's prompt tokens are vLLM's own (``/tokenize`` is the oracle).
* Its estimate of each request's cached tokens (``x-duetime-cached-tokens``) matches what
  vLLM reports (``usage.prompt_tokens_details.cached_tokens`` and the
  ``vllm:prefix_cache_hits_total`` deltas): within 2% with KV events, 10% without
  (estimated from its own routing).
* A conversation's next turn stays where its prefix is cached when the forecast says that
  instance still meets the target, and a new conversation of the same length does not.
* A server restart (its event stream dies) falls back to the estimate without failing a
  request, and the events take over again once it is back.

Conversations use words drawn here per run (``_words``), so no other test's prompts share a
prefix with them in the servers' caches.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from typing import Any

import httpx
import pytest

from duetime.web.prompt_tokens import PromptTokenizer
from duetime.web.requests import parse_completion

from .conftest import _Proc, _wait_healthy
from .gateway_pool import instance_config, pool_config
from .test_gateway_vllm import TIMEOUT, running_gateway, scrape, wait_until

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "ignore_eos": True}
_rng = random.Random(time.time_ns())
WORDS = ("tea", "leaf", "green", "black", "water", "cup", "pot", "steam", "china", "india",
         "trade", "ship", "port", "silver", "spice", "route", "garden", "hill", "rain", "sun")


def _words(n: int) -> str:
    """``n`` words, opened by a number unique to this call (no prefix shared with any other
    prompt of the session)."""
    return f"{_rng.getrandbits(48)} " + " ".join(_rng.choice(WORDS) for _ in range(n))


def _conversations(k: int, turns: int, system_words: int) -> list[list[dict[str, str]]]:
    """``k`` conversations of ``turns`` user messages; pairs share a system prompt."""
    systems = [_words(system_words) for _ in range((k + 1) // 2)]
    return [[{"role": "system", "content": systems[i // 2]}]
            + [{"role": "user", "content": _words(30)} for _ in range(turns)]
            for i in range(k)]


def _run_sessions(c: httpx.Client, convs: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """Play the conversations turn by turn, one request at a time (round-robin across them);
    per request: the instance, the gateway's cached-token estimate and vLLM's count."""
    history = [[conv[0]] for conv in convs]
    out = []
    for turn in range(1, len(convs[0])):
        for i, conv in enumerate(convs):
            history[i].append(conv[turn])
            body = {"model": "auto", "messages": history[i], "max_tokens": 8, **GREEDY}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            out.append({"instance": r.headers["x-duetime-instance"],
                        "prompt": usage["prompt_tokens"],
                        "estimate": int(r.headers["x-duetime-cached-tokens"]),
                        "vllm": (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens") or 0})
            history[i].append({"role": "assistant",
                               "content": r.json()["choices"][0]["message"]["content"]})
    return out


def _hits(servers: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, s in servers.items():
        m = scrape(s.base_url)
        out[name] = sum(v for (n, _), v in m.items() if n == "vllm:prefix_cache_hits_total")
    return out


class _RequestLog(logging.Handler):
    """The gateway's ``request`` log lines (its own TTFT, decision to first chunk, and the
    forecast), to report the forecasts' error with and without cache hits."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields.get("event") == "request" \
                and fields.get("forecast_ms") and fields.get("ttft_ms") is not None:
            self.rows.append(fields)

    def report(self) -> None:
        for label, hit in (("with hits", True), ("no hits", False)):
            errs = sorted(abs(r["ttft_ms"] / r["forecast_ms"] - 1) for r in self.rows
                          if (r.get("cached_tokens", 0) > 0) == hit)
            if errs:
                print(f"  forecasts {label}: {len(errs)} requests, |observed/forecast - 1| "
                      f"median {statistics.median(errs):.0%}, p90 "
                      f"{errs[int(0.9 * (len(errs) - 1))]:.0%}")


@pytest.fixture(scope="module")
def servers(vllm_pool) -> dict[str, Any]:
    return {s.name: s for s in vllm_pool}


def test_the_gateways_prompt_tokens_are_vllms(servers) -> None:
    """Chat requests rendered by the model's template and encoded as vLLM does: the same ids
    as its ``/tokenize`` (system, multi-turn, text parts, developer role, no generation
    prompt), and a completion's text prompt likewise."""
    s = servers["tiny-small"]
    tok = PromptTokenizer(s.model_dir)
    convs = [
        [{"role": "user", "content": "hello world"}],
        [{"role": "system", "content": _words(40)}, {"role": "user", "content": _words(9)},
         {"role": "assistant", "content": _words(5)}, {"role": "user", "content": "why?"}],
        [{"role": "user", "content": [{"type": "text", "text": "one"},
                                      {"type": "text", "text": "two three"}]}],
        [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    ]
    with httpx.Client(timeout=TIMEOUT) as c:
        for messages in convs:
            for extra in ({}, {"add_generation_prompt": False}):
                body = {"model": s.name, "messages": messages, **extra}
                want = c.post(f"{s.base_url}/tokenize", json=body).json()["tokens"]
                got = tok.ids(parse_completion(json.dumps(body).encode(), chat=True))
                assert got == want, (messages, extra)
        # a conversation that comes back, a turn longer each time: encoded from the kept
        # prefix of its previous turn on, still vLLM's ids
        hits = tok.prefixes.hits
        messages = [{"role": "system", "content": _words(30)}]
        for turn in range(4):
            messages.append({"role": "user", "content": _words(7 + turn)})
            body = {"model": s.name, "messages": messages}
            want = c.post(f"{s.base_url}/tokenize", json=body).json()["tokens"]
            assert tok.ids(parse_completion(json.dumps(body).encode(), chat=True)) == want
            messages.append({"role": "assistant", "content": _words(5 + turn)})
        assert tok.prefixes.hits - hits == 3
        text = _words(50)
        want = c.post(f"{s.base_url}/tokenize", json={"model": s.name, "prompt": text})
        got = tok.ids(parse_completion(json.dumps({"prompt": text}).encode(), chat=False))
        assert got == want.json()["tokens"]


@pytest.mark.parametrize("source", ["kv-events", "estimated"])
def test_the_hit_estimate_matches_vllms_count(vllm_pool, servers, source) -> None:
    """Multi-turn conversations (pairs sharing a system prompt) through the gateway, one
    request at a time: the gateway's cached tokens per request against vLLM's, summed."""
    insts = [instance_config(s) if source == "kv-events"
             else instance_config(s, kv_events=None) for s in vllm_pool]
    cfg = pool_config(vllm_pool, instances=insts)
    before = _hits(servers)
    records = _RequestLog()
    gw_log = logging.getLogger("duetime.gateway")
    level = gw_log.level
    gw_log.setLevel(logging.INFO)
    gw_log.addHandler(records)
    with running_gateway(cfg) as gw, httpx.Client(base_url=gw.url, timeout=TIMEOUT) as c:
        if source == "kv-events":  # (the subscriptions hear their publishers first)
            assert wait_until(lambda: all(
                i["prefix_cache"]["kv_events"]["connected"]
                for i in c.get("/duetime/instances").json()["instances"]), 20.0)
        rows = _run_sessions(c, _conversations(6, 4, 200))
        described = c.get("/duetime/instances").json()["instances"]
        counted = sum(v for (n, _), v in scrape(gw.url).items()
                      if n == "duetime_prefix_cached_tokens_total")
    gw_log.removeHandler(records)
    gw_log.setLevel(level)
    after = _hits(servers)
    records.report()
    est, got = sum(r["estimate"] for r in rows), sum(r["vllm"] for r in rows)
    delta = sum(after.values()) - sum(before.values())
    exact = sum(r["estimate"] == r["vllm"] for r in rows)
    print(f"\n{source}: {len(rows)} requests, cached tokens estimated {est}, vLLM {got} "
          f"(hits_total delta {delta:.0f}); exact per request {exact}/{len(rows)}")
    assert got > 0 and delta == got  # (vLLM's two counts agree; nothing else ran)
    assert counted == est  # (the gateway's metric says the same)
    assert abs(est - got) <= (0.02 if source == "kv-events" else 0.10) * got, rows
    served = {r["instance"] for r in rows}  # (one that got nothing has published no event)
    assert {i["prefix_cache"]["source"] for i in described if i["name"] in served} == {source}


def test_a_turn_stays_where_its_prefix_is_cached_while_the_forecast_allows(vllm_pool) -> None:
    """Turn one of a conversation with a long system prompt goes to tiny-large (asked by
    name); turn two, with a target half of turn one's forecast, goes there again (its prefix
    cached: the forecast meets the target, and tiny-large's quality wins); a new conversation
    of the same length, with the same target, goes to tiny-small (uncached on tiny-large, it
    could not meet it)."""
    with running_gateway(pool_config(vllm_pool)) as gw, \
            httpx.Client(base_url=gw.url, timeout=TIMEOUT) as c:
        system = {"role": "system", "content": _words(250)}
        first = [system, {"role": "user", "content": _words(20)}]
        r1 = c.post("/v1/chat/completions", json={"model": "tiny-large", "messages": first,
                                                  "max_tokens": 4, **GREEDY})
        assert r1.status_code == 200, r1.text
        cold_ms = float(r1.headers["x-duetime-forecast-ttft-ms"])
        target = {"x-duetime-ttft-ms": f"{cold_ms / 2:.0f}"}
        second = [*first, {"role": "assistant", "content": r1.json()["choices"][0]["message"][
            "content"]}, {"role": "user", "content": _words(20)}]
        r2 = c.post("/v1/chat/completions", headers=target, json={
            "model": "auto", "messages": second, "max_tokens": 4, **GREEDY})
        other = [{"role": "system", "content": _words(250)},
                 {"role": "user", "content": _words(60)}]
        r3 = c.post("/v1/chat/completions", headers=target, json={
            "model": "auto", "messages": other, "max_tokens": 4, **GREEDY})
    assert r2.status_code == 200 and r3.status_code == 200
    assert r2.headers["x-duetime-instance"] == "large", dict(r2.headers)
    assert int(r2.headers["x-duetime-cached-tokens"]) > 0.7 * r2.json()["usage"][
        "prompt_tokens"]
    assert r3.headers["x-duetime-instance"] == "small", dict(r3.headers)


def test_a_restart_falls_back_to_the_estimate_and_events_resume(vllm_pool, servers, vllm_python,
                                                                tmp_path) -> None:
    """A third server (tiny-small, model ``tiny-small-2`` in the pool) is killed: its event
    stream dies, its view falls back to the estimate, requests for ``auto`` keep succeeding;
    restarted, it publishes again from sequence 0 and the gateway starts over from its events
    (a restart counted)."""
    small = servers["tiny-small"]
    from .conftest import _free_port

    proc = _Proc("tiny-small", small.size, small.model_dir, _free_port(), 0,
                 tmp_path / "extra.log")
    proc.start(vllm_python)
    try:
        _wait_healthy([proc], 300.0)
        extra = instance_config(small, name="extra", url=proc.base_url, model="tiny-small-2",
                                served_model="tiny-small",
                                kv_events={"endpoint": proc.kv_events,
                                           "replay": proc.kv_events_replay})
        cfg = pool_config(vllm_pool, instances=[*[instance_config(s) for s in vllm_pool],
                                                extra],
                          quality={"workload": None, "default_task": "default", "tasks": {
                              "default": {"tiny-small": 0.5, "tiny-small-2": 0.6,
                                          "tiny-large": 0.8}}})
        with running_gateway(cfg) as gw, httpx.Client(base_url=gw.url, timeout=TIMEOUT) as c:
            def state() -> dict[str, Any]:
                return {i["name"]: i for i in c.get("/duetime/instances").json()["instances"]
                        }["extra"]["prefix_cache"]

            def ask(model: str) -> httpx.Response:
                r = c.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": _words(60)}],
                    "max_tokens": 2, **GREEDY})
                assert r.status_code == 200, r.text
                return r

            for _ in range(3):
                ask("tiny-small-2")
            assert wait_until(lambda: state()["source"] == "kv-events", 20.0), state()
            proc.stop()
            assert wait_until(lambda: state()["source"] == "estimated", 20.0), state()
            for _ in range(4):  # nothing fails while it is gone (retried elsewhere, ejected)
                ask("auto")
            proc.start(vllm_python)
            _wait_healthy([proc], 300.0)
            assert wait_until(lambda: state()["kv_events"]["connected"], 30.0), state()

            assert wait_until(lambda: {i["name"]: i for i in c.get(
                "/duetime/instances").json()["instances"]}["extra"]["healthy"], 30.0)

            def resumed() -> bool:
                ask("tiny-small-2")
                st = state()
                return st["source"] == "kv-events" and st["kv_events"]["restarts"] >= 1
            assert wait_until(resumed, 60.0, interval=0.5), state()
    finally:
        proc.stop()
