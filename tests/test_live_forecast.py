"""The forecaster a live engine keeps (engine/live_forecast.py) answers exactly as a fresh
forecast of the engine's snapshot, through any sequence of the engine's changes, with and
without prefix caching, with and without LoRA adapters."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from duetime.engine import Engine, Sfs6
from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import Forecaster, ForecastError, forecast
from duetime.engine.live_forecast import LiveForecaster

MODEL = Sfs6(c0=0.005, cp=2e-5, cpsq=5e-10, cd=2.5e-5, cs=4e-8, css=2e-13)
SLOWER = Sfs6(c0=0.006, cp=3e-5, cpsq=5e-10, cd=3e-5, cs=4e-8, css=2e-13)
# with adapters: models that price LoRA steps
LORA_MODELS = (MODEL.with_lora(0.002, 3e-5, 1e-4), SLOWER.with_lora(0.003, 2e-5, 2e-4))

CONFIGS = {
    # tight KV: the replays preempt; few seats: probes wait for seats
    "tight": SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=2048,
                             block_size=16, num_gpu_blocks=90),
    "chunked": SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                               max_model_len=4096, block_size=16, num_gpu_blocks=2000,
                               long_prefill_token_threshold=128,
                               scheduler_reserve_full_isl=False),
    "ample": SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192,
                             block_size=16, num_gpu_blocks=20_000),
    # prefix caching: requests and probes share system prompts; a tight cache evicts them
    "cached": SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=4096,
                              block_size=16, num_gpu_blocks=2000, enable_prefix_caching=True),
    "cached-tight": SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4,
                                    max_model_len=2048, block_size=16, num_gpu_blocks=150,
                                    enable_prefix_caching=True),
    # LoRA: at most 2 adapters a step (requests and probes on 4 of the usual ids and one of 63
    # and more), with and without caching
    "lora": SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, max_model_len=4096,
                            block_size=16, num_gpu_blocks=2000, max_loras=2),
    "lora-cached": SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8,
                                   max_model_len=2048, block_size=16, num_gpu_blocks=300,
                                   enable_prefix_caching=True, max_loras=2),
}
ADAPTERS = (0, 0, 1, 2, 3, 4, 70)


def _same(eng: Engine, probes: list[tuple[int, list[int] | None, int]]) -> None:
    """The engine's forecaster and a fresh forecast of its snapshot agree on every probe
    (``(prompt, block keys, adapter)``), taking turns in both orders: with prefix caching each takes
    the cache back from the other, or answers from its record while the other holds it."""
    fc = eng.forecaster()
    snap = eng.snapshot()
    assert fc.time == snap.time
    assert fc.streams == len(snap.running_table) + len(snap.waiting_table)
    for i, (p, keys, lora) in enumerate(probes):
        got: dict[str, Any] = {}
        for who in (("snap", "live") if i % 2 == 0 else ("live", "snap")):
            try:
                got[who] = (forecast(snap, p, prompt_hashes=keys, lora=lora) if who == "snap"
                            else fc.ttft(p, keys, lora=lora))
            except ForecastError as e:
                got[who] = e
        want, live = got["snap"], got["live"]
        if isinstance(want, ForecastError):
            assert isinstance(live, ForecastError) and str(live)[:30] == str(want)[:30], p
            continue
        assert not isinstance(live, ForecastError), (p, live)
        assert (live.estimate_s, live.steps, live.reason) == (want.estimate_s, want.steps,
                                                            want.reason), p
        assert math.isfinite(live.estimate_s) or live.reason
        if i == 0 and not lora and not snap.config.enable_prefix_caching and (
                math.isfinite(want.estimate_s)):
            # its finish from the live record (and past it) as from a fresh one's
            lengths = [1, 7, 60]
            got_f, want_f = fc.finish(p, lengths), Forecaster(snap).finish(p, lengths)
            assert [f.steps for f in got_f] == [f.steps for f in want_f], p
            assert [f.estimate_s for f in got_f] == pytest.approx(
                [f.estimate_s for f in want_f], rel=1e-12), p


def _random_changes(eng: Engine, rng: random.Random, n: int) -> None:
    """``n`` random changes, each followed by probes (steps, arrivals, ends, aborts, observed
    outputs, a new model, clock moves, compaction)."""
    live: list[str] = []
    cfg = eng.config
    max_len = min(cfg.max_model_len, cfg.usable_blocks * cfg.block_size)  # (else it is stuck)
    caching = cfg.enable_prefix_caching
    adapters = ADAPTERS if cfg.max_loras else (0,)
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(2, 30))] for _ in range(3)]

    def keys(tokens: int) -> list[int] | None:
        """Block keys of ``tokens`` tokens: a shared system prompt, then its own."""
        if not caching:
            return None
        own = [rng.getrandbits(62) for _ in range(tokens // cfg.block_size)]
        return (rng.choice(systems) + own)[:tokens // cfg.block_size]
    for k in range(n):
        u = rng.random()
        if u < 0.35:
            rid = f"r{k}"
            prompt = rng.randint(1, min(1500, max_len - 2))
            stop = rng.randint(1, min(200, max_len - prompt))
            pred = max(1, int(stop * rng.uniform(0.5, 1.5)))
            eng.add(rid, prompt, stop, predicted_output_tokens=pred,
                    hashes=keys(prompt + stop), lora=rng.choice(adapters))
            live.append(rid)
        elif u < 0.7:
            for _ in range(rng.randint(1, 4)):
                eng.step()
        elif u < 0.78 and live:
            eng.abort(live.pop(rng.randrange(len(live))))
        elif u < 0.86 and live:
            rid = rng.choice(live)
            out = eng.request(rid)["output_tokens"] if eng.has(rid) else 0
            eng.observe(rid, int(out) + rng.randint(1, 3))
        elif u < 0.9 and live:
            rid = rng.choice(live)
            if eng.has(rid):
                eng.end(rid, int(eng.request(rid)["output_tokens"]) + 1)
        elif u < 0.93:
            pair = LORA_MODELS if cfg.max_loras else (MODEL, SLOWER)
            eng.set_model(pair[1] if eng.model is pair[0] else pair[0])
        elif u < 0.96:
            eng.set_clock(eng.time + rng.uniform(0.0, 0.05))
        else:
            eng.compact()
        live = [r for r in live if eng.has(r)]
        # two probes per change, one of them after the other (a kept base's later probe)
        probes = [rng.randint(1, cfg.max_model_len + 100), rng.choice((1, 17, 300, 1000))]
        _same(eng, [(p, keys(p), rng.choice(adapters)) for p in probes])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
def test_live_forecasts_equal_fresh_ones_through_random_changes(name, asynchronous, seed):

    cfg = dataclasses.replace(CONFIGS[name], async_scheduling=asynchronous)
    eng = Engine(cfg, LORA_MODELS[0] if cfg.max_loras else MODEL, seed=seed)
    _random_changes(eng, random.Random(seed * 7 + len(name)), 120)
    fc = eng.forecaster()
    assert isinstance(fc, LiveForecaster)
    assert fc is eng.forecaster()  # kept
    assert 0 < fc.rebuilds <= (720 if cfg.enable_prefix_caching else 240)


def test_a_revision_is_replayed_once():
    eng = Engine(CONFIGS["ample"], MODEL)
    for i in range(30):
        eng.add(f"r{i}", 500 + 10 * i, 50, predicted_output_tokens=40)
    fc = eng.forecaster()
    assert fc.rebuilds == 0  # (read from the engine when a probe first needs it)
    a = fc.ttft(100)
    assert fc.rebuilds == 1
    b = eng.forecaster().ttft(3000)
    assert fc.rebuilds == 1  # a further probe of the same state: the same base
    eng.step()
    c = eng.forecaster().ttft(100)
    assert fc.rebuilds == 2
    assert (a.estimate_s, b.estimate_s) != (c.estimate_s, c.estimate_s)


def test_with_prefix_caching_a_revision_is_read_once_and_its_lease_kept():
    cfg = CONFIGS["cached"]
    eng = Engine(cfg, MODEL)
    shared = list(range(1, 7))
    eng.add("a", 100, 5, hashes=shared)
    eng.add("b", 300, 50, hashes=shared + list(range(50, 70)))
    eng.step()
    fc = eng.forecaster()
    assert isinstance(fc, LiveForecaster) and fc.rebuilds == 0
    a = fc.ttft(100, shared)
    assert fc.rebuilds == 1
    b = eng.forecaster().ttft(300, [*shared, 99])
    assert fc.rebuilds == 1  # the same state, its lease kept
    want = [forecast(eng.snapshot(), 100, prompt_hashes=shared),
            forecast(eng.snapshot(), 300, prompt_hashes=[*shared, 99])]
    assert [a.estimate_s, b.estimate_s] == [w.estimate_s for w in want]
    # the snapshot's forecasts took the cache back: the record still answers (the lease is
    # needed only to extend the base)
    assert fc.ttft(100, shared).estimate_s == a.estimate_s
    eng.step()
    with pytest.raises(ForecastError, match="changed since sync"):
        fc.ttft(100, shared)
    assert eng.forecaster().ttft(100, shared).estimate_s == forecast(
        eng.snapshot(), 100, prompt_hashes=shared).estimate_s
