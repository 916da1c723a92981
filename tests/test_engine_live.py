"""The engine's live operations: abort, observe and compact keep its invariants and its rules."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from duetime.engine import Engine, Sfs6, load_profile
from duetime.engine.config import SchedulerConfig

MODEL = Sfs6(c0=0.005, cp=2e-5, cpsq=5e-10, cd=2.5e-5, cs=4e-8, css=2e-13)
SMALL = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=4096,
                        block_size=16, num_gpu_blocks=120)


def _finish_times(eng: Engine, ids: list[str]) -> dict[str, tuple[float, float]]:
    eng.drain()
    out = {}
    for rid in ids:
        r = eng.request(rid)
        out[rid] = (r["first_token"], r["finish_time"])
    return out


def test_abort_before_start_equals_never_added():
    a, b = Engine(SMALL, MODEL), Engine(SMALL, MODEL)
    for rid, p, s in [("x", 300, 20), ("y", 700, 10), ("z", 200, 30)]:
        a.add(rid, p, s)
        if rid != "y":
            b.add(rid, p, s)
    assert a.abort("y")
    assert not a.abort("y")  # already gone
    a.check_invariants()
    assert _finish_times(a, ["x", "z"]) == _finish_times(b, ["x", "z"])


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_keep_invariants(seed):
    rng = random.Random(seed)
    eng = Engine(SMALL, MODEL)
    live: list[str] = []
    for k in range(60):
        if rng.random() < 0.6:
            rid = f"r{k}"
            eng.add(rid, rng.randint(1, 900), rng.randint(1, 60))
            live.append(rid)
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            eng.abort(victim)
        eng.step()
        eng.check_invariants()
        live = [r for r in live if eng.has(r)]
    eng.drain()
    eng.check_invariants()
    assert eng.idle and eng.free_blocks == SMALL.usable_blocks


def test_observe_moves_a_waiting_request_to_running():
    eng = Engine(SMALL, MODEL)
    eng.add("a", 500, 50)   # takes the whole budget in step 1
    eng.add("b", 100, 50)
    assert eng.waiting_ids() == ["a", "b"]
    assert eng.observe("b", 3)  # the real instance already streamed 3 tokens of b
    eng.check_invariants()
    assert eng.running_ids() == ["b"] and eng.waiting_ids() == ["a"]
    r = eng.request("b")
    assert (r["computed_tokens"], r["output_tokens"], r["blocks"]) == (102, 3, math.ceil(102 / 16))
    assert r["first_token"] == eng.time
    eng.drain()
    eng.check_invariants()


def test_observe_many_matches_observe_one_by_one():
    rng = random.Random(3)
    cfg = load_profile("qwen3-8b").config
    one, many = Engine(cfg, MODEL), Engine(cfg, MODEL)
    ids = []
    for k in range(30):
        p = rng.randint(10, 3000)
        for eng in (one, many):
            eng.add(f"r{k}", p, 10_000)
        ids.append(f"r{k}")
    for _ in range(4):
        one.step()
        many.step()
    running = one.running_ids()
    assert running == many.running_ids() and running
    outs = {rid: one.request(rid)["output_tokens"] + rng.randint(0, 5) for rid in running}
    for rid, n in outs.items():
        one.observe(rid, n)
    assert many.observe_many(list(outs), np.array(list(outs.values()))) >= 1
    for rid in ids:
        assert one.request(rid) == many.request(rid)
    one.check_invariants()
    many.check_invariants()


def test_compact_changes_nothing_but_memory():
    rng = random.Random(7)
    a, b = Engine(SMALL, MODEL), Engine(SMALL, MODEL)
    ids = []
    for k in range(200):
        p, s = rng.randint(1, 400), rng.randint(1, 30)
        for eng in (a, b):
            eng.add(f"r{k}", p, s)
        ids.append(f"r{k}")
        for eng in (a, b):
            eng.step()
        if k % 37 == 36:
            b.compact()
            b.check_invariants()
            assert b.num_added == len(b.running_ids()) + len(b.waiting_ids())
    assert b.num_added < a.num_added
    live = set(b.running_ids()) | set(b.waiting_ids())
    assert a.running_ids() == b.running_ids() and a.waiting_ids() == b.waiting_ids()
    a.drain()
    b.drain()
    for rid in live:
        assert a.request(rid) == b.request(rid)


def test_without_retained_history_the_engine_compacts_itself():
    """A long-running server's engine (retain_finished=False) keeps its memory bounded and its
    rules: the same requests finish at the same times as in an engine that keeps everything."""
    from duetime.engine.engine import COMPACT_AT

    rng = random.Random(11)
    keep, lean = Engine(SMALL, MODEL), Engine(SMALL, MODEL, retain_finished=False)
    for k in range(3 * COMPACT_AT):
        p, s = rng.randint(1, 200), rng.randint(1, 5)
        for eng in (keep, lean):
            eng.add(f"r{k}", p, s)
            eng.step()
    lean.check_invariants()
    assert keep.num_added == 3 * COMPACT_AT and lean.num_added <= COMPACT_AT
    assert lean.running_ids() == keep.running_ids() and lean.waiting_ids() == keep.waiting_ids()
    live = lean.running_ids() + lean.waiting_ids()
    keep.drain()
    lean.drain()
    for rid in live:
        assert keep.request(rid) == lean.request(rid)
    assert lean.history().ids[-1] == keep.history().ids[-1]


@pytest.mark.parametrize("seed", range(12))
def test_compact_with_prefix_caching_changes_nothing_but_memory(seed: int):
    """With prefix caching the arenas are packed in place: requests preempted and admitted
    again have moved their slices past later rows', shadow-style requests reserve a whole
    ``max_model_len`` of blocks. Forecasts and every request's outcome are those of an engine
    that never compacts, and the arenas keep their capacity (no regrowth at the next
    forecast)."""
    from duetime.engine.forecasting import forecast

    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6, max_model_len=2048,
                          block_size=16, num_gpu_blocks=300, enable_prefix_caching=True)
    a, b = Engine(cfg, MODEL), Engine(cfg, MODEL)
    prefixes = [[rng.randrange(1, 1 << 60) for _ in range(8)] for _ in range(3)]
    ids: list[str] = []
    for k in range(160):
        pre = prefixes[rng.randrange(3)]
        p = rng.randint(20, 400)
        n_keys = min(p // 16, len(pre) + 6)
        hashes = (pre + [rng.randrange(1, 1 << 60) for _ in range(6)])[:n_keys]
        stop = rng.choice([rng.randint(1, 40), cfg.max_model_len - p - 1])
        for eng in (a, b):
            eng.add(f"r{k}", p, stop, hashes=hashes)
        ids.append(f"r{k}")
        if stop > 40 and k >= 3 and rng.random() < 0.6:  # (a shadow replica's request ends)
            gone = ids[rng.randrange(len(ids) - 3, len(ids))]
            for eng in (a, b):
                if gone in eng.running_ids() or gone in eng.waiting_ids():
                    eng.abort(gone)
        moved = False
        running = a.running_ids()
        if running and rng.random() < 0.3:  # the instance streamed more than the replica
            rid = rng.choice(running)  # made: past its stop, its slice moves to the end
            r = a.request(rid)
            n = min(r["output_tokens"] + rng.randint(20, 60),
                    cfg.max_model_len - r["prompt_tokens"] - 2)
            for eng in (a, b):
                eng.observe(rid, n)
            moved = True
        if k % 13 == 12 or (moved and rng.random() < 0.5):
            size = b._rb.shape[0]
            b.compact()
            b.check_invariants()
            assert b._rb.shape[0] == size  # (packed in place)
            probe = prefixes[k % 3][:4]
            fa = forecast(a.snapshot(), 70, prompt_hashes=probe)
            fb = forecast(b.snapshot(), 70, prompt_hashes=probe)
            assert (fa.estimate_s, fa.steps) == (fb.estimate_s, fb.steps)
        for eng in (a, b):
            eng.step()
    assert b.num_added < a.num_added
    assert a.running_ids() == b.running_ids() and a.waiting_ids() == b.waiting_ids()
    live = set(b.running_ids()) | set(b.waiting_ids())
    a.drain()
    b.drain()
    for rid in live:
        assert a.request(rid) == b.request(rid)
