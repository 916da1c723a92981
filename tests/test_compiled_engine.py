"""The compiled stepping engine against the reference loop, step for step, with arrivals."""

from __future__ import annotations

import random

import pytest

from duetime.engine import EngineStuck, ReferenceEngine, Request, SchedulerConfig
from duetime.engine.compiled import Engine
from snapshots import PAPER4, SFS6


def _config(rng: random.Random) -> SchedulerConfig:
    budget = rng.choice([16, 64, 512, 8192])
    return SchedulerConfig(max_num_batched_tokens=budget,
                           max_num_seqs=min(budget, rng.choice([2, 8, 64])),
                           max_model_len=rng.choice([2048, 32768]),
                           block_size=rng.choice([1, 4, 10, 16]),
                           num_gpu_blocks=rng.choice([64, 400, 100_000]),
                           long_prefill_token_threshold=rng.choice([0, 0, 8, 100]))


@pytest.mark.parametrize("seed", range(40))
def test_compiled_engine_matches_reference_step_for_step(seed: int) -> None:
    rng = random.Random(seed)
    cfg = _config(rng)
    model = rng.choice([PAPER4, SFS6])
    ref = ReferenceEngine(cfg, model)
    fast = Engine(cfg, model, capacity=4)  # tiny capacity: exercises growth
    n_added = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            p = min(rng.choice([rng.randint(1, 30), rng.randint(1, 1500)]),
                    cfg.max_model_len - 2)
            t = rng.randint(1, 60)
            rid = f"q{n_added}"
            n_added += 1
            ref.add(Request(rid, p, t))
            fast.add(rid, p, t)
        try:
            want = ref.step()
        except EngineStuck:
            with pytest.raises(EngineStuck):
                fast.step()
            return
        got = fast.step()
        if want is None:
            assert got is None
            continue
        assert (got.index, got.start, got.end) == (want.index, want.start, want.end)
        assert sorted(got.first_token) == sorted(want.first_token)
        assert sorted(got.finished) == sorted(want.finished)
        assert got.preempted == len(want.preempted)
        assert got.scheduled == len(want.prefill) + len(want.decode)
        assert fast.running_ids() == [r.id for r in ref.running]
        assert fast.waiting_ids() == [r.id for r in ref.waiting]
        assert fast.free_blocks == ref.free_blocks
    assert n_added > 20


def test_engine_rejects_duplicates_and_reports_state() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4)
    eng = Engine(cfg, PAPER4)
    eng.add("a", 10, 2)
    with pytest.raises(ValueError, match="already"):
        eng.add("a", 5, 1)
    with pytest.raises(ValueError):
        eng.add("b", 0, 1)
    ev = eng.step()
    assert ev.first_token == ["a"] and ev.finished == []
    ev = eng.step()
    assert ev.finished == ["a"]
    state = eng.request("a")
    assert state["finished"] and state["output_tokens"] == 2 and state["blocks"] == 0
    assert state["first_token"] is not None and state["finish_time"] == eng.time
    assert eng.idle and eng.step() is None
    eng.advance_clock(100.0)
    assert eng.time == 100.0
