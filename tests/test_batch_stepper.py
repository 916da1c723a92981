"""Engines stepped in one compiled call (engine/batch_stepper.py) end exactly where each
engine's own ``run_until`` takes it; a big simulated pool routes the same with and without."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from duetime.engine import Engine, Sfs6
from duetime.engine.batch_stepper import BatchStepper
from duetime.engine.config import SchedulerConfig
from duetime.engine.scheduler import EngineStuck
from duetime.engine.wait_estimate import LoadBoard
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.sim import cluster as cluster_module
from duetime.workload import Poisson, load_workload, sample_requests

MODEL = Sfs6(c0=0.005, cp=2e-5, cpsq=5e-10, cd=2.5e-5, cs=4e-8, css=2e-13)
SLOWER = Sfs6(c0=0.007, cp=3e-5, cpsq=5e-10, cd=3e-5, cs=4e-8, css=2e-13)


def _pool(seed: int, n: int, board: LoadBoard | None) -> list[Engine]:
    rng = random.Random(seed)
    engines = []
    for k in range(n):
        cfg = SchedulerConfig(max_num_batched_tokens=rng.choice((256, 2048)),
                              max_num_seqs=rng.choice((4, 32)), max_model_len=4096,
                              block_size=16, num_gpu_blocks=rng.choice((300, 5000)),
                              async_scheduling=rng.random() < 0.5)
        # capacity 4: the arrays grow (the batch re-reads them) as requests arrive
        eng = Engine(cfg, MODEL, noise=rng.choice((0.0, 0.1)), seed=seed * 100 + k,
                     capacity=4)
        if board is not None:
            board.attach(eng, k)
        engines.append(eng)
    return engines


@pytest.mark.parametrize("publish", [False, True], ids=["plain", "board"])
@pytest.mark.parametrize("seed", range(3))
def test_a_batch_steps_each_engine_as_its_own_run_until(seed, publish):
    n = 7
    board_a, board_b = (LoadBoard(n), LoadBoard(n)) if publish else (None, None)
    a, b = _pool(seed, n, board_a), _pool(seed, n, board_b)
    stepper = BatchStepper([*a[:-1], None])  # the last one: stepped by the caller
    busy = np.full(n, math.inf)
    rng = random.Random(~seed)
    t = 0.0
    for k in range(300):
        t += rng.expovariate(40.0)
        due = np.flatnonzero(busy < t)
        rest = stepper.advance(due, t, busy) if due.shape[0] else due
        assert rest.tolist() == [x for x in due.tolist() if x == n - 1]
        for i in rest.tolist():
            a[i].run_until(t)
            busy[i] = math.inf if a[i].idle else a[i].time
        for i in due.tolist():
            b[i].run_until(t)
        j = rng.randrange(n)
        p, out = rng.randint(1, 1500), rng.randint(1, 300)
        for pool in (a, b):
            if pool[j].idle:
                pool[j].set_clock(t)
            pool[j].add(f"r{k}", p, out, predicted_output_tokens=max(1, out // 2))
        busy[j] = a[j].time
        if k == 150:
            for pool in (a, b):
                pool[2].set_model(SLOWER)  # (new weights: the batch re-reads them)
        for x, y in zip(a, b, strict=True):
            assert (x.time, x.steps, x.num_running, x.num_waiting) == (
                y.time, y.steps, y.num_running, y.num_waiting)
        if publish:
            assert np.array_equal(board_a.rows, board_b.rows)
    for x, y in zip(a, b, strict=True):
        x.drain()
        y.drain()
        hx, hy = x.history(), y.history()
        assert np.array_equal(hx.first_token, hy.first_token)
        assert np.array_equal(hx.finish_time, hy.finish_time)


def test_a_stuck_engine_raises_its_own_error():
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=4096,
                          block_size=16, num_gpu_blocks=20)
    ok, stuck = Engine(cfg, MODEL), Engine(cfg, MODEL)
    ok.add("a", 50, 3)
    stuck.add("big", 1000, 3)  # 63 blocks: never admitted
    with pytest.raises(EngineStuck, match="can never be admitted") as got:
        BatchStepper([ok, stuck]).advance(np.array([0, 1]), 1.0, np.zeros(2))
    alone = Engine(cfg, MODEL)
    alone.add("big", 1000, 3)
    with pytest.raises(EngineStuck) as want:
        alone.run_until(1.0)
    assert str(got.value) == str(want.value)


def test_engines_with_prefix_caching_or_lora_are_left_to_the_caller():
    cfg = SchedulerConfig(num_gpu_blocks=200, enable_prefix_caching=True)
    plain, caching = Engine(SchedulerConfig(), MODEL), Engine(cfg, MODEL)
    lora = Engine(SchedulerConfig(max_loras=1), MODEL)
    lora.add("a", 10, 2, lora=1)
    lora.add("b", 10, 2, lora=2)
    stepper = BatchStepper([plain, caching, lora])
    assert stepper.batched.tolist() == [True, False, False]
    assert stepper.advance(np.array([0, 1, 2]), 1.0, np.zeros(3)).tolist() == [1, 2]
    assert lora.num_waiting == 2  # (not stepped)


def test_a_big_simulated_pool_routes_the_same_with_batched_steps(monkeypatch):
    prof = load_workload("paper").with_replicas(6)  # 18 instances
    assert len(prof.instance_pairs()) >= cluster_module.BATCH_AT
    rng = np.random.default_rng(11)
    rs = sample_requests(prof, Poisson(6.0 * 6).times(1500, rng), rng)
    runs = []
    for batch_at in (cluster_module.BATCH_AT, 10**9):
        monkeypatch.setattr(cluster_module, "BATCH_AT", batch_at)
        runs.append(ClusterSim(prof, make_policy("sfs"), noise=0.05, seed=2).run(rs))
    a, b = runs
    assert np.array_equal(a.instance, b.instance)
    assert np.array_equal(a.first_token, b.first_token)
    assert np.array_equal(a.finish, b.finish)
    assert np.array_equal(a.forecast, b.forecast, equal_nan=True)
