"""Multi-turn KV-lookup conversations: seeded, prompts that grow along the context ladder and
share the earlier turns' blocks; and ttca pricing a cached prefix."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.policy import Candidate, RoutingRequest, make_policy
from duetime.sim.cache_view import keys_by_block_size
from duetime.sim.instance import SimInstance
from duetime.workload.kvlookup import load_pool
from duetime.workload.kvlookup.conversations import conversations
from duetime.workload.segments import block_hashes


def _same(a, b) -> bool:
    return (a.added == b.added and np.array_equal(a.answer_ids, b.answer_ids)
            and np.array_equal(a.correct, b.correct) and np.array_equal(a.success, b.success))


def test_conversations_are_seeded() -> None:
    pool = load_pool()
    a = conversations(pool, 6, "en", 0, 4, seed=1)
    b = conversations(pool, 6, "en", 0, 4, seed=1)
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    c = conversations(pool, 6, "en", 0, 4, seed=2)
    assert not all(np.array_equal(x.correct, y.correct) for x, y in zip(a, c, strict=True))
    # every conversation has its own content; every (turn, model) answer is its own
    ids = [s for conv in a for turn in conv.added for s, _ in turn]
    ids += [int(x) for conv in a for x in conv.answer_ids.ravel()]
    assert len(ids) == len(set(ids))


def test_turns_grow_along_the_ladder_and_share_the_previous_turns_blocks() -> None:
    pool = load_pool()
    conv = conversations(pool, 1, "ja", 1, 3, seed=0)[0]
    assert conv.turns == 3 and conv.context_index == (1, 2, 3)
    kept = [2, 0]  # the answers the conversation kept: phi3-mini's, then granite3.1-2b's
    for k in range(3):
        p = conv.prompt(k, kept)
        assert sum(n for _, n in p) == pool.contexts[1 + k]
        if k:
            before = (*conv.prompt(k - 1, kept),
                      (int(conv.answer_ids[k - 1, kept[k - 1]]), conv.answer_tokens))
            assert p[:len(before)] == before
            prev, now = block_hashes(before, 16), block_hashes(p, 16)
            assert np.array_equal(now[:len(prev)], prev) and len(now) > len(prev)
            # another model's answer to the previous turn shares only the prompt's blocks
            other = conv.prompt(k, [1] * k)
            split = sum(n for _, n in conv.prompt(k - 1, kept)) // 16
            o = block_hashes(other, 16)
            if k == 1:
                assert np.array_equal(o[:split], now[:split]) and o[split] != now[split]


def test_follow_up_questions_on_one_document() -> None:
    """``grow=False``: turn 1 brings the document, later turns only a question; every turn is
    judged at the document's length, and each later prompt extends the one before."""
    pool = load_pool()
    conv = conversations(pool, 1, "en", 3, 4, seed=0, grow=False)[0]
    assert conv.context_index == (3, 3, 3, 3)
    kept = [0, 1, 0]
    lengths = [sum(n for _, n in conv.prompt(k, kept)) for k in range(4)]
    assert lengths[0] == pool.contexts[3]
    assert np.diff(lengths).tolist() == [conv.answer_tokens + 40] * 3
    assert all(len(conv.added[k]) == 1 for k in (1, 2, 3))  # a question alone
    with pytest.raises(ValueError, match="context lengths"):
        conversations(pool, 1, "en", 5, 4, seed=0, grow=False)


def test_correctness_follows_the_pool_per_model_language_and_length() -> None:
    pool = load_pool()
    names = list(pool.models)
    convs = conversations(pool, 400, "en", 1, 4, seed=3)
    rate = np.mean([c.correct for c in convs], axis=0)  # (turns, models)
    p = np.array([[pool.models[m].p_success("en", ci) for m in names] for ci in (1, 2, 3, 4)])
    assert np.abs(rate - p).max() < 0.09
    swallow = names.index("llama3.1-swallow-8b")
    assert rate[0, swallow] > 0.8 > 0.4 > rate[2, swallow]  # 8K vs 32K
    # the router's success model: fitted on queries of its own, close to the pool's
    assert np.abs(convs[0].success - p).max() < 0.25
    assert all(np.array_equal(c.success, convs[0].success) for c in convs)


def test_conversations_reject_a_ladder_past_the_pool() -> None:
    pool = load_pool()
    with pytest.raises(ValueError, match="context lengths"):
        conversations(pool, 1, "en", 2, 4, seed=0)
    with pytest.raises(ValueError, match="language"):
        conversations(pool, 1, "fr", 0, 2, seed=0)


def test_ttca_prices_a_cached_prefix() -> None:
    """Two identical instances, the prompt's prefix cached on the second: ttca's end-to-end
    forecast counts the hit (without the prompt's hashes the two tie and the first wins)."""
    pool = load_pool()
    spec = pool.models["phi3-mini"].spec
    spec = replace(spec, config=replace(spec.config, enable_prefix_caching=True))
    insts = [SimInstance(f"i{k}", spec) for k in range(2)]
    doc = ((1, 16000),)
    insts[1].submit("warm", 16000, 1, 1, 0.0, block_hashes(doc, 16))
    insts[1].drain()
    for inst in insts:
        inst.engine.advance_clock(100.0)
        inst.now = 100.0
    cands = [Candidate(i.name, "phi3-mini", 0.0, 0.0, i) for i in insts]
    prompt = (*doc, (2, 384))
    req = RoutingRequest("r", 16384, None, np.array([40, 40]), float("inf"), "kv-lookup",
                         success=np.array([0.9, 0.9]), prompt_hashes=keys_by_block_size(prompt))
    p = make_policy("ttca")
    d = p.choose(req, cands, 100.0)
    blind = p.choose(replace(req, prompt_hashes=None), cands, 100.0)
    assert d.index == 1 and blind.index == 0
    assert d.forecast < 0.5 * blind.forecast  # 16,000 of 16,384 prompt tokens cached
