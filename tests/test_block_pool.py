"""Prefix caching in the engine's block ledger: vLLM 0.32's block pool rules one by one, and
the reference loop with caching (the differential suite, ``tests/e2e/test_scheduler_diff.py``,
checks it step for step against vLLM's own scheduler)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from duetime.engine import KVLedger, Paper4, ReferenceEngine, Request, SchedulerConfig
from duetime.engine.block_pool import BlockPool

MODEL = Paper4(b0=1e-3, b1=1e-5, b2=0.0, b3=0.0)


def test_the_free_queue_starts_after_the_null_block_and_allocates_from_its_head():
    pool = BlockPool(6)
    assert pool.queue() == [1, 2, 3, 4, 5] and pool.free_count == 5
    assert pool.allocate(2) == [1, 2]
    assert pool.queue() == [3, 4, 5] and pool.ref[1] == pool.ref[2] == 1


def test_freed_blocks_go_to_the_front_unless_cached_then_to_the_tail():
    pool = BlockPool(8)
    a = pool.allocate(3)  # 1 2 3
    pool.cache(a[0], "h0")
    pool.cache(a[1], "h1")
    pool.free(a)  # last first: 3 (no hash) to the front; 2, then 1 (cached) to the tail
    assert pool.queue() == [3, 4, 5, 6, 7, 2, 1]
    # a new allocation takes the unhashed block first, cached ones last (LRU)
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 2]
    assert "h1" not in pool.cached and pool.cached["h0"] == {1: None}  # 2 was evicted


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.cache(a[0], "h0")
    pool.free(a)
    assert pool.lookup(["h0", "h1"]) == [1] and pool.evictable([1]) == 1
    pool.touch([1])
    assert pool.free_count == 3 and 1 not in pool.queue() and pool.evictable([1]) == 0
    pool.touch([1])  # a second holder: nothing leaves the queue
    assert pool.free_count == 3 and pool.ref[1] == 2
    pool.free([1])
    pool.free([1])
    assert pool.queue()[-1] == 1


def test_duplicates_are_kept_and_a_lookup_takes_the_first_registered():
    pool = BlockPool(6)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a[0], "h")
    pool.cache(b[0], "h")
    assert pool.lookup(["h"]) == a
    pool.free(a)
    pool.free(b)
    pool.allocate(3)  # 3 4 5: both cached blocks stay
    assert pool.allocate(1) == a  # a is evicted first (freed first): b remains cached
    assert pool.lookup(["h"]) == b


def test_the_lookup_stops_at_the_first_miss_and_below_the_last_token():
    kv = KVLedger(20, 4, caching=True)
    first = Request("a", 12, 3, hashes=["x0", "x1", "x2"])
    kv.take(first, 3, 12)
    assert first.num_cached == 3
    # the same 12 tokens: 2 blocks hit (the last token is recomputed, so not the third)
    assert kv.lookup(Request("b", 12, 3, hashes=["x0", "x1", "x2"])) == first.block_ids[:2]
    assert kv.lookup(Request("c", 13, 3, hashes=["x0", "x1", "x2"])) == first.block_ids
    assert kv.lookup(Request("d", 13, 3, hashes=["x0", "y1", "x2"])) == first.block_ids[:1]
    assert kv.lookup(Request("e", 13, 3)) == []  # no hashes: its own keys, no hit


def _conversation_engine(num_gpu_blocks: int, caching: bool = True) -> ReferenceEngine:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=2048,
                          block_size=16, num_gpu_blocks=num_gpu_blocks,
                          enable_prefix_caching=caching)
    return ReferenceEngine(cfg, MODEL)


def test_a_second_request_with_the_same_system_prompt_computes_only_its_own_part():
    eng = _conversation_engine(100)
    system = [f"s{i}" for i in range(10)]  # 160 tokens of shared system prompt
    eng.add(Request("a", 200, 2, hashes=[*system, "a10", "a11"]))
    while not eng.idle:
        eng.step()
    eng.add(Request("b", 180, 2, hashes=[*system, "b10"]))
    rec = eng.step()
    assert rec.hits == [("b", 160)] and rec.scheduled == [("b", 20)]
    assert eng.free_blocks == eng.config.usable_blocks - 12  # b holds 12 (10 of them shared)
    # without caching it computes the whole prompt
    off = _conversation_engine(100, caching=False)
    off.add(Request("b", 180, 2))
    assert off.step().scheduled == [("b", 180)]


def test_caching_with_nothing_shared_schedules_as_without_caching():
    rng = random.Random(3)
    for _ in range(20):
        reqs = [(rng.randint(1, 400), rng.randint(1, 30)) for _ in range(rng.randint(1, 8))]
        runs = []
        for caching in (False, True):
            eng = _conversation_engine(2000, caching)
            for i, (p, o) in enumerate(reqs):
                eng.add(Request(f"r{i}", p, o))
            steps = []
            while not eng.idle:
                steps.append(eng.step().scheduled)
            runs.append(steps)
        assert runs[0] == runs[1]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_blocks_are_conserved_under_eviction_and_preemption(asynchronous):
    """Tight KV, shared prefixes, preemptions: at every step, held blocks (each counted once)
    plus the free queue are exactly the usable blocks, and every cached hash maps to a block
    that holds it."""
    rng = random.Random(7)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024,
                          block_size=8, num_gpu_blocks=40, enable_prefix_caching=True,
                          scheduler_reserve_full_isl=False,
                          async_scheduling=asynchronous)
    eng = ReferenceEngine(cfg, MODEL)
    systems = [[f"t{t}.{i}" for i in range(rng.randint(2, 10))] for t in range(3)]
    n = 0
    preempted = hits = 0
    for k in range(600):
        if k % 2 == 0 and n < 60:
            system = rng.choice(systems)
            p = len(system) * 8 + rng.randint(1, 40)
            eng.add(Request(f"r{n}", p, rng.randint(20, 80), hashes=system))
            n += 1
        if eng.idle:
            continue
        rec = eng.step()
        preempted += len(rec.preempted)
        hits += len(rec.hits)
        pool = eng.kv.pool
        held = {b for r in eng.running for b in r.block_ids}
        assert all(pool.ref[b] >= 1 for b in held)
        assert len(held) + pool.free_count == cfg.usable_blocks == len(held) + len(pool.queue())
        for key, blocks in pool.cached.items():
            assert all(pool.key[b] == key for b in blocks)
    assert preempted > 5 and hits > 10


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logged", [False, True])
def test_the_compiled_pool_keeps_the_same_books_as_the_reference(seed, logged):
    """Random allocations, hits, caching and frees (with duplicate keys) on both forms: the
    same blocks handed out, the same free queue, the same lookups. Logged for undo (what a
    forecast does), everything is put back as it was at the end."""
    from duetime.engine import block_pool_kernel as pk

    rng = random.Random(seed)
    n_blocks = rng.choice([8, 30, 100])
    ref = BlockPool(n_blocks)
    pool, kmap = pk.new_pool(n_blocks), pk.new_key_map(n_blocks)
    undo = None
    rb = np.zeros(4096, dtype=np.int64)
    rk = np.zeros(0, dtype=np.int64)
    held: list[list[int]] = []  # per live request, its blocks (the same on both sides)
    used = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and ref.free_count:
            count = rng.randint(1, ref.free_count)
            want = ref.allocate(count)
            pk.pool_allocate(pool, kmap, rb, used, count, undo)
            assert rb[used:used + count].tolist() == want
            used += count
            for b in want:
                if rng.random() < 0.6:
                    key = rng.randint(0, 12)  # few keys: duplicates happen
                    ref.cache(b, key)
                    pk.pool_cache(pool, kmap, b, key, undo)
            held.append(want)
        elif op < 0.6:
            keys = [rng.randint(0, 12) for _ in range(rng.randint(1, 5))]
            want = ref.lookup(keys)
            rk = np.array(keys, dtype=np.int64)
            got = pk.pool_lookup(kmap, rk, 0, len(keys), 0, len(keys), rb, used)
            assert rb[used:used + got].tolist() == want
            if want and rng.random() < 0.7:
                assert pk.pool_evictable(pool, rb, used, got) == ref.evictable(want)
                ref.touch(want)
                pk.pool_touch(pool, rb, used, got, undo)
                held.append(want)
                used += got
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            ref.free(blocks)
            at = used
            rb[at:at + len(blocks)] = blocks
            pk.pool_release(pool, rb, at, len(blocks), undo)
        assert pk.queue_of(pool) == ref.queue()
        assert pool[:n_blocks, 0].tolist() == ref.ref
        if used > 3500:
            used = 0
        if logged and undo is None and rng.random() < 0.05:  # from here on, undoably
            undo = pk.new_undo(pool, kmap)
            start, start_keys = pool.copy(), kmap.copy()
    if undo is not None:
        pk.undo_all(pool, kmap, undo)
        # (the data: each row's and slot's last column is the log's mark)
        assert (pool[:, :pk.SAVED] == start[:, :pk.SAVED]).all()
        assert (kmap[:, :2] == start_keys[:, :2]).all()


@pytest.mark.parametrize("seed", range(4))
def test_the_key_table_is_a_map(seed):
    """The open-addressing key table against a dict: inserts, updates and deletions (backward
    shift, wrapping around the end) in a table kept nearly half full; and undone exactly."""
    from duetime.engine import block_pool_kernel as pk

    rng = random.Random(seed)
    table = pk.new_key_map(32)  # 64 slots
    pool = pk.new_pool(32)
    want: dict[int, int] = {}
    undo = None
    for step in range(3000):
        k = rng.choice([rng.getrandbits(63) - (1 << 62), rng.randint(-40, 40)])
        if want and rng.random() < 0.45:
            k = rng.choice(list(want))
            pk._key_del(table, k, undo)
            del want[k]
        elif len(want) < 32:
            b = rng.randint(1, 31)
            pk._key_put(table, k, b, undo)
            want[k] = b
        assert pk.key_items(table) == want
        probe = rng.choice([k, rng.getrandbits(63)])
        assert pk.key_get(table, probe) == want.get(probe, -1)
        if step == 1500:
            undo = pk.new_undo(pool, table)
            before, before_map = table.copy(), dict(want)
    pk.undo_all(pool, table, undo)
    assert (table[:, :2] == before[:, :2]).all() and pk.key_items(table) == before_map
