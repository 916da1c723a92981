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
            base, keys = _shared(rng, bs, systems, history, 0.4)
            p = min(base + rng.randint(1, 150), 3000)
            t = rng.randint(1, 40)
            keys = _continued(rng, keys, p, p + t, bs)
            history.append((p + t, keys))
            eng.add(f"q{k}.{len(history)}", p, t, hashes=keys)
        eng.step()
    return eng, systems, history


def _probes(rng: random.Random, bs: int, systems, history) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(4):
        tokens, keys = _shared(rng, bs, systems, history, 0.5)
        p = min(tokens + rng.randint(1, 100), 3500)
        out.append((p, _continued(rng, keys, p, p, bs)))
    return out


def _shared(rng: random.Random, bs: int, systems, history, p_history: float
            ) -> tuple[int, list[int]]:
    """(tokens, keys) a new sequence starts with: an earlier one (with probability
    ``p_history``), else a system prompt."""
    if history and rng.random() < p_history:
        return rng.choice(history)
    keys = rng.choice(systems)
    return len(keys) * bs, keys


def _continued(rng: random.Random, keys: list[int], shared: int, tokens: int,
               bs: int) -> list[int]:
    """The keys of a sequence of ``tokens`` that shares its first ``shared`` tokens' blocks
    with ``keys`` and goes on with new content."""
    return (keys[:shared // bs] + [rng.getrandbits(62) for _ in range(tokens // bs)])[
        :tokens // bs]


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


EXAMPLE = {
    "version": 2, "time": 100.0,
    "config": {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "max_model_len": 4096,
               "block_size": 16, "num_gpu_blocks": 100, "enable_prefix_caching": True},
    "batch_time": {"model": "paper4", "coefficients": {"b0": 0.004, "b1": 2e-5, "b2": 5e-8,
                                                       "b3": 1e-9}},
    "running": [{"id": "a", "prompt_tokens": 40, "computed_tokens": 40, "output_tokens": 1,
                 "predicted_output_tokens": 50, "block_hashes": ["s0", "s1"]}],
    "waiting": [{"id": "b", "prompt_tokens": 64, "predicted_output_tokens": 10,
                 "block_hashes": ["s0", "s1", "b2", "b3"]}],
    "prefix_cache": {"cached_free": ["t0", "t1", "t2"], "free_empty": 90},
}


def test_a_version_2_snapshot_carries_the_cache() -> None:
    from duetime.engine import Snapshot, replay

    snap = Snapshot.from_dict(EXAMPLE)
    cold = forecast(snap, 48).estimate_s
    warm = forecast(snap, 48, prompt_hashes=["t0", "t1", "t2"])  # 2 blocks hit (not the last)
    assert warm.estimate_s < cold
    # b hits a's two registered blocks: with the probe it computes 32 + 16 tokens, not 64 + 48
    trace = replay(snap, 48, prompt_hashes=["t0", "t1", "t2"])
    assert trace.estimate_s == warm.estimate_s
    out = snap.to_dict()
    assert out["version"] == 2 and out["prefix_cache"]["free_empty"] == 93  # 3 unlisted
    assert len(out["prefix_cache"]["cached_free"]) == 3
    again = Snapshot.from_dict(out)  # keys exported as integers: the same cache
    assert forecast(again, 48, prompt_hashes=out["prefix_cache"]["cached_free"]
                    ).estimate_s == warm.estimate_s


@pytest.mark.parametrize("seed", range(20))
def test_the_json_form_forecasts_as_the_live_engine(seed: int) -> None:
    import json

    from duetime.engine import Snapshot

    eng, systems, history = _engine(seed)
    snap = eng.snapshot()
    again = Snapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    for p, hashes in _probes(random.Random(seed), eng.config.block_size, systems, history):
        try:
            want = forecast(snap, p, prompt_hashes=hashes).estimate_s
        except ForecastError:
            continue
        assert forecast(again, p, prompt_hashes=hashes).estimate_s == want


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=1), "needs a snapshot of version 2"),
    (lambda d: d["config"].update(enable_prefix_caching=False), "need prefix caching on"),
    (lambda d: d["waiting"][0].update(block_hashes=[1.5]), r"waiting\[0\]\.block_hashes"),
    (lambda d: d["running"][0].update(block_hashes=[1 << 70]), "does not fit 64 bits"),
    (lambda d: d["prefix_cache"].update(free_empty=97), "exceed the 96 blocks"),
    (lambda d: d["prefix_cache"].update(extra=1), "prefix_cache.extra"),
])
def test_version_2_errors_name_the_field(change, message) -> None:
    import copy

    from duetime.engine import Snapshot, SnapshotError

    d = copy.deepcopy(EXAMPLE)
    change(d)
    with pytest.raises(SnapshotError, match=message):
        Snapshot.from_dict(d)


def test_the_cli_forecasts_a_version_2_snapshot(tmp_path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "snap.json"
    path.write_text(json.dumps(EXAMPLE))

    def run(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "duetime", "forecast", str(path),
                              "--prompt-tokens", "48", *extra], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)

    assert run("--prompt-hashes", '["t0", "t1", "t2"]')["estimate_s"] < run()["estimate_s"]
