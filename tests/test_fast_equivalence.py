"""The compiled replay and the forecaster against the reference loop, on random snapshots.

The snapshots cover both batch-time models, prefill thresholds, small sequence caps, tiny token
budgets and tight KV caches (preemption, recompute, self-preemption), with decoders, partial
prefills and recomputing requests in any order.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from duetime.engine import Forecaster, ForecastError, SchedulerConfig, Snapshot, forecast, replay
from duetime.engine.synthetic import paper_like_snapshot
from snapshots import SFS6, lora_snapshot, random_snapshot

MAX_STEPS = 50_000


def _run(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ForecastError as e:
        return e


def _probe_lengths(rng: random.Random, snap) -> list[int]:
    hi = snap.config.max_model_len - 1
    return [min(p, hi) for p in (1, rng.randint(1, 40), rng.randint(1, 600),
                                 rng.randint(1, 5000))]


@pytest.mark.parametrize("chunk", range(8))
def test_kernel_and_forecaster_equal_the_reference_loop(chunk: int) -> None:
    checked = preempting = 0
    for seed in range(chunk * 60, chunk * 60 + 60):
        rng = random.Random(seed)
        snap = random_snapshot(rng)
        fc = Forecaster(snap, max_steps=MAX_STEPS)
        for p in _probe_lengths(rng, snap):
            for until, po in (("first_token", None), ("finish", rng.randint(1, 300))):
                ref = _run(replay, snap, p, po, until, reference=True, max_steps=MAX_STEPS)
                fast = _run(replay, snap, p, po, until, max_steps=MAX_STEPS)
                if isinstance(ref, ForecastError):
                    assert isinstance(fast, ForecastError), (seed, p, until, fast)
                    if until == "first_token":
                        assert isinstance(_run(fc.ttft, p), ForecastError)
                    continue
                checked += 1
                # Same integer features, same float sum: bit-identical.
                assert (fast.estimate_s, fast.steps) == (ref.estimate_s, ref.steps), (
                    seed, p, until)
                if until == "first_token":
                    got = fc.ttft(p)
                    assert got.steps == ref.steps, (seed, p)
                    assert math.isclose(got.estimate_s, ref.estimate_s, rel_tol=1e-9,
                                        abs_tol=1e-12), (seed, p)
        if snap.config.num_gpu_blocks < 1_000_000:
            preempting += 1
    assert checked > 200
    assert preempting > 0


@pytest.mark.parametrize("chunk", range(4))
def test_lora_forecasts_equal_the_reference_loop(chunk: int) -> None:
    """Snapshots with ``max_loras`` and requests on adapters: probes on the base model, on an
    adapter that runs and on cold ones. The compiled replay equals the reference loop bit for
    bit, and the forecaster (its base record with each step's adapters) equals both; some
    probes are skipped for their adapter (they wait longer than on the base model)."""
    checked = slower = 0
    for seed in range(chunk * 60, chunk * 60 + 60):
        rng = random.Random(7000 + seed)
        snap = lora_snapshot(rng)
        fc = Forecaster(snap, max_steps=MAX_STEPS)
        loras = {0, 1, 2, 5, 17, *snap.running_table.lora.tolist()}
        for p in _probe_lengths(rng, snap)[:3]:
            base = None
            for lora in sorted(loras):
                ref = _run(replay, snap, p, None, "first_token", reference=True,
                           max_steps=MAX_STEPS, lora=lora)
                fast = _run(replay, snap, p, None, "first_token", max_steps=MAX_STEPS,
                            lora=lora)
                if isinstance(ref, ForecastError):
                    assert isinstance(fast, ForecastError), (seed, p, lora, fast)
                    continue
                checked += 1
                assert (fast.estimate_s, fast.steps) == (ref.estimate_s, ref.steps), (
                    seed, p, lora)
                got = fc.ttft(p, lora=lora)
                assert got.steps == ref.steps, (seed, p, lora)
                assert math.isclose(got.estimate_s, ref.estimate_s, rel_tol=1e-9,
                                    abs_tol=1e-12), (seed, p, lora)
                if lora == 0:
                    base = ref.estimate_s
                elif base is not None and ref.estimate_s > base * (1 + 1e-9):
                    slower += 1
    assert checked > 500
    assert slower > 10


def test_trace_agrees_with_the_forecast() -> None:
    rng = random.Random(7)
    for _ in range(20):
        snap = random_snapshot(rng, kv_pressure=False)
        got = _run(forecast, snap, 300, trace=True)
        if isinstance(got, ForecastError):
            continue
        assert len(got.trace) == got.steps
        assert math.isclose(got.trace[-1]["end"] - snap.time, got.estimate_s, rel_tol=1e-12)
        fast = forecast(snap, 300)
        assert fast.steps == got.steps
        assert math.isclose(fast.estimate_s, got.estimate_s, rel_tol=1e-9)


@pytest.mark.parametrize("budget", [8192, 32768])
def test_paper_like_snapshots_many_probes(budget: int) -> None:
    """200 running / 20 waiting, the benchmark's shape: one forecaster, many probe lengths."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256,
                          max_model_len=131072, num_gpu_blocks=100_000)
    for seed in range(3):
        snap = paper_like_snapshot(random.Random(seed), SFS6, config=cfg)
        fc = Forecaster(snap)
        for p in (1, 16, 500, 4096, 9000, 33000, 100_000, 20):
            ref = replay(snap, p, reference=True)
            got = fc.ttft(p)
            assert got.steps == ref.steps
            assert math.isclose(got.estimate_s, ref.estimate_s, rel_tol=1e-9)


