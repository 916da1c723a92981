"""Routing policies behind one interface (``Policy.choose``), shared by simulator and gateway.

| name | rule |
|---|---|
| ``round-robin`` | cursor over instances |
| ``shortest-queue`` | fewest resident requests; random tie-break |
| ``load-aware`` | llm-d's load-aware scorer on waiting requests; random tie-break |
| ``latency-agnostic`` | argmax U = acc - lambda * cost |
| ``sfs`` | argmax U among instances whose SFS TTFT forecast <= target; else min forecast |
| ``sfs-soft`` | argmax U - delta * forecast (microseconds) |
| ``throughput`` | as ``sfs`` with the prefill-throughput estimator |
| ``lps`` | as ``sfs`` with the limited-processor-sharing estimator |
| ``session-affinity`` | first attempt as ``load-aware``; a session's later attempts stick |
| ``laar`` | argmin L/Q, L = c(m)(T(x) + alpha R(m)); penalty on models already attempted |
| ``ttca`` | argmin L/Q over models not yet attempted, L = the engine's end-to-end forecast |
"""

from __future__ import annotations

from duetime.estimate import LpsEstimator, SfsEstimator, ThroughputEstimator
from duetime.policy.balancing import LoadAware, RoundRobin, ShortestQueue, load_aware_score
from duetime.policy.base import Candidate, Decision, Policy, RoutingRequest, utility
from duetime.policy.latency import Feasible, LatencyAgnostic, SoftSfs
from duetime.policy.retry import ExpectedTtca, Laar, SessionAffinity

POLICY_NAMES = ("round-robin", "shortest-queue", "load-aware", "latency-agnostic", "sfs",
                "sfs-soft", "throughput", "lps", "session-affinity", "laar", "ttca")


def make_policy(name: str, *, lam: float = 5.0e-4, seed: int = 0, delta: float = 1e-6,
                lps_k: float | None = None, alpha: float = 0.7) -> Policy:
    """A policy by its CLI/config name."""
    kw = {"lam": lam, "seed": seed}
    if name == "round-robin":
        return RoundRobin(**kw)
    if name == "shortest-queue":
        return ShortestQueue(**kw)
    if name == "load-aware":
        return LoadAware(**kw)
    if name == "latency-agnostic":
        return LatencyAgnostic(**kw)
    if name == "sfs":
        return Feasible(SfsEstimator(), **kw)
    if name == "sfs-soft":
        return SoftSfs(SfsEstimator(), delta=delta, **kw)
    if name == "throughput":
        return Feasible(ThroughputEstimator(), **kw)
    if name == "lps":
        return Feasible(LpsEstimator(k=lps_k), **kw)
    if name == "session-affinity":
        return SessionAffinity(**kw)
    if name == "laar":
        return Laar(alpha=alpha, **kw)
    if name == "ttca":
        return ExpectedTtca(**kw)
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "Candidate", "Decision", "ExpectedTtca", "Feasible", "Laar",
           "LatencyAgnostic", "LoadAware", "Policy", "RoundRobin", "RoutingRequest",
           "SessionAffinity", "ShortestQueue", "SoftSfs", "load_aware_score", "make_policy",
           "utility"]
