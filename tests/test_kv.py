"""The KV block ledger: its reference form and its compiled form keep the same books."""

from __future__ import annotations

import random

import numpy as np
import pytest

from duetime.engine import KVLedger, Request, blocks_for, held_blocks
from duetime.engine.kv import block_shift
from duetime.engine.kv_kernel import HELD, kv_admit, kv_blocks, kv_need, kv_release, kv_take


@pytest.mark.parametrize("block_size", [1, 3, 16, 17, 64])
def test_block_counts(block_size):
    shift = block_shift(block_size)
    assert (shift >= 0) == (block_size & (block_size - 1) == 0)
    for tokens in [0, 1, block_size - 1, block_size, block_size + 1, 1000]:
        want = -(-tokens // block_size)
        assert blocks_for(tokens, block_size) == want == kv_blocks(tokens, block_size, shift)
    comp = np.array([0, 1, block_size, 5 * block_size + 1])
    assert held_blocks(comp, block_size) == sum(blocks_for(int(c), block_size) for c in comp)
    assert (blocks_for(comp, block_size) == [blocks_for(int(c), block_size) for c in comp]).all()


@pytest.mark.parametrize("seed", range(5))
def test_reference_and_compiled_forms_agree(seed):
    rng = random.Random(seed)
    bs, n_blocks = rng.choice([4, 10, 16]), 200
    wm, full = rng.choice([0, 3]), rng.choice([True, False])
    ref = KVLedger(n_blocks, bs, watermark_blocks=wm, full_sequence=full)
    assert ref.usable_blocks == n_blocks - 1  # vLLM's null block
    reqs = [Request(f"r{i}", 10, 10) for i in range(8)]
    req = np.zeros((8, 6), dtype=np.int64)  # the kernel's request table
    free = ref.usable_blocks
    shift = block_shift(bs)
    tokens = [0] * 8
    for _ in range(300):
        i = rng.randrange(8)
        if rng.random() < 0.2:  # finish, abort or preempt: every block back
            ref.free(reqs[i])
            free += kv_release(req, i)
            tokens[i] = 0
        else:
            target = tokens[i] + rng.randint(1, 40)
            whole, others = target + rng.randint(0, 300), rng.random() < 0.5
            admit = ref.admit(reqs[i], whole, target, others)
            assert (-1 if admit is None else admit) == kv_admit(
                req, i, whole, target, free, wm if others else 0, full, bs, shift)
            need = ref.need(reqs[i], target)
            assert need == kv_need(req, i, target, bs, shift)
            if ref.fits(need):
                ref.take(reqs[i], need)
                free -= kv_take(req, i, need)
                tokens[i] = target
        assert ref.free_blocks == free and [r.blocks for r in reqs] == req[:, HELD].tolist()
        assert ref.used_blocks == req[:, HELD].sum() and 0 <= ref.usage <= 1
        assert (np.delete(req, HELD, axis=1) == 0).all()  # the ledger touches its column only