def test_kernel_runs_as_plain_python_without_numba() -> None:
    """``DUETIME_NO_JIT=1`` runs the same kernel as Python: it must agree with the oracle."""
    code = (
        "import random, sys; sys.path.insert(0, 'tests')\n"
        "from snapshots import random_snapshot\n"
        "from duetime.engine import replay, forecast, scheduler_kernel as kernel\n"
        "assert not hasattr(kernel.step, 'py_func'), 'numba was used'\n"
        "for seed in range(40):\n"
        "    snap = random_snapshot(random.Random(seed), n_running=8, n_waiting=4)\n"
        "    try:\n"
        "        ref = replay(snap, 50, reference=True, max_steps=5000)\n"
        "    except Exception:\n"
        "        continue\n"
        "    got = replay(snap, 50, max_steps=5000)\n"
        "    assert (got.estimate_s, got.steps) == (ref.estimate_s, ref.steps), seed\n"
        "    assert forecast(snap, 50).steps == ref.steps\n"
        "print('ok')\n")
    _run_without_jit(code)


def _run_without_jit(code: str) -> None:
    """Run ``code`` in a fresh Python with ``DUETIME_NO_JIT=1``: it must print ``ok``."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, DUETIME_NO_JIT="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_forecasts_do_not_depend_on_the_snapshot_clock() -> None:
    """Replays run relative to the snapshot: an epoch-sized ``time`` changes nothing."""
    rng = random.Random(11)
    for _ in range(10):
        snap = random_snapshot(rng, kv_pressure=False)
        late = Snapshot(snap.config, snap.model, time=1.7e9, running=snap.running_table,
                        waiting=snap.waiting_table)
        for p in (1, 100, 3000):
            a, b = _run(forecast, snap, p), _run(forecast, late, p)
            if isinstance(a, ForecastError):
                assert isinstance(b, ForecastError)
                continue
            assert (a.estimate_s, a.steps) == (b.estimate_s, b.steps)
            assert replay(snap, p).estimate_s == replay(late, p).estimate_s


def test_prefix_caching_runs_as_plain_python_without_numba() -> None:
    """The block pool's compiled form run as Python (``DUETIME_NO_JIT=1``) agrees with the
    reference loop too."""
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from duetime.engine import scheduler_kernel as kernel\n"
        "assert not hasattr(kernel.step, 'py_func'), 'numba was used'\n"
        "import test_compiled_engine as t\n"
        "for seed in range(6):\n"
        "    t.test_compiled_engine_caches_prefixes_as_the_reference(seed)\n"
        "print('ok')\n")
    _run_without_jit(code)


@pytest.mark.parametrize("chunk", range(4))
def test_finish_forecasts_equal_the_replay(chunk: int) -> None:
    """``Forecaster.finish`` for several output lengths of one probe equals a replay with the
    probe to its finish (random snapshots, tight caches included; a fifth asynchronous): from
    the base record and its closed-form decode past it where it can be (about half of the
    lengths), by replaying where it cannot."""
    checked = from_record = 0
    for seed in range(chunk * 50, chunk * 50 + 50):
        rng = random.Random(90_000 + seed)
        snap = random_snapshot(rng)
        if seed % 5 == 0:  # (some asynchronous)
            snap = Snapshot(SchedulerConfig(**{**snap.config.to_dict(),
                                               "async_scheduling": True}),
                            snap.model, time=snap.time, running=snap.running_table,
                            waiting=snap.waiting_table)
        fc = Forecaster(snap, max_steps=MAX_STEPS)
        for p in _probe_lengths(rng, snap)[1:3]:
            outs = [1, rng.randint(2, 20), rng.randint(20, 400)]
            got = _run(fc.finish, p, outs)
            want = [_run(replay, snap, p, n, "finish", max_steps=MAX_STEPS) for n in outs]
            if isinstance(got, ForecastError):
                assert all(isinstance(w, ForecastError) for w in want), (seed, p)
                continue
            for n, g, w in zip(outs, got, want, strict=True):
                assert not isinstance(w, ForecastError), (seed, p, n)
                assert g.steps == w.steps, (seed, p, n, g, w)
                assert math.isclose(g.estimate_s, w.estimate_s, rel_tol=1e-9,
                                    abs_tol=1e-12), (seed, p, n, g, w)
                checked += 1
            first = fc.ttft(p)
            e = fc._landed  # (how many lengths the record answered: the shortcut is tested)
            if e is not None:
                from_record += sum(fc._decoded(p, n, first, e) is not None for n in outs)
    assert checked >= 250
    assert from_record > 100, from_record
