"""The engine schedules exactly as vLLM's own scheduler (the installed vLLM 0.32, driven without
a model by ``vllm_scheduler.py``): seeded random cases across budgets, sequence caps,
thresholds, tight and ample KV, full-sequence admission on and off, watermarks and arrivals
over time, plus the targeted cases of each rule (``scheduler_diff.targeted``). Every case must
agree step for step: scheduled tokens per request in order, preemption victims in order, first
tokens, finishes, and how the run ended. ``python tests/e2e/scheduler_diff.py`` prints the
same counts for other seeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .scheduler_diff import (
    cases,
    compare,
    lora_cases,
    preemptions,
    prefix_cases,
    run_engine,
    run_vllm,
    skips,
    targeted,
)

SEED = 0
RANDOM_CASES = 360
PREFIX_CASES = 150
LORA_CASES = 150
MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_engine_schedules_as_vllm(vllm_python: Path, mode: str) -> None:
    asynchronous = mode == "async"
    batch = (cases(SEED, RANDOM_CASES, asynchronous=asynchronous)
             + targeted(asynchronous=asynchronous))
    wants = run_vllm(vllm_python, batch)
    assert len(wants) == len(batch)
    diffs = []
    for case, want in zip(batch, wants, strict=True):
        why = compare(want, run_engine(case))
        if why:
            diffs.append(f"{case['name']}: {why}")
    # the cases exercise what they are for: preemptions, stuck queues, long runs
    assert sum(preemptions(w) for w in wants) > 100
    ends = [w["end"] for w in wants]
    assert ends.count("stuck") >= 3 and ends.count("done") > len(batch) // 3
    assert not diffs, f"{len(diffs)} of {len(batch)} cases differ:\n" + "\n".join(diffs[:10])


def test_the_vllm_runner_reports_prefix_cache_hits(vllm_python: Path) -> None:
    """With caching on, vLLM's scheduler skips the cached full blocks of a shared prompt,
    capped below the request's token count, and the runner reports those hits per admitted
    request; so does the engine."""
    ids = list(range(100, 164))  # 64 tokens: 4 full blocks of 16
    base = {"max_num_batched_tokens": 512, "max_num_seqs": 4, "max_model_len": 1024,
            "block_size": 16, "num_gpu_blocks": 100, "long_prefill_token_threshold": 0}
    reqs = [
        {"id": "a", "prompt_tokens": 64, "prompt_ids": ids, "output_tokens": 2,
         "arrival_step": 0},
        {"id": "b", "prompt_tokens": 64, "prompt_ids": ids, "output_tokens": 2,
         "arrival_step": 5},
        {"id": "c", "prompt_tokens": 80, "prompt_ids": ids + list(range(500, 516)),
         "output_tokens": 2, "arrival_step": 5},
    ]
    off, on = run_vllm(vllm_python, [
        {"name": "off", "config": base, "requests": reqs, "max_steps": 100},
        {"name": "on", "config": {**base, "enable_prefix_caching": True}, "requests": reqs,
         "max_steps": 100}])
    assert off["steps"][5]["scheduled"] == [["b", 64], ["c", 80]]
    assert "hits" not in off["steps"][5]
    # b: all 64 cached, but the last token is recomputed: 3 blocks hit; c: 4 blocks hit
    assert on["steps"][5]["scheduled"] == [["b", 16], ["c", 16]]
    assert on["steps"][5]["hits"] == [["b", 48], ["c", 64]]
    assert all(not st["hits"] for k, st in enumerate(on["steps"]) if k != 5)
    assert compare(on, run_engine({"name": "on", "config": {**base, "enable_prefix_caching":
                                                            True},
                                   "requests": reqs, "max_steps": 100})) is None


@pytest.mark.parametrize("mode", MODES)
def test_engine_caches_prefixes_as_vllm(vllm_python: Path, mode: str) -> None:
    """With prefix caching on (vLLM's block hasher on the requests): tenants' system prompts,
    multi-turn sessions, repeated prompts, KV from ample to tight. Every step agrees, the
    prefix-cache hits of the admitted requests included."""
    batch = prefix_cases(SEED, PREFIX_CASES, asynchronous=mode == "async")
    wants = run_vllm(vllm_python, batch)
    assert len(wants) == len(batch)
    diffs = [f"{case['name']}: {why}" for case, want in zip(batch, wants, strict=True)
             if (why := compare(want, run_engine(case)))]
    # the cases exercise caching: hits on a good share of the prompts, evictions and
    # preemptions under tight KV
    prompt = sum(r["prompt_tokens"] for c in batch for r in c["requests"])
    hits = sum(n for w in wants for st in w["steps"] for _, n in st["hits"])
    assert 0.3 < hits / prompt < 0.8
    assert sum(preemptions(w) for w in wants) > 30
    assert not diffs, f"{len(diffs)} of {len(batch)} cases differ:\n" + "\n".join(diffs[:10])


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "caching"])
@pytest.mark.parametrize("mode", MODES)
def test_engine_caps_lora_adapters_as_vllm(vllm_python: Path, mode: str, caching: bool) -> None:
    """vLLM with ``--enable-lora`` (a ``LoRAConfig`` with ``max_loras`` from 1 to 8) on
    requests for several adapters and the base model: a waiting request whose adapter would
    exceed ``max_loras`` in the step is skipped while later ones pass it, and goes back to the
    queue's front; with prefix caching the adapter is in every block hash. Every step agrees,
    and the cases exercise the rule: later requests pass skipped ones in many cases."""
    batch = lora_cases(SEED, LORA_CASES, asynchronous=mode == "async", caching=caching)
    wants = run_vllm(vllm_python, batch)
    assert len(wants) == len(batch)
    diffs = [f"{case['name']}: {why}" for case, want in zip(batch, wants, strict=True)
             if (why := compare(want, run_engine(case)))]
    assert sum(1 for case, want in zip(batch, wants, strict=True) if skips(case, want)) > 30
    assert sum(preemptions(w) for w in wants) > 30
    if caching:
        assert sum(n for w in wants for st in w["steps"] for _, n in st["hits"]) > 0
    assert not diffs, f"{len(diffs)} of {len(batch)} cases differ:\n" + "\n".join(diffs[:10])
