"""The compiled stepping engine against the reference loop, step for step, with arrivals."""

from __future__ import annotations

import random

import pytest

from duetime.engine import EngineStuck, ReferenceEngine, Request, SchedulerConfig
from duetime.engine.engine import Engine
from snapshots import PAPER4, SFS6


def _config(rng: random.Random) -> SchedulerConfig:
    budget = rng.choice([16, 64, 512, 8192])
    return SchedulerConfig(max_num_batched_tokens=budget,
                           max_num_seqs=min(budget, rng.choice([2, 8, 64])),
                           max_model_len=rng.choice([2048, 32768]),
                           block_size=rng.choice([1, 4, 10, 16]),
                           num_gpu_blocks=rng.choice([64, 400, 100_000]),
                           long_prefill_token_threshold=rng.choice([0, 0, 8, 100]),
                           scheduler_reserve_full_isl=rng.choice([True, True, False]),
                           watermark=rng.choice([0.0, 0.0, 0.05]),
                           async_scheduling=rng.random() < 0.5)


def _same_step(got, want, fast: Engine, ref: ReferenceEngine) -> None:
    """The compiled engine's step and state are the reference loop's."""
    assert (got.index, got.start, got.end) == (want.index, want.start, want.end)
    assert sorted(got.first_token_ids) == sorted(want.first_token_ids)
    assert sorted(got.finished_ids) == sorted(want.finished_ids)
    assert got.tokens == want.tokens
    assert got.preempted == len(want.preempted)
    assert got.scheduled == len(want.prefill) + len(want.decode)
    assert fast.running_ids() == [r.id for r in ref.running]
    assert fast.waiting_ids() == [r.id for r in ref.waiting]
    assert fast.free_blocks == ref.free_blocks


@pytest.mark.parametrize("seed", range(80))
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
        got = fast.step(tokens=True)
        if want is None:
            assert got is None
            continue
        _same_step(got, want, fast, ref)
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
    assert ev.first_token_ids == ["a"] and ev.finished_ids == []
    ev = eng.step()
    assert ev.finished_ids == ["a"]
    state = eng.request("a")
    assert state["finished"] and state["output_tokens"] == 2 and state["blocks"] == 0
    assert state["first_token"] is not None and state["finish_time"] == eng.time
    assert eng.idle and eng.step() is None
    eng.advance_clock(100.0)
    assert eng.time == 100.0


def test_run_until_and_drain() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4)
    eng = Engine(cfg, PAPER4)
    eng.run_until(5.0)  # idle: the clock jumps
    assert eng.time == 5.0
    eng.add("a", 100, 30)
    eng.add("b", 10, 3)
    ref = ReferenceEngine(cfg, PAPER4, time=5.0)
    ref.add(Request("a", 100, 30))
    ref.add(Request("b", 10, 3))
    finished = eng.run_until(float("inf"), stop_on_finish=True)
    while not (rec := ref.step()).finished_ids:
        pass
    assert finished == rec.finished_ids == ["b"]
    assert eng.time == ref.time
    eng.drain()
    assert eng.idle and eng.time < 1e6
    hist = eng.history()
    assert hist.ids == ["a", "b"] and not (hist.first_token != hist.first_token).any()
    assert not (hist.finish_time != hist.finish_time).any() and hist.finished.all()
    assert (eng.lookup(["b"]).finish_time == hist.finish_time[1:]).all()
    assert eng.history(last=1).ids == ["b"]


def test_snapshot_shows_predicted_lengths_in_scheduler_order() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, block_size=4)
    eng = Engine(cfg, SFS6)
    eng.add("a", 10, 50, predicted_output_tokens=20, arrival=0.0)
    eng.add("b", 40, 5, predicted_output_tokens=7, arrival=0.1)
    eng.add("c", 8, 5, arrival=0.2)
    eng.step()
    snap = eng.snapshot()
    assert snap.time == eng.time
    assert [r.id for r in snap.running] == ["a", "b"]
    assert [r.id for r in snap.waiting] == ["c"]
    a, b = snap.running
    assert (a.prompt_tokens, a.computed_tokens, a.output_tokens, a.predicted_output_tokens) == (
        10, 10, 1, 20)
    assert (b.prompt_tokens, b.computed_tokens, b.output_tokens) == (40, 22, 0)
    assert snap.waiting[0].predicted_output_tokens == 5  # default: the true stop
    snap.check()


