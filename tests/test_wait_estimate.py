"""The pool's wait estimates (what sfs ranks replicas by), the policy's ranked choice, the
engines' own noise streams and the simulator's lazy stepping."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.engine.batch_time import Sfs6
from duetime.engine.engine import Engine
from duetime.engine.forecasting import ForecastError, forecast
from duetime.engine.profiles import load_profile
from duetime.engine.wait_estimate import ROW_SIZE, LoadBoard
from duetime.estimate import SfsEstimator
from duetime.policy import Candidate, RoutingRequest, make_policy
from duetime.policy.base import Candidates, utility
from duetime.sim import ClusterSim
from duetime.sim.instance import SimInstance
from duetime.workload import Poisson, load_workload, sample_requests

SPEC = load_profile("qwen3-8b")
SFS6 = Sfs6(c0=0.012, cp=4e-5, cpsq=1e-10, cd=2e-4, cs=1e-7, css=1e-11)


def loaded_engine(rng: np.random.Generator, model=None, **cfg) -> Engine:
    """An engine with a random load (running, waiting, chunked prefills, decoders)."""
    eng = Engine(replace(SPEC.config, **cfg), model or SPEC.batch_time)
    t = 0.0
    for k in range(int(rng.integers(0, 40))):
        t += float(rng.exponential(0.02))
        eng.run_until(t)
        eng.add(f"r{k}", int(rng.integers(1, 6000)), int(rng.integers(1, 400)), arrival=t,
                predicted_output_tokens=int(rng.integers(1, 400)))
    eng.run_until(t + float(rng.exponential(0.05)))
    return eng


def test_the_board_row_follows_every_change_of_its_engine() -> None:
    """Whatever changes the engine (adds, steps, run_until, aborts, observations, the clock),
    its row is what a fresh summary of it says."""
    rng = np.random.default_rng(0)
    board = LoadBoard(2)
    eng = Engine(SPEC.config, SPEC.batch_time)
    board.attach(eng, 1)
    t = 0.0
    for k in range(300):
        op = int(rng.integers(0, 5))
        if op == 0 or eng.idle:
            eng.add(f"r{k}", int(rng.integers(1, 3000)), int(rng.integers(1, 50)))
        elif op == 1:
            eng.step()
        elif op == 2:
            t = max(t, eng.time) + float(rng.exponential(0.03))
            eng.run_until(t)
        elif op == 3:
            ids = eng.running_ids() + eng.waiting_ids()
            eng.abort(ids[int(rng.integers(0, len(ids)))])
        else:
            eng.set_clock(eng.time + 0.001)
        kept = board.rows[1].copy()
        fresh = np.zeros(ROW_SIZE)
        eng.publish_load(fresh)
        assert np.array_equal(kept, fresh), (k, op)
        board.attach(eng, 1)
    assert not board.rows[0].any()  # (the other row untouched)


def reference_decode_costs(eng: Engine) -> np.ndarray:
    """The running decodes' cost over 1..DECODE_STEPS steps, by definition: request by
    request, step by step, each until its predicted stop."""
    from duetime.engine.remaining import DEFAULT_SIGMA, stop_length
    from duetime.engine.wait_estimate import DECODE_STEPS

    w = np.array(eng.model.weights, dtype=float)
    tab = eng.lookup(eng.running_ids())
    cost = np.zeros(DECODE_STEPS)
    for prompt, out, comp, pred in zip(tab.prompt.tolist(), tab.output.tolist(),
                                       tab.computed.tolist(), tab.predicted.tolist(),
                                       strict=True):
        if out < 1 or comp < prompt + out - 1:
            continue
        left = stop_length(pred, out, DEFAULT_SIGMA) - out
        acc = 0.0
        for s in range(DECODE_STEPS):
            if s < left:
                c = comp + s
                acc += w[1] + w[5] * c + w[6] * (c + 1) + w[7] * (c + 1) ** 2
            cost[s] += acc
    return cost


@pytest.mark.parametrize("seed", range(12))
def test_the_decode_costs_are_those_of_every_request_step_by_step(seed: int) -> None:
    """The summary sums the decodes that outlast its horizon in closed form: the same costs
    (to rounding) as summing every request's steps."""
    from duetime.engine.wait_estimate import DEC, DECODE_STEPS

    rng = np.random.default_rng(seed)
    eng = loaded_engine(rng, SFS6)
    for _ in range(int(rng.integers(0, 300))):  # on into the decodes, some near their stop
        if eng.idle:
            break
        eng.step()
    row = np.zeros(ROW_SIZE)
    eng.publish_load(row)
    np.testing.assert_allclose(row[DEC:DEC + DECODE_STEPS], reference_decode_costs(eng),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("model", ["paper4", "sfs6"])
def test_an_idle_engines_estimate_is_its_forecast(model: str) -> None:
    """Nothing ahead, a prompt of one chunk: the estimate is the probe's one step, exactly the
    forecast."""
    bt = SPEC.batch_time if model == "paper4" else SFS6
    eng = Engine(SPEC.config, bt, time=5.0)
    board = LoadBoard(1)
    board.attach(eng, 0)
    for p in (1, 17, 700, SPEC.config.max_num_batched_tokens):
        est = board.estimates(np.zeros(1, dtype=np.int64), p, 5.0)[0]
        assert est == pytest.approx(forecast(eng.snapshot(), p).estimate_s, rel=1e-12)
    # an idle engine's clock behind now: the estimate counts from now
    later = board.estimates(np.zeros(1, dtype=np.int64), 17, 9.0)[0]
    assert later == pytest.approx(forecast(eng.snapshot(), 17).estimate_s, rel=1e-12)


@pytest.mark.parametrize("model", ["paper4", "sfs6"])
def test_estimates_rank_engines_as_their_forecasts_do(model: str) -> None:
    """Random loads: the estimates order the engines almost as the forecasts do (rank
    correlation), and they are rarely above the forecast (they leave out work, and add little
    that is not there)."""
    from scipy.stats import spearmanr

    bt = SPEC.batch_time if model == "paper4" else SFS6
    rng = np.random.default_rng(2)
    engines = [loaded_engine(rng, bt) for _ in range(80)]
    board = LoadBoard(len(engines))
    for k, e in enumerate(engines):
        board.attach(e, k)
    now = max(e.time for e in engines)
    for e in engines:  # (as the simulator has them at a decision: busy ones stepped to it)
        e.run_until(now)
    for p in (64, 2000):
        est, fc = [], []
        for k, e in enumerate(engines):
            try:
                f = forecast(e.snapshot(), p).estimate_s + e.time - now
            except ForecastError:
                continue
            est.append(board.estimates(np.array([k]), p, now)[0])
            fc.append(f)
        est_a, fc_a = np.array(est), np.array(fc)
        rho = spearmanr(est_a, fc_a).statistic
        above = np.mean(est_a > fc_a * 1.02 + 1e-6)
        print(f"{model} p={p}: rank correlation {rho:.3f}, above the forecast {above:.0%}")
        assert len(est) > 60 and rho > 0.9, rho
        assert above < 0.1, above


# -- the policy -----------------------------------------------------------------------------------

def pool(loads: list[int], specs=None) -> Candidates:
    """Instances on one board, the k-th with ``loads[k]`` waiting prompts; all replicas of
    one model "m" unless ``specs`` gives (model, price, spec) per instance."""
    board = LoadBoard(len(loads))
    out = []
    for k, q in enumerate(loads):
        model, price, spec = specs[k] if specs else ("m", 1.0, SPEC)
        inst = SimInstance(f"{model}.{k}", spec)
        inst.join_board(board, k)
        for j in range(q):
            inst.engine.add(f"w{j}", 3000, 10)
        out.append(Candidate(inst.name, model, price, price, inst))
    return Candidates(out)


def sim_replicas(loads: list[int]) -> Candidates:
    return pool(loads)


def request(n: int, target: float) -> RoutingRequest:
    return RoutingRequest("r", 100, np.full(n, 0.8), np.full(n, 10), target)


class Counting(SfsEstimator):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def ttft(self, *a, **kw):
        self.calls += 1
        return super().ttft(*a, **kw)


def test_ranked_takes_the_least_estimate_with_one_forecast() -> None:
    cands = sim_replicas([3, 1, 0, 2, 4])
    for s in range(8):
        pol = make_policy("sfs", {"seed": s})
        pol.estimator = est = Counting()
        assert pol.uses_load_board
        d = pol.choose(request(5, 10.0), cands, 0.0)
        assert d.index == 2 and est.calls == 1
        assert d.forecast == pytest.approx(forecast(cands[2].view.snapshot(), 100).estimate_s)


def test_a_ranked_tier_that_misses_hands_the_request_to_the_next_model() -> None:
    """The least loaded replica of the best model misses the target: its other replicas are
    not forecast, the next model's replica takes the request; with no model meeting the
    target, the least forecast among the tiers' representatives."""
    fast = replace(SPEC, batch_time=SPEC.batch_time.scaled(4.0))
    cands = pool([3, 1, 0, 2, 0], [("m", 1.0, SPEC)] * 4 + [("small", 0.5, fast)])
    best = forecast(cands[2].view.snapshot(), 100).estimate_s
    req = RoutingRequest("r", 100, np.array([0.9] * 4 + [0.5]), np.full(5, 10), best / 2)
    pol = make_policy("sfs")
    pol.estimator = est = Counting()
    d = pol.choose(req, cands, 0.0)
    assert d.index == 4 and est.calls == 2  # (the idle small one meets it)
    cands[4].view.engine.add("busy", 6000, 10)
    pol.estimator = est = Counting()
    d = pol.choose(req, cands, 0.0)
    assert d.index == 2 and est.calls == 2


def test_without_a_board_ranked_is_the_least_forecast() -> None:
    """Views that keep no summary (a gateway's): the least feasible forecast, as ranked=0."""
    from test_replicas import replicas

    cands = replicas([3, 1, 0, 2])
    for s in range(5):
        assert make_policy("sfs", {"seed": s}).choose(request(4, 10.0), cands, 0.0).index == 2
    assert make_policy("sfs", {"ranked": 0}).uses_load_board is False
    assert make_policy("sfs", {"replica_sample": 2}).uses_load_board is False
    assert make_policy("throughput").uses_load_board is False


def test_candidates_give_the_same_utility_as_a_list() -> None:
    from test_replicas import replicas

    cands = replicas([0, 1, 2])
    cands[1].price_output = 3.0
    req = request(3, 1.0)
    assert np.array_equal(utility(req, cands, 0.01), utility(req, Candidates(cands), 0.01))
    c = Candidates(cands)
    assert c.views == tuple(x.view for x in cands) and c.prices.shape == (3, 2)
    assert Candidates([]).prices.shape == (0, 2)


# -- noise and stepping ---------------------------------------------------------------------------

def test_an_engines_noise_does_not_depend_on_how_it_is_stepped() -> None:
    def run(seed: int, pieces: int) -> np.ndarray:
        eng = Engine(SPEC.config, SPEC.batch_time, noise=0.1, seed=seed)
        for i in range(20):
            eng.add(f"r{i}", 500, 40)
        end = 3.0
        for k in range(1, pieces + 1):
            eng.run_until(end * k / pieces)
        eng.drain()
        return eng.lookup([f"r{i}" for i in range(20)]).finish_time.copy()

    once = run(7, 1)
    assert np.array_equal(once, run(7, 50)) and np.array_equal(once, run(7, 3))
    assert not np.array_equal(once, run(8, 1))


def test_step_noise_is_mean_one_log_normal() -> None:
    from duetime.engine.scheduler_kernel import step_normal

    z = np.array([step_normal(11, k) for k in range(20000)])
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 0.03  # consecutive steps independent
    other = np.array([step_normal(12, k) for k in range(2000)])
    assert abs(np.corrcoef(z[:2000], other)[0, 1]) < 0.06  # engines independent


@pytest.mark.parametrize("policy", ["round-robin", "latency-agnostic"])
def test_lazy_stepping_changes_nothing(policy: str) -> None:
    """A policy that reads no instance state: the simulator steps an instance only when it
    gets a request; stepping every busy one at every arrival gives the same times, noise
    included."""
    from duetime.policy.registry import LOAD

    prof = load_workload("paper").with_replicas(4)
    rng = np.random.default_rng(5)
    reqs = sample_requests(prof, Poisson(34.0).times(1200, rng), rng)
    runs = []
    for eager in (False, True):
        pol = make_policy(policy)
        if eager:
            pol.consumes = pol.consumes | {LOAD}
        res = ClusterSim(prof, pol, noise=0.05, seed=2).run(reqs)
        runs.append((res.instance, res.first_token, res.finish))
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)


def test_step_noise_is_the_same_compiled_or_not() -> None:
    """The hash keeps its products below 2**62: plain Python (DUETIME_NO_JIT) draws the same
    numbers as the compiled kernel."""
    import os
    import subprocess
    import sys

    from duetime.engine.scheduler_kernel import step_normal

    code = ("from duetime.engine.scheduler_kernel import step_normal; import numpy as np; "
            "print(repr([step_normal(np.int64(s), np.int64(k)) for s in (0, 11, 2**61 + 5) "
            "for k in (0, 1, 977)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DUETIME_NO_JIT": "1"}, check=True, timeout=120)
    compiled = [step_normal(np.int64(s), np.int64(k)) for s in (0, 11, 2**61 + 5)
                for k in (0, 1, 977)]
    assert eval(out.stdout, {"np": np}) == compiled

