"""Pools with replicas: the workload setting, and the latency routers' choice among replicas
of equal utility (by forecast, not by position)."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.cli import main
from duetime.engine import Paper4, ResidentRequest, SchedulerConfig, Snapshot
from duetime.estimate import InstanceStats
from duetime.policy import Candidate, RoutingRequest, make_policy
from duetime.sim import ClusterSim
from duetime.workload import (
    Poisson,
    ProfileError,
    load_workload,
    profile_from_dict,
    sample_requests,
)

CFG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, block_size=16)
MODEL = Paper4(b0=0.01, b1=1e-4, b2=0.0, b3=0.0)


class View:
    def __init__(self, waiting: int) -> None:
        self.num_running, self.num_waiting, self.kv_usage = 0, waiting, 0.0
        self.stats = InstanceStats()
        self.request_overhead_s = 0.0
        self._snap = Snapshot(CFG, MODEL, time=0.0, waiting=[
            ResidentRequest(f"w{i}", 400, 0, 0, 10) for i in range(waiting)])

    def snapshot(self) -> Snapshot:
        return self._snap


def replicas(queues: list[int]) -> list[Candidate]:
    """Replicas of one model at one price (equal utility), with these queues."""
    return [Candidate(f"m.{k}", "m", 1.0, 1.0, View(q)) for k, q in enumerate(queues)]


def request(n: int, target: float) -> RoutingRequest:
    return RoutingRequest("r", 100, np.full(n, 0.8), np.full(n, 10), target)


@pytest.mark.parametrize("policy", ["sfs", "throughput"])
def test_replicas_are_chosen_by_forecast_not_by_position(policy: str) -> None:
    """The first replica by position meets the target but holds the longest queue: the least
    forecast among all (the default) wins, and among a sample of two the winner is never the
    most loaded one once both sampled meet the target."""
    cands = replicas([3, 1, 0, 2])
    for s in range(10):
        assert make_policy(policy, {"seed": s}).choose(request(4, 10.0), cands, 0.0).index == 2
    picks = {make_policy(policy, {"seed": s, "replica_sample": 2}).choose(
        request(4, 10.0), cands, 0.0).index for s in range(40)}
    assert 0 not in picks and picks <= {1, 2, 3} and len(picks) > 1


def test_a_sample_that_misses_the_target_goes_on_to_the_rest() -> None:
    """Only the idle replica meets a tight target: it is found whatever the sample drew."""
    cands = replicas([5, 5, 0, 5, 5])
    for s in range(20):
        d = make_policy("sfs", {"seed": s, "replica_sample": 1}).choose(request(5, 0.05),
                                                                         cands, 0.0)
        assert d.index == 2 and d.forecast <= 0.05


def test_with_none_feasible_the_least_forecast_wins_skipped_ones_included() -> None:
    """A target no replica meets: the bound skips every forecast above the target, and the
    fallback still finds the least forecast of all."""
    cands = replicas([5, 3, 4, 6])
    for s in range(10):
        d = make_policy("sfs", {"seed": s}).choose(request(4, 0.001), cands, 0.0)
        assert d.index == 1 and d.forecast > 0.001


def test_distinct_models_keep_the_papers_order() -> None:
    """Candidates of different utility: the best feasible one, as before (no sampling)."""
    cands = [Candidate(f"i{k}", f"m{k}", 1.0, 1.0, View(q)) for k, q in enumerate([0, 2, 0])]
    r = RoutingRequest("r", 100, np.array([0.5, 0.9, 0.7]), np.full(3, 10), 10.0)
    assert make_policy("sfs").choose(r, cands, 0.0).index == 1


def test_replicas_in_a_workload_profile(tmp_path) -> None:
    prof = load_workload("paper")
    assert prof.instance_pairs() == [(m, m) for m in prof.model_names]
    three = prof.with_replicas(3)
    pairs = three.instance_pairs()
    assert len(pairs) == 9 and pairs[:3] == [("qwen3-0.6b.0", "qwen3-0.6b"),
                                             ("qwen3-0.6b.1", "qwen3-0.6b"),
                                             ("qwen3-0.6b.2", "qwen3-0.6b")]
    d = {"models": {"a": {"profile": "qwen3-8b", "replicas": 2,
                          "price_usd_per_mtok": {"prompt": 0.1, "output": 0.2}},
                    "b": {"profile": "qwen3-0.6b",
                          "price_usd_per_mtok": {"prompt": 0.1, "output": 0.2}}},
         "tasks": {"t": {"share": 1, "prompt_tokens": {"median": 50, "sigma": 0.5, "min": 8,
                                                        "max": 200},
                         "output_tokens": {"median": 50, "sigma": 0.5, "min": 8, "max": 200},
                         "accuracy": {"a": 0.8, "b": 0.5}}}}
    p = profile_from_dict(d)
    assert p.instance_pairs() == [("a.0", "a"), ("a.1", "a"), ("b", "b")]
    d["models"]["a"]["replicas"] = 0
    with pytest.raises(ProfileError, match=r"models\.a\.replicas: must be an integer >= 1"):
        profile_from_dict(d)
    with pytest.raises(ProfileError, match="replicas"):
        prof.with_replicas({"nope": 2})


def test_the_simulator_runs_the_profiles_replicas() -> None:
    prof = load_workload("paper").with_replicas(2)
    rng = np.random.default_rng(0)
    reqs = sample_requests(prof, Poisson(12.0).times(300, rng), rng)
    res = ClusterSim(prof, make_policy("sfs")).run(reqs)
    assert res.instance_names == [n for n, _ in prof.instance_pairs()]
    share = np.bincount(res.instance, minlength=6) / len(reqs)
    # replicas of one model share its load (not the first of them taking all it can)
    for k in range(0, 6, 2):
        a, b = share[k], share[k + 1]
        if a + b > 0.1:
            assert min(a, b) / (a + b) > 0.25, share


def test_simulate_replicas_flag(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--policy", "sfs", "--rate", "4", "--requests", "40",
                 "--replicas", "2", "--out", str(out)]) == 0
    assert main(["simulate", "--policy", "sfs", "--rate", "4", "--requests", "40",
                 "--replicas", "0", "--out", str(out)]) == 2
    assert "--replicas" in capsys.readouterr().err


# -- the lower bound that lets a decision skip forecasts -------------------------------------------

@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("model", ["paper4", "sfs6"])
def test_the_first_token_floor_never_exceeds_the_forecast(caching: bool, model: str) -> None:
    """Random engine states (running, waiting, chunked prefills, decoders), random probes:
    the cheap floor is at or below the engine's own forecast from its snapshot."""
    from dataclasses import replace

    from duetime.engine.batch_time import Sfs6
    from duetime.engine.engine import Engine
    from duetime.engine.forecasting import ForecastError, forecast
    from duetime.engine.profiles import load_profile

    spec = load_profile("qwen3-8b")
    bt = spec.batch_time if model == "paper4" else Sfs6(c0=0.012, cp=4e-5, cpsq=1e-10,
                                                        cd=2e-4, cs=1e-7, css=1e-11)
    cfg = replace(spec.config, enable_prefix_caching=caching)
    rng = np.random.default_rng(1)
    checked = 0
    for case in range(60):
        eng = Engine(cfg, bt)
        t = 0.0
        for k in range(int(rng.integers(0, 40))):
            t += float(rng.exponential(0.02))
            eng.run_until(t)
            eng.add(f"r{k}", int(rng.integers(1, 6000)), int(rng.integers(1, 400)), arrival=t)
        eng.run_until(t + float(rng.exponential(0.05)))
        snap = eng.snapshot()
        for p in (1, 16, int(rng.integers(1, 9000))):
            try:
                est = forecast(snap, p).estimate_s
            except ForecastError:
                continue
            floor = eng.first_token_floor(p) - snap.time
            assert floor <= est + 1e-12, (case, p, floor, est)
            checked += 1
    assert checked > 100


