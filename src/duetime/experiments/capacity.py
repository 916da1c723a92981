"""One replica's rate at the SLO, per model: the profile sweep rate-based autoscalers size
with (Dynamo's planner takes it from its profiler; duetime's from this).

The router decides which requests a model gets, so a model's capacity is measured on *its*
traffic: first the router's run on the workload's pool at ``rate``, then, per model, one
replica alone given the requests the router sent it (cycled, shuffled, Poisson arrivals) at
rates bisected for the highest whose on-time rate stays at ``on_time``. Deterministic for a
seed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duetime.experiments.fanout import Fanout
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.workload import RequestSet, WorkloadProfile, make_arrivals, sample_requests

MEASURED = ["qwen3-0.6b@h100", "qwen3-8b@h100", "qwen3-32b@h100x2"]  # the paper's pool's


def _stream(profile: WorkloadProfile, rate: float, n: int, seed: int):
    rng = np.random.default_rng([seed, int(rate * 1000), n])
    return sample_requests(profile, make_arrivals("poisson", rate).times(n, rng), rng)


def routed(profile: WorkloadProfile, router: str, rate: float, requests: int,
           seed: int = 0) -> dict[str, RequestSet]:
    """model -> the requests ``router`` sends it on the workload's pool at ``rate``."""
    reqs = _stream(profile, rate, requests, seed)
    pol = make_policy(router, defaults={"lambda": profile.lam, "seed": seed, "delta": 1e-6})
    res = ClusterSim(profile, pol, seed=seed).run(reqs)
    out = {}
    for mi, m in enumerate(profile.model_names):
        idx = np.flatnonzero(res.model == mi)
        if idx.size:
            out[m] = RequestSet(reqs.arrival[idx], reqs.task[idx], reqs.prompt[idx],
                                reqs.output[idx], reqs.quality[idx], reqs.target[idx],
                                reqs.tasks, reqs.models)
    return out


def on_time_alone(profile: WorkloadProfile, model: str, mine: RequestSet, rate: float,
                  requests: int, seed: int = 0) -> float:
    """One replica of ``model`` alone on ``mine`` (its requests, in a shuffled cycle, arriving
    Poisson at ``rate``): its on-time rate."""
    rng = np.random.default_rng([seed, int(rate * 1000)])
    idx = rng.permutation(np.resize(np.arange(len(mine)), requests))
    times = make_arrivals("poisson", rate).times(requests, rng)
    reqs = RequestSet(times, mine.task[idx], mine.prompt[idx], mine.output[idx],
                      mine.quality[idx], mine.target[idx], mine.tasks, mine.models)
    pol = make_policy("round-robin", defaults={"seed": seed})
    res = ClusterSim(profile, pol, instances=[(model, model)], seed=seed).run(reqs)
    return float((res.ttft <= reqs.target).mean())


def replica_capacity(profile: WorkloadProfile, router: str = "sfs", *, rate: float = 6.0,
                     on_time: float = 0.95, requests: int = 1500, seed: int = 0,
                     steps: int = 8) -> dict[str, float]:
    """model -> requests/s one replica serves at ``on_time`` on the requests ``router`` sends
    it (bisected over ``steps`` simulations between 0.05 and 40 q/s)."""
    out = {}
    for m, mine in routed(profile, router, rate, requests, seed).items():
        lo, hi = 0.05, 40.0
        if on_time_alone(profile, m, mine, lo, requests, seed) < on_time:
            out[m] = lo
            continue
        for _ in range(steps):
            mid = (lo * hi) ** 0.5  # (geometric: the rates span three orders)
            if on_time_alone(profile, m, mine, mid, requests, seed) >= on_time:
                lo = mid
            else:
                hi = mid
        out[m] = lo
    return out


def planner_table(rates: Sequence[float], *, on_time: float = 0.95, quality: float | None = 0.8,
                  requests: int = 1000, max_replicas: int = 12, router: str = "sfs",
                  seed: int = 0, fanout: Fanout | None = None
                  ) -> list[tuple[float, dict[str, int]]]:
    """The planner's table for a scaling pool of the paper's measured deployments: at each
    rate, the pool ``duetime plan`` finds (fewest GPUs, then cost; every class ``on_time``,
    mean quality ``quality``; ``router`` in the loop), as replicas per model; rates with no
    such pool are left out."""
    from duetime.plan.problem import problem_from_dict
    from duetime.plan.schedule import search_level

    base = problem_from_dict({
        "rate": max(rates), "options": MEASURED, "max_replicas": max_replicas,
        "requests": requests, "max_requests": 4 * requests, "seed": seed,
        "router": router, "objective": "gpus",
        "constraints": {"on_time": on_time, "quality": quality}})
    found = (fanout or Fanout()).map(search_level, [(base, r) for r in rates])
    return [(r, {o.model: n for o, n in got.best.pool})
            for r, got in zip(rates, found, strict=True) if got.best is not None]