def test_noise_is_seeded_and_mean_preserving() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4)

    def total(noise: float, seed: int) -> float:
        eng = Engine(cfg, PAPER4, noise=noise, seed=seed)
        for i in range(8):
            eng.add(f"r{i}", 50, 100)
        eng.drain()
        return eng.time

    exact = total(0.0, 1)
    assert total(0.1, 1) == total(0.1, 1) != exact
    assert abs(total(0.1, 2) / exact - 1) < 0.05  # ~1000 steps of mean-one noise


@pytest.mark.parametrize("seed", range(60))
def test_compiled_engine_caches_prefixes_as_the_reference(seed: int) -> None:
    """Prefix caching: shared system prompts, conversations that continue earlier ones (their
    prompt holds the earlier prompt and its output), repeated prompts; tight and ample KV;
    aborts and the compaction of finished rows on the way."""
    import dataclasses

    rng = random.Random(1000 + seed)
    cfg = dataclasses.replace(_config(rng), enable_prefix_caching=True,
                              max_model_len=2048, num_gpu_blocks=rng.choice([64, 200, 5000]))
    bs = cfg.block_size
    model = rng.choice([PAPER4, SFS6])
    ref = ReferenceEngine(cfg, model)
    fast = Engine(cfg, model, capacity=4, retain_finished=rng.random() < 0.5)
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    history: list[tuple[int, list[int]]] = []  # (tokens, keys) of earlier sequences
    n_added = hits = 0
    for k in range(400):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            if history and rng.random() < 0.4:  # a later turn: an earlier sequence + more
                base, keys = rng.choice(history)
            else:
                keys = rng.choice(systems)
                base = len(keys) * bs
            p = min(base + rng.randint(1, 200), cfg.max_model_len - 80)
            t = rng.randint(1, 60)
            keys = keys[:p // bs] + [rng.getrandbits(62) for _ in range((p + t) // bs)]
            keys = keys[:(p + t) // bs]
            history.append((p + t, keys))
            rid = f"q{n_added}"
            n_added += 1
            ref.add(Request(rid, p, t, hashes=keys))
            fast.add(rid, p, t, hashes=keys)
        if k % 37 == 36 and ref.running:  # a client goes away
            gone = ref.running[-1]
            assert fast.abort(gone.id)
            ref.running.remove(gone)  # (the reference loop has no abort: as the engine does)
            ref.kv.free(gone)
            gone.finished = ref.time
        try:
            want = ref.step()
        except EngineStuck:
            with pytest.raises(EngineStuck):
                fast.step()
            return
        got = fast.step(tokens=True)
        if want is None:
            assert got is None
            continue
        _same_step(got, want, fast, ref)
        assert got.prefix_hits == sum(n for _, n in want.hits)
        hits += got.prefix_hits
        fast.check_invariants()
    assert n_added > 20 and hits > 0


def test_the_engine_tells_how_much_of_a_prefix_it_holds() -> None:
    import dataclasses

    cfg = dataclasses.replace(SchedulerConfig(), enable_prefix_caching=True,
                              num_gpu_blocks=100, max_model_len=4096)
    eng = Engine(cfg, PAPER4)
    eng.add("a", 64, 2, hashes=[11, 12, 13, 14])
    eng.drain()
    assert eng.cached_blocks == 4  # its prompt's 4 full blocks (66 tokens: no fifth)
    assert eng.cached_prefix([11, 12, 13, 99]) == 3
    eng.add("b", 80, 2, hashes=[11, 12, 13, 14, 15])
    eng.drain()
    assert (eng.prefix_queries, eng.prefix_hits) == (64 + 80, 64)
    assert eng.cached_prefix([99, 12]) == 0  # the first miss ends it
    plain = Engine(SchedulerConfig(), PAPER4)
    assert plain.cached_prefix([11]) == 0 and plain.cached_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_observing_fewer_tokens_than_the_engine_ran_ahead_keeps_the_pool_whole(
        async_scheduling: bool) -> None:
    """A gateway's shadow replica runs a request ahead of the real one (it cannot know when it
    stops) and then learns it made fewer tokens: the blocks it took for the tokens it never
    made go back to the pool. They were counted free without being queued (found by the
    reliability suite's soak: 'a block missing from its key's chain' a while later)."""
    from dataclasses import replace

    from duetime.engine.profiles import load_profile

    spec = load_profile("qwen3-8b")
    cfg = replace(spec.config, enable_prefix_caching=True, max_model_len=4096,
                  num_gpu_blocks=400, async_scheduling=async_scheduling)
    eng = Engine(cfg, spec.batch_time, retain_finished=False)
    keys = [11, 12]
    eng.add("a", 37, 4000, hashes=keys)
    eng.add("b", 37, 4000, hashes=keys)  # (shares a's two cached blocks)
    eng.run_until(0.5)
    ran = eng.request("a")["output_tokens"]
    assert ran > 40  # (several blocks past its prompt)
    assert eng.observe("a", 5)
    eng.check_invariants()
    assert eng.request("a")["blocks"] == 3  # (37 + 5 - 1 tokens computed)
    eng.run_until(1.0)
    eng.abort("a")
    eng.abort("b")
    eng.check_invariants()
    assert eng.free_blocks == cfg.usable_blocks


def test_a_long_lived_caching_engine_keeps_memory_bounded_by_its_live_requests() -> None:
    """A gateway's shadow replica at 128K context sees thousands of requests without
    ``max_tokens`` (each may run to max_model_len: its slice of the block arena is 8,192
    blocks, 64 KB) and forecasts on it (each makes room past the engine's slices, doubling
    the arena): finished ones' slices are reclaimed once they are most of the arena, not
    only once 4,096 rows have piled up (the reliability suite's soak grew 257 -> 679 MB over
    3,000 requests, almost all of it these arenas)."""
    from dataclasses import replace

    from duetime.engine.forecasting import forecast
    from duetime.engine.profiles import load_profile

    spec = load_profile("qwen3-8b")
    cfg = replace(spec.config, enable_prefix_caching=True, max_model_len=131072)
    eng = Engine(cfg, spec.batch_time, retain_finished=False)
    one_slice = 131072 // cfg.block_size * 8  # bytes
    for k in range(600):
        eng.add(f"r{k}", 100, cfg.max_model_len - 101, hashes=[k])
        eng.run_until(eng.time + 0.01)
        forecast(eng.snapshot(), 200, 10, prompt_hashes=[k, k + 1])
        if k >= 4:
            eng.abort(f"r{k - 4}")  # (about five live at a time)
    eng.check_invariants()
    assert eng.num_running + eng.num_waiting == 4
    assert eng.memory_bytes < 64 * one_slice, eng.memory_bytes  # (600 slices: 38 MB)


def _lora_run(seed: int) -> tuple[int, int]:
    """One random LoRA run, compiled against the reference step for step; returns (steps,
    requests skipped)."""
    rng = random.Random(1000 + seed)
    cfg = SchedulerConfig(**{**_config(rng).to_dict(), "max_loras": rng.choice([1, 2, 3, 8]),
                             "num_gpu_blocks": rng.choice([400, 100_000])})
    model = rng.choice([PAPER4, SFS6])
    if seed % 2:  # a step with LoRA costs more, over all its tokens
        model = model.with_lora(2e-3, 3e-5, 1e-4)
    ref = ReferenceEngine(cfg, model)
    fast = Engine(cfg, model, capacity=4)
    adapters = rng.choice([2, 4, 16])
    weights = [1.0 / (a + 1) for a in range(adapters + 1)]
    n_added = skipped = steps = 0
    for _ in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            p = min(rng.choice([rng.randint(1, 30), rng.randint(1, 600)]),
                    cfg.max_model_len - 2)
            t = rng.randint(1, 40)
            lora = rng.choices(range(adapters + 1), weights)[0]
            rid = f"q{n_added}"
            n_added += 1
            ref.add(Request(rid, p, t, lora=lora))
            fast.add(rid, p, t, lora=lora)
        try:
            want = ref.step()
        except EngineStuck:
            with pytest.raises(EngineStuck):
                fast.step()
            break
        got = fast.step(tokens=True)
        if want is None:
            assert got is None
            continue
        steps += 1
        skipped += len(want.skipped)
        _same_step(got, want, fast, ref)
    return steps, skipped


@pytest.mark.parametrize("chunk", range(6))
def test_compiled_engine_caps_lora_adapters_as_the_reference(chunk: int) -> None:
    """With ``max_loras``: requests for several adapters (Zipf-popular, and the base model)
    arrive in bursts; waiting requests whose adapter would exceed the cap are skipped and go
    back to the queue's front in order. The compiled engine's steps (their times too, with a
    model that prices LoRA steps or not), running order and waiting queue are the reference
    loop's, and the skips happen."""
    runs = [_lora_run(seed) for seed in range(chunk * 10, chunk * 10 + 10)]
    assert sum(steps for steps, _ in runs) > 500
    assert sum(1 for _, skipped in runs if skipped) >= 3