def test_bounded_decisions_equal_forecasting_every_replica() -> None:
    """sfs over 30 replicas, with the bound and without it (an estimator without one): the
    same decisions, with a fraction of the forecasts."""
    from duetime.estimate import SfsEstimator

    class Counting:
        name = "sfs"

        def __init__(self, bounded: bool) -> None:
            self.inner, self.calls = SfsEstimator(), 0
            if bounded:
                self.ttft_lower_bound = self.inner.ttft_lower_bound

        def ttft(self, *a, **kw):
            self.calls += 1
            return self.inner.ttft(*a, **kw)

    prof = load_workload("paper").with_replicas(10)
    rng = np.random.default_rng(3)
    reqs = sample_requests(prof, Poisson(86.0).times(1500, rng), rng)
    runs = {}
    for bounded in (True, False):
        pol = make_policy("sfs")
        pol.estimator = Counting(bounded)
        runs[bounded] = (ClusterSim(prof, pol).run(reqs).instance, pol.estimator.calls)
    assert np.array_equal(runs[True][0], runs[False][0])
    print(f"forecasts: {runs[True][1]} with the bound, {runs[False][1]} without")
    assert runs[True][1] < 0.6 * runs[False][1], (runs[True][1], runs[False][1])


# -- replicas in the gateway's pool ------------------------------------------------------------------

