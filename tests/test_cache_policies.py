"""Prefix-cache views (the estimated LRU index) and the cache-aware baselines: llm-d's default
scorer profile (``prefix-load``) and SGLang's router cache-aware policy (``cache-aware``)."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.cli import main
from duetime.estimate import EstimatedPrefixIndex, prefix_index_of
from duetime.policy import (
    INPUTS,
    Candidate,
    RoutingRequest,
    consumes,
    describe,
    make_policy,
    policy_names,
    queue_score,
)

# -- the estimated index --------------------------------------------------------------------------


def test_match_counts_leading_cached_blocks_and_stops_at_the_first_miss() -> None:
    idx = EstimatedPrefixIndex(16, 100)
    assert (idx.block_size, idx.capacity_blocks, idx.cached_blocks()) == (16, 100, 0)
    assert idx.match([1, 2, 3]) == 0 and idx.match([]) == 0
    idx.record([1, 2, 3])
    assert idx.cached_blocks() == 3
    assert idx.match([1, 2, 3, 4]) == 3
    assert idx.match([1, 9, 3]) == 1          # block 3 is cached but follows a miss
    assert idx.match([9, 1, 2]) == 0
    idx.record([1, 2, 3])                       # recording again adds nothing
    assert idx.cached_blocks() == 3
    # numpy int64 arrays (as duetime.workload.segments.block_hashes gives them) and ints agree
    idx.record(np.array([1, 2, 3, 40, 50], dtype=np.int64))
    assert idx.cached_blocks() == 5 and idx.match([1, 2, 3, 40, 50, 60]) == 5
    assert idx.match(np.array([1, 2, 3, 40], dtype=np.int64)) == 4


def test_lru_evicts_the_least_recent_blocks_in_recording_order() -> None:
    idx = EstimatedPrefixIndex(16, 4)
    idx.record([1, 2, 3])
    idx.record([4, 5])                          # 5 blocks > 4: the oldest (1) goes
    assert idx.cached_blocks() == 4
    assert 1 not in idx and all(h in idx for h in (2, 3, 4, 5))
    assert idx.match([1, 2]) == 0 and idx.match([2, 3, 4]) == 3
    # a prompt is recorded in order (its last block the most recent): 2, 3, 4 go, 5 stays
    idx.record([10, 11, 12])
    assert [h in idx for h in (2, 3, 4, 5, 10, 11, 12)] == [False] * 3 + [True] * 4


def test_record_refreshes_recency_and_match_does_not() -> None:
    idx = EstimatedPrefixIndex(16, 3)
    idx.record([1, 2, 3])
    idx.record([1])                             # 1 is now the most recent: 2 is the oldest
    idx.record([4])
    assert 2 not in idx and all(h in idx for h in (1, 3, 4))
    assert idx.match([3]) == 1                  # a lookup leaves 3 the oldest ...
    idx.record([5])
    assert 3 not in idx and all(h in idx for h in (1, 4, 5))  # ... so it goes next


def test_index_arguments_and_views_without_an_index() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EstimatedPrefixIndex(0, 10)
    with pytest.raises(ValueError, match="capacity_blocks"):
        EstimatedPrefixIndex(16, 0)
    assert prefix_index_of(View()) is None
    v = View(index=EstimatedPrefixIndex(16, 8))
    assert prefix_index_of(v) is v.prefix_index
    # a long prompt costs O(blocks): 20,000 blocks recorded and matched at once
    big = EstimatedPrefixIndex(16, 10_000)
    big.record(range(20_000))
    assert big.cached_blocks() == 10_000 and big.match(range(10_000, 20_000)) == 10_000


# -- fakes ----------------------------------------------------------------------------------------

class View:
    """A hand-built instance view, with a prefix index when given one."""

    def __init__(self, running=0, waiting=0, kv=0.0, index=None):
        self.num_running = running
        self.num_waiting = waiting
        self.kv_usage = kv
        self.request_overhead_s = 0.0
        if index is not None:
            self.prefix_index = index


class Prompt:
    """``prompt_hashes``: the first ``n`` of ``hashes`` (full blocks of 16 tokens); another
    block size gets other hashes (block k of size b: ``(b, hashes[...])``). Counts its calls."""

    def __init__(self, hashes, tokens=None):
        self.hashes = list(hashes)
        self.tokens = tokens if tokens is not None else 16 * len(self.hashes)
        self.calls: list[int] = []

    def __call__(self, block_size: int):
        self.calls.append(block_size)
        if block_size == 16:
            return list(self.hashes)
        n = self.tokens // block_size
        return [hash((block_size, tuple(self.hashes[:(k + 1) * block_size // 16])))
                for k in range(n)]


def cands(*views):
    return [Candidate(f"i{k}", "m", 0.0, 0.0, v) for k, v in enumerate(views)]


def rq(prompt: Prompt | None, tokens: int | None = None) -> RoutingRequest:
    n = tokens if tokens is not None else (prompt.tokens if prompt else 160)
    return RoutingRequest("r", n, None, np.array([10, 10, 10]), float("inf"),
                          prompt_hashes=prompt)


def idx(*hashes, capacity=1000, block_size=16):
    i = EstimatedPrefixIndex(block_size, capacity)
    if hashes:
        i.record(hashes)
    return i


A = list(range(1, 11))            # a 10-block prompt
B = [*A[:5], 101, 102, 103]       # shares A's first 5 blocks


# -- prefix-load ----------------------------------------------------------------------------------

def test_queue_scorer_is_min_max_normalised() -> None:
    assert queue_score(np.array([0.0, 5.0, 10.0])).tolist() == [1.0, 0.5, 0.0]
    assert queue_score(np.array([3.0, 3.0])).tolist() == [1.0, 1.0]


def test_prefix_load_prefers_the_cached_prefix_when_loads_are_equal() -> None:
    p = make_policy("prefix-load")
    views = [View(2, 1, index=idx(*B)), View(2, 1, index=idx(*A)), View(2, 1, index=idx())]
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 1
    # B matches 8/8 on i0 and 5/8 on i1
    assert p.choose(rq(Prompt(B)), cands(*views), 0).index == 0
    scores = p.prefix_scores([v.prefix_index for v in views], lambda bs: B)
    assert scores.tolist() == [1.0, 5 / 8, 0.0]


def test_prefix_load_weights_matter() -> None:
    # i0 holds the prompt but has the longer queue; i1 is idle and cold
    views = [View(0, 10, index=idx(*A)), View(0, 0, index=idx())]
    # defaults (prefix 3, queue 2, kv 2): i0 = 3 + 0 + 2 = 5 > i1 = 0 + 2 + 2 = 4
    assert make_policy("prefix-load").choose(rq(Prompt(A)), cands(*views), 0).index == 0
    p = make_policy("prefix-load", {"prefix-weight": 1})  # i0 = 1 + 0 + 2 < i1 = 0 + 2 + 2
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 1
    # kv-cache utilization: with no prefix anywhere, the emptier cache wins
    views = [View(0, 0, kv=0.9, index=idx()), View(0, 0, kv=0.1, index=idx())]
    assert make_policy("prefix-load").choose(rq(Prompt(A)), cands(*views), 0).index == 1
    # llm-d's estimate-mode sample: prefix-cache 1 + load-aware 1 (load-aware off by default)
    est = {"prefix-weight": 1, "load-weight": 1, "queue-weight": 0, "kv-weight": 0}
    views = [View(0, 0, index=idx(*A[:5])), View(0, 64, index=idx(*A))]
    # i0 = 0.5 + 0.5; i1 = 1.0 + 0.5 (1 - 64/128) = 1.25
    assert make_policy("prefix-load", est).choose(rq(Prompt(A)), cands(*views), 0).index == 1
    # 128 waiting: i1 = 1.0 + 0 ties i0 = 0.5 + 0.5, broken at random
    picks = {make_policy("prefix-load", {**est, "seed": s}).choose(
        rq(Prompt(A)), cands(View(0, 0, index=idx(*A[:5])), View(0, 128, index=idx(*A))),
        0).index for s in range(20)}
    assert picks == {0, 1}


def test_prefix_load_records_its_choice_and_learns_affinity() -> None:
    views = [View(index=idx()), View(index=idx()), View(index=idx())]
    p = make_policy("prefix-load", {"seed": 3})
    first = p.choose(rq(Prompt(A)), cands(*views), 0).index
    assert views[first].prefix_index.match(A) == 10
    assert sum(v.prefix_index.cached_blocks() for v in views) == 10  # only the chosen one learnt
    # the same prompt, and one sharing its prefix, follow it while loads stay equal
    for prompt in (A, B, A):
        assert p.choose(rq(Prompt(prompt)), cands(*views), 0).index == first


def test_prefix_load_tie_break_is_seeded() -> None:
    def run(seed):
        p = make_policy("prefix-load", {"seed": seed})
        views = [View(index=idx()) for _ in range(3)]
        return [p.choose(rq(Prompt([100 * k + j for j in range(4)])), cands(*views), 0).index
                for k in range(12)]

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(5)}) > 1
    assert set().union(*[set(run(s)) for s in range(5)]) == {0, 1, 2}


def test_prefix_load_matches_at_most_max_prefix_blocks() -> None:
    long = list(range(1000, 1300))              # 300 blocks; the index holds the first 256
    views = [View(index=idx(*long[:256])), View(index=idx())]
    p = make_policy("prefix-load")
    scores = p.prefix_scores([v.prefix_index for v in views], lambda bs: long[:256])
    assert scores.tolist() == [1.0, 0.0]
    assert p.choose(rq(Prompt(long)), cands(*views), 0).index == 0
    fresh = [View(index=idx()), View(0, 5, index=idx())]
    assert p.choose(rq(Prompt(long)), cands(*fresh), 0).index == 0
    assert fresh[0].prefix_index.cached_blocks() == 256          # recorded as matched: cut
    unlimited = make_policy("prefix-load", {"max-prefix-blocks": 0})
    fresh = [View(index=idx()), View(0, 5, index=idx())]
    unlimited.choose(rq(Prompt(long)), cands(*fresh), 0)
    assert fresh[0].prefix_index.cached_blocks() == 300


def test_each_instance_is_matched_in_its_own_block_size_and_hashes_are_asked_once() -> None:
    prompt = Prompt(A)
    h32 = prompt(32)
    prompt.calls.clear()
    views = [View(index=idx(*h32, block_size=32)), View(index=idx(block_size=16)),
             View(index=idx(block_size=32))]
    assert make_policy("prefix-load").choose(rq(prompt), cands(*views), 0).index == 0
    assert sorted(prompt.calls) == [16, 32]     # once per block size, not per instance
    prompt.calls.clear()
    assert make_policy("cache-aware").choose(rq(prompt), cands(*views), 0).index == 0
    assert sorted(prompt.calls) == [16, 32]


@pytest.mark.parametrize("name", ["prefix-load", "cache-aware"])
def test_without_hashes_or_indexes_the_policies_balance_load(name) -> None:
    # no prompt hashes: nothing matches, nothing is recorded; the least loaded instance wins
    views = [View(3, 4, index=idx(*A)), View(1, 0, index=idx()), View(5, 9, index=idx())]
    p = make_policy(name)
    assert p.choose(rq(None), cands(*views), 0).index == 1
    assert [v.prefix_index.cached_blocks() for v in views] == [10, 0, 0]
    # views without an index (as the simulator gives today)
    assert p.choose(rq(Prompt(A)), cands(View(3, 4), View(1, 0), View(5, 9)), 0).index == 1


# -- cache-aware ----------------------------------------------------------------------------------

def test_cache_aware_follows_the_prefix_when_loads_are_balanced() -> None:
    p = make_policy("cache-aware")
    views = [View(10, 0, index=idx(*B)), View(12, 0, index=idx(*A)), View(8, 0, index=idx())]
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 1   # 10/10 blocks, load 12
    assert views[1].prefix_index.cached_blocks() == 10
    # balanced needs only one of the two tests to fail: 140 vs 100 differ by 40 <= 64 ...
    views = [View(100, 0, index=idx()), View(140, 0, index=idx(*A))]
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 1
    # ... 280 vs 200 differ by 80 > 64, but 280 <= 1.5 x 200
    views = [View(200, 0, index=idx()), View(200, 80, index=idx(*A))]
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 1


def test_cache_aware_balances_load_when_imbalanced_and_still_records() -> None:
    p = make_policy("cache-aware")
    views = [View(5, 5, index=idx()), View(60, 40, index=idx(*A))]   # 100 - 10 > 64, > 15
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 0
    assert views[0].prefix_index.match(A) == 10       # SGLang inserts in this branch too
    loose = make_policy("cache-aware", {"balance-abs-threshold": 100})
    views = [View(5, 5, index=idx()), View(60, 40, index=idx(*A))]
    assert loose.choose(rq(Prompt(A)), cands(*views), 0).index == 1


def test_cache_aware_goes_to_the_smallest_cache_below_the_threshold() -> None:
    # a 10-block prompt; i0 holds its first 2 blocks (rate 0.2 <= 0.3) among 20 cached blocks
    views = [View(index=idx(*A[:2], *range(500, 518))), View(index=idx(*range(600, 605))),
             View(index=idx(*range(700, 708)))]
    assert make_policy("cache-aware").choose(rq(Prompt(A)), cands(*views), 0).index == 1
    views = [View(index=idx(*A[:2], *range(500, 518))), View(index=idx(*range(600, 605)))]
    p = make_policy("cache-aware", {"cache-threshold": 0.1})
    assert p.choose(rq(Prompt(A)), cands(*views), 0).index == 0
    # equally small caches: the lower load, then at random
    views = [View(4, 0, index=idx(1, 2)), View(1, 1, index=idx(3, 4)), View(0, 0, index=idx(*A))]
    assert make_policy("cache-aware").choose(rq(Prompt([77, 78])), cands(*views), 0).index == 1


def test_cache_aware_rate_is_matched_tokens_over_prompt_tokens() -> None:
    # 10 full blocks cached of a 170-token prompt: 160/170; of a 600-token one: 0.27 <= 0.3
    views = [View(index=idx(*A)), View(index=idx())]
    assert make_policy("cache-aware").choose(rq(Prompt(A, 170)), cands(*views), 0).index == 0
    views = [View(index=idx(*A)), View(index=idx())]
    assert make_policy("cache-aware").choose(rq(Prompt(A, 600)), cands(*views), 0).index == 1


def test_cache_aware_tie_break_is_seeded() -> None:
    def run(seed):
        p = make_policy("cache-aware", {"seed": seed})
        return [p.choose(rq(Prompt([k])), cands(View(), View(), View()), 0).index
                for k in range(10)]

    assert run(1) == run(1)
    assert set().union(*[set(run(s)) for s in range(5)]) == {0, 1, 2}


# -- the registry ---------------------------------------------------------------------------------

def test_the_cache_aware_policies_are_registered(capsys) -> None:
    names = policy_names()
    assert names.index("cache-aware") == names.index("prefix-load") + 1
    assert "prefix_cache" in INPUTS
    for name in ("prefix-load", "cache-aware"):
        assert consumes(name) == {"load", "prefix_cache"}
    p = make_policy("prefix-load")
    assert (p.prefix_weight, p.queue_weight, p.kv_weight, p.load_weight,
            p.max_prefix_blocks) == (3.0, 2.0, 2.0, 0.0, 256)
    c = make_policy("cache-aware", {"cache-threshold": "0.5", "balance-abs-threshold": "32"})
    assert (c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold) == (
        0.5, 32, 1.5)
    assert make_policy("cache-aware").cache_threshold == 0.3
    text = describe(["prefix-load", "cache-aware"])
    assert "prefix-weight (default 3)" in text and "balance-rel-threshold (default 1.5)" in text
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "prefix-load: llm-d's default scorer profile" in out
    assert "cache-aware: SGLang router's cache-aware policy" in out
    assert "  prefix_cache: each instance's prefix-cache index" in out


@pytest.mark.parametrize("name", ["prefix-load", "cache-aware"])
def test_the_simulator_runs_them_without_prefix_indexes(name) -> None:
    from duetime.sim import ClusterSim
    from duetime.workload import load_workload, sample_requests

    prof = load_workload("paper")
    rs = sample_requests(prof, np.arange(40) * 0.2, np.random.default_rng(0))
    ClusterSim(prof, make_policy(name), seed=0).run(rs)
