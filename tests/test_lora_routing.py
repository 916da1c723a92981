"""Routing requests that name a LoRA adapter: llm-d's lora-affinity rule, sfs forecasting the
``max_loras`` cap (a request that would be skipped on one replica goes where it runs now), its
preference for replicas where the adapter already runs, and the simulator carrying adapters."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.engine import Paper4, SchedulerConfig
from duetime.engine.spec import InstanceSpec
from duetime.experiments import lora as lx
from duetime.metrics import summarize
from duetime.policy import make_policy
from duetime.policy.base import Candidate, RoutingRequest
from duetime.policy.lora import lora_affinity_score
from duetime.sim import ClusterSim
from duetime.sim.instance import SimClock, SimInstance
from duetime.workload import load_workload

MODEL = Paper4(b0=0.01, b1=1e-5, b2=0.0, b3=0.0)


def test_lora_affinity_score_is_llm_ds_rule() -> None:
    """1.0 where the adapter has requests, 0.8 where the listed adapters are fewer than
    max_loras, else 0 (vLLM lists every adapter with a live request as running and waiting:
    the 0.6 tier is not reachable); the base model is 1.0 everywhere."""
    assert lora_affinity_score(3, frozenset({3, 5}), 2) == 1.0
    assert lora_affinity_score(4, frozenset({3}), 2) == 0.8
    assert lora_affinity_score(4, frozenset({3, 5}), 2) == 0.0
    assert lora_affinity_score(0, frozenset({3, 5}), 2) == 1.0


def _pool(max_loras: int, n: int = 2) -> list[SimInstance]:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, num_gpu_blocks=2000,
                          max_model_len=4096, max_loras=max_loras)
    clock = SimClock()
    return [SimInstance(f"i{k}", InstanceSpec("m", MODEL, cfg), clock=clock) for k in range(n)]


def _cands(insts: list[SimInstance]) -> list[Candidate]:
    return [Candidate(i.name, "m", 0.0, 0.0, i) for i in insts]


def _request(lora: int, target: float) -> RoutingRequest:
    return RoutingRequest("probe", 50, np.array([0.8, 0.8]), np.array([10, 10]), target,
                          lora=lora)


def test_sfs_sends_a_request_where_its_adapter_is_not_skipped() -> None:
    """max_loras 1: replica 0 decodes a long request on adapter 1 and has the shorter queue,
    replica 1 decodes two short ones on the base model. A request on adapter 2 would wait on
    replica 0 until adapter 1's request finishes (its forecast says so); sfs sends it to
    replica 1, a request on adapter 1 to replica 0; lora-affinity sends the adapter-2 request
    to replica 0 only when adapter 1 runs on both replicas (scoring 0 everywhere)."""
    insts = _pool(max_loras=1)
    insts[0].submit("a", 100, 200, 200, 0.0, lora=1)
    insts[1].submit("b", 100, 20, 20, 0.0)
    insts[1].submit("c", 100, 20, 20, 0.0)
    for i in insts:
        i.advance(0.05)
    now = max(i.engine.time for i in insts)
    for i in insts:
        i.advance(now)
        i.now = now
    cands = _cands(insts)
    sfs = make_policy("sfs", {})
    f = [sfs.estimator.ttft(i, 50, now, lora=2) for i in insts]
    assert f[0] > 10 * f[1]  # skipped on replica 0 until adapter 1's request finishes
    assert sfs.choose(_request(2, 1.0), cands, now).index == 1
    assert sfs.choose(_request(1, 1.0), cands, now).index == 0
    la = make_policy("lora-affinity", {})
    assert insts[0].lora_adapters == (frozenset({1}), 1)
    assert la.scorers(_request(2, 1.0), cands)["lora"].tolist() == [0.0, 0.8]


def test_sfs_prefers_a_replica_where_the_adapter_already_runs() -> None:
    """Both replicas meet the target for a request on adapter 3; replica 1 already runs
    adapter 3 (and is a little busier): sfs takes it, keeping replica 0's slot for another
    adapter; on the base model it takes the least forecast."""
    insts = _pool(max_loras=2)
    insts[1].submit("x", 100, 100, 100, 0.0, lora=3)
    insts[1].submit("y", 100, 100, 100, 0.0)
    for i in insts:
        i.advance(0.05)
        i.now = 0.05
    cands = _cands(insts)
    sfs = make_policy("sfs", {})
    f = [sfs.estimator.ttft(i, 50, 0.05, lora=3) for i in insts]
    assert f[0] < f[1] < 1.0
    assert sfs.choose(_request(3, 1.0), cands, 0.05).index == 1
    assert sfs.choose(_request(0, 1.0), cands, 0.05).index == 0


def test_the_simulator_runs_requests_on_adapters() -> None:
    """A stream naming adapters on a pool with max_loras: every request is served, sfs keeps
    more on time than round-robin (which sends requests where their adapter waits), and the
    engines ran the adapters (snapshots carry them)."""
    paper = load_workload("paper")
    prof = lx.lora_profile(paper, 2, 4)
    rs = lx.lora_stream(prof, 8.0, 400, 8, 0)
    assert rs.adapter is not None and set(np.unique(rs.adapter)) <= set(range(1, 9))
    got = {}
    for router in ("sfs", "round-robin"):
        sim = ClusterSim(prof, make_policy(router, {}, defaults={"lambda": prof.lam}), seed=0)
        res = sim.run(rs)
        assert np.isfinite(res.ttft).all()
        got[router] = summarize(res)["on_time"]
    assert got["sfs"] > got["round-robin"] + 0.2
    base = ClusterSim(prof, make_policy("round-robin", {}), seed=0).run(replace(rs, adapter=None))
    assert summarize(base)["on_time"] > got["round-robin"]  # the cap is what made it late


def test_shared_prefixes_on_adapters_are_refused_in_simulation() -> None:
    """The simulator's block keys do not carry adapters yet: a stream with both is an error,
    not a silent cache hit across adapters."""
    from duetime.experiments import prefix as px

    paper = load_workload("paper")
    s = px.make_stream("system-prompts", paper, 2.0, 20, 0)
    rs = replace(s.requests, adapter=np.ones(len(s.requests), dtype=np.int64))
    with pytest.raises(ValueError, match="block keys do not carry adapters"):
        ClusterSim(paper, make_policy("round-robin", {}), seed=0, prefix_caching=True).run(rs)