def test_an_emulated_instance_with_replicas_is_started_several_times() -> None:
    from duetime.gateway import ConfigError, pool_from_dict
    from duetime.service import demo_pool

    pool = pool_from_dict({"instances": [
        {"name": "big", "model": "qwen3-8b", "replicas": 3, "emulate": {"seed": 7}},
        {"name": "small", "model": "qwen3-0.6b", "emulate": {}}]}, "t")
    assert [i.name for i in pool.instances] == ["big.0", "big.1", "big.2", "small"]
    assert [i.emulate["seed"] for i in pool.instances[:3]] == [7, 8, 9]
    assert {i.model for i in pool.instances[:3]} == {"qwen3-8b"}
    with pytest.raises(ConfigError, match=r"instances\[0\]\.replicas: only an emulated"):
        pool_from_dict({"instances": [{"name": "a", "model": "m", "url": "http://x:1",
                                       "profile": "qwen3-8b", "replicas": 2}]}, "t")
    with pytest.raises(ConfigError, match=r"duplicate instance name 'big\.1'"):
        pool_from_dict({"instances": [
            {"name": "big", "model": "qwen3-8b", "replicas": 2, "emulate": {}},
            {"name": "big.1", "model": "qwen3-8b", "emulate": {}}]}, "t")
    demo = demo_pool(replicas=2)
    assert len(demo.instances) == 6 and demo.instances[0].name == "qwen3-0.6b.0"
    assert [i.name for i in demo_pool().instances] == ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]


def test_serve_replicas_is_for_the_demo_pool(tmp_path, capsys) -> None:
    cfg = tmp_path / "pool.yaml"
    cfg.write_text("instances: [{name: a, model: qwen3-8b, emulate: {}}]\n")
    assert main(["serve", "--config", str(cfg), "--replicas", "2"]) == 2
    assert "--replicas applies to the demo pool only" in capsys.readouterr().err


def test_the_gateway_spreads_a_burst_over_a_models_replicas() -> None:
    """Six long prompts at once to a model of three emulated replicas: the forecasts send
    them to more than one replica (by position they would all have gone to the first while
    it met the loose target)."""
    import asyncio

    import httpx

    from duetime.gateway import pool_from_dict
    from duetime.service import Service

    pool = pool_from_dict({"policy": "sfs", "instances": [
        {"name": "big", "model": "qwen3-8b", "replicas": 3, "emulate": {"speed": 4.0}}]}, "t")

    async def go() -> list[str]:
        svc = await Service(pool, drain_timeout_s=3.0).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=30) as c:
                async def one() -> str:
                    r = await c.post("/v1/completions", json={
                        "model": "qwen3-8b", "prompt": "word " * 3000, "max_tokens": 2},
                        headers={"x-duetime-ttft-ms": "60000"})
                    assert r.status_code == 200, r.text
                    return r.headers["x-duetime-instance"]
                return await asyncio.gather(*(one() for _ in range(6)))
        finally:
            await svc.stop()

    used = asyncio.run(asyncio.wait_for(go(), 60))
    assert set(used) <= {"big.0", "big.1", "big.2"} and len(set(used)) >= 2, used


@pytest.mark.parametrize(("policy", "noise"), [("sfs", 0.0), ("round-robin", 0.05)])
def test_stepping_only_busy_engines_changes_nothing(monkeypatch, policy: str,
                                                    noise: float) -> None:
    """The simulator steps only the engines with a step before the arrival; stepping every
    engine at every arrival (as it did) gives the same requests the same times, noise
    included (the same steps in the same order draw the same noise)."""
    from duetime.sim import cluster

    prof = load_workload("paper").with_replicas(5)
    rng = np.random.default_rng(4)
    reqs = sample_requests(prof, Poisson(43.0).times(1500, rng), rng)
    runs = []
    for every in (False, True):
        if every:
            monkeypatch.setattr(cluster, "_due", lambda busy, t: np.arange(len(busy)))
        res = ClusterSim(prof, make_policy(policy), noise=noise).run(reqs)
        runs.append((res.instance, res.first_token, res.finish))
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)
