"""Forecasts with prefix caching: exact against the future the engine really runs, and they
leave the engine's cache as they found it (they borrow it: ``duetime.engine.prefix_state``)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from duetime.engine import Engine, EngineStuck, ForecastError, SchedulerConfig, forecast
from duetime.engine.pool_kernel import queue_of
from snapshots import PAPER4, SFS6


def _engine(seed: int) -> tuple[Engine, list[list[int]], list[tuple[int, list[int]]]]:
    """An engine with caching, after a seeded history of shared-prefix arrivals."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=rng.choice([64, 512, 2048]),
                          max_num_seqs=rng.choice([4, 16, 64]), max_model_len=4096,
                          block_size=rng.choice([4, 16]),
                          num_gpu_blocks=rng.choice([120, 400, 5000]),
                          long_prefill_token_threshold=rng.choice([0, 0, 64]),
                          scheduler_reserve_full_isl=rng.choice([True, True, False]),
                          async_scheduling=rng.random() < 0.5, enable_prefix_caching=True)
    eng = Engine(cfg, rng.choice([PAPER4, SFS6]))
    bs = cfg.block_size
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    history: list[tuple[int, list[int]]] = []
    for k in range(rng.randint(5, 120)):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if history and rng.random() < 0.4:
                base, keys = rng.choice(history)
            else:
                keys = rng.choice(systems)
                base = len(keys) * bs
            p = min(base + rng.randint(1, 150), 3000)
            t = rng.randint(1, 40)
            keys = (keys[:p // bs] + [rng.getrandbits(62) for _ in range((p + t) // bs)])[
                :(p + t) // bs]
            history.append((p + t, keys))
            eng.add(f"q{k}.{len(history)}", p, t, hashes=keys)
        eng.step()
    return eng, systems, history


def _probes(rng: random.Random, bs: int, systems, history) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(4):
        if history and rng.random() < 0.5:
            tokens, keys = rng.choice(history)
        else:
            keys = rng.choice(systems)
            tokens = len(keys) * bs
        p = min(tokens + rng.randint(1, 100), 3500)
        out.append((p, (keys[:p // bs] + [rng.getrandbits(62) for _ in range(p // bs)])[
            :p // bs]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_a_forecast_with_caching_is_the_future_the_engine_runs(seed: int) -> None:
    eng, systems, history = _engine(seed)
    snap = eng.snapshot()
    pool, keys, free = eng._pool.copy(), eng._kmap.copy(), eng.free_blocks
    rng = random.Random(seed)
    for i, (p, hashes) in enumerate(_probes(rng, eng.config.block_size, systems, history)):
        try:
            got = forecast(snap, p, prompt_hashes=hashes)
        except ForecastError:
            continue
        # the engine's cache is as it was
        assert (eng._pool == pool).all() and (eng._kmap == keys).all()
        assert eng.free_blocks == free
        eng.check_invariants()
        # the same engine, really run with the probe
        twin = _engine(seed)[0]
        twin.add("probe", p, 1, hashes=hashes)
        t0 = twin.time
        if np.isinf(got.estimate_s):  # the queue ahead is blocked for good
            with pytest.raises(EngineStuck):
                twin.drain()
            continue
        while np.isnan(twin.lookup(["probe"]).first_token[0]):
            twin.step()
        want = float(twin.lookup(["probe"]).first_token[0]) - t0
        assert got.estimate_s == pytest.approx(want, rel=1e-9, abs=1e-12), f"probe {i}"


def test_the_probe_hits_what_the_instance_holds() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096,
                          block_size=16, num_gpu_blocks=1000, enable_prefix_caching=True)
    eng = Engine(cfg, PAPER4)
    system = list(range(1, 33))  # 512 tokens of system prompt
    eng.add("a", 600, 5, hashes=[*system, 99, 98, 97, 96, 95])
    eng.drain()
    snap = eng.snapshot()
    cold = forecast(snap, 600).estimate_s  # no keys: nothing to hit
    warm = forecast(snap, 600, prompt_hashes=[*system, 7, 7, 7, 7, 7]).estimate_s
    assert warm < cold / 3  # 512 of its 600 tokens are cached
    off = Engine(dataclasses.replace(cfg, enable_prefix_caching=False), PAPER4)
    assert forecast(off.snapshot(), 600).estimate_s == pytest.approx(cold)


def test_a_stale_snapshot_of_a_caching_engine_is_refused() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=1000, enable_prefix_caching=True)
    eng = Engine(cfg, PAPER4)
    eng.add("a", 100, 50)
    eng.step()
    snap = eng.snapshot()
    eng.step()
    with pytest.raises(ForecastError, match="changed since"):
        forecast(snap, 100)
    assert forecast(eng.snapshot(), 100).estimate_s > 0
    assert queue_of(eng._pool)  # the pool is intact
