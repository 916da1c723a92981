"""Smoke test of the real-vLLM pool: each instance serves its model, completes, and streams usage."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_pool_shape(vllm_pool):
    assert [s.name for s in vllm_pool] == ["tiny-small", "tiny-large"]
    assert len({s.port for s in vllm_pool}) == 2
    for s in vllm_pool:
        assert s.block_size > 0
        assert s.num_gpu_blocks > 0
        assert s.max_num_seqs > 0
        assert s.max_num_batched_tokens > 0


def test_models_completions_and_streamed_usage(vllm_pool):
    for server in vllm_pool:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == [server.name]

            r = client.post(
                "/v1/completions",
                json={
                    "model": server.name,
                    "prompt": "hello world",
                    "max_tokens": 5,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            body = r.json()
            assert body["usage"]["completion_tokens"] == 5
            assert body["choices"][0]["finish_reason"] == "length"

            usage = None
            content_chunks = 0
            with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": server.name,
                    "messages": [{"role": "user", "content": "please answer the question"}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ) as stream:
                stream.raise_for_status()
                for line in stream.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        content_chunks += 1
            assert usage is not None, f"{server.name}: no usage chunk in the stream"
            assert usage["completion_tokens"] == 4
            assert usage["prompt_tokens"] > 0
            assert content_chunks >= 1
