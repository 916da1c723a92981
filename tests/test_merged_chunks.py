"""Chunks that carry several tokens: an API server that falls behind merges the tokens a stream
has not taken yet into one chunk (vLLM's per-request output collector; the emulator behind an
emulated frontend does the same), so the gateway counts tokens with the count vLLM puts in
every chunk when asked (``stream_options.continuous_usage_stats``) and cuts that count from
what clients that did not ask see."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from duetime.web.sse import tokens_so_far, without_usage
from test_gateway import PRICE, gateway, run

TOKEN = b'data: {"id":"c","choices":[{"index":0,"text":"tok tok "}]'


def test_a_chunk_says_how_many_tokens_came_so_far() -> None:
    assert tokens_so_far(TOKEN + b',"usage":{"prompt_tokens":3,"total_tokens":9,'
                         b'"completion_tokens":6}}') == 6
    assert tokens_so_far(b'{"usage": {"completion_tokens": 12}}') == 12  # (spaced JSON)
    assert tokens_so_far(TOKEN + b"}") is None
    assert tokens_so_far(b'{"completion_tokens":null}') is None


def test_the_usage_the_gateway_asked_for_is_cut_cleanly() -> None:
    ev = (TOKEN + b',"usage":{"prompt_tokens":3,"completion_tokens":2,'
          b'"completion_tokens_details":{"reasoning_tokens":0}}}')
    cut = without_usage(ev)
    assert cut == TOKEN + b"}"
    assert json.loads(cut[6:])["choices"][0]["text"] == "tok tok "
    assert without_usage(TOKEN + b"}") == TOKEN + b"}"
    broken = TOKEN + b',"usage":{"prompt_tokens":3'  # (cannot be cut: left as it is)
    assert without_usage(broken) == broken


def _pool(continuous: bool) -> dict[str, Any]:
    return {"policy": "sfs", "quality": {"workload": None, "tasks": {"chat": {"m": 0.5}}},
            "instances": [{"name": "e", "model": "m", "profile": "qwen3-0.6b",
                           "emulate": {"speed": 4.0, "enable_prefix_caching": False},
                           "frontend": {"request_ms": 1.0, "chunk_ms": 4.0},
                           "price_usd_per_mtok": PRICE}],
            "state": {"source": "shadow", "continuous_usage": continuous}}


def _through_gateway(continuous: bool, client_asks: bool
                     ) -> tuple[list[list[dict[str, Any]]], list[int]]:
    """Four 24-token streams at once through a gateway over an emulated vLLM whose API server
    falls behind (4 ms per chunk): what each client got, and the token count the gateway had
    for each stream when it ended."""
    async def go() -> tuple[list[list[dict[str, Any]]], list[int]]:
        async with gateway(_pool(continuous)) as (svc, c):
            life = svc.gateway.lifecycle
            seen: dict[str, int] = {}
            record = life.record_progress

            def spy(a, tokens: int) -> None:
                seen[a.flight.id] = max(seen.get(a.flight.id, 0), tokens)
                record(a, tokens)

            life.record_progress = spy  # type: ignore[method-assign]
            opts: dict[str, Any] = {"include_usage": True}
            if client_asks:
                opts["continuous_usage_stats"] = True

            async def one() -> list[dict[str, Any]]:
                body = {"model": "m", "prompt": "go", "max_tokens": 24, "ignore_eos": True,
                        "stream": True, "stream_options": opts}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    return [json.loads(line[6:]) async for line in r.aiter_lines()
                            if line.startswith("data: {")]

            got = await asyncio.gather(*(one() for _ in range(4)))
            return list(got), list(seen.values())

    return run(go(), timeout=60)


@pytest.mark.parametrize("client_asks", [False, True], ids=["client-plain", "client-asks"])
def test_the_gateway_counts_the_tokens_of_merged_chunks(client_asks: bool) -> None:
    streams, counted = _through_gateway(True, client_asks)
    merged = 0
    for chunks in streams:
        tokens = [c for c in chunks if c["choices"]]
        texts = [c["choices"][0]["text"].count("tok ") for c in tokens]
        assert sum(texts) == 24
        merged += sum(t > 1 for t in texts)
        # the client sees the per-chunk usage only if it asked for it
        assert all(("usage" in c) == client_asks for c in tokens)
        assert chunks[-1]["usage"]["completion_tokens"] == 24  # (the usage chunk: always)
    assert merged > 0
    assert counted == [24] * 4


def test_without_continuous_usage_a_merged_chunk_counts_as_one_token() -> None:
    """``state.continuous_usage: false`` (a server that rejects the option): the gateway counts
    one token per chunk, short where chunks were merged -- what the option is for."""
    streams, counted = _through_gateway(False, False)
    assert all(sum(c["choices"][0]["text"].count("tok ") for c in chunks if c["choices"]) == 24
               for chunks in streams)
    assert len(counted) == 4 and min(counted) < 24
