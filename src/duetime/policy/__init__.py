"""Routing policies behind one interface (``Policy.choose``), shared by simulator and gateway,
and the registry that names them (``duetime policies`` lists it).

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
| ``prefix-load`` | llm-d's default profile: weighted prefix-cache + queue + kv-utilization scores |
| ``cache-aware`` | SGLang router: least loaded if imbalanced, else best prefix match, else smallest cache |
| ``lora-affinity`` | llm-d's lora-affinity + queue + kv-utilization scores (LoRA adapters) |
"""

from __future__ import annotations

import duetime.policy.catalog  # noqa: F401  (registers the policies)
from duetime.policy.balancing import LoadAware, RoundRobin, ShortestQueue, load_aware_score
from duetime.policy.base import Candidate, Decision, Policy, RoutingRequest, utility
from duetime.policy.cache_aware import CacheAware, PrefixLoad, queue_score
from duetime.policy.latency import Feasible, LatencyAgnostic, Lps, Sfs, SoftSfs, Throughput
from duetime.policy.lora import LoraAffinity, lora_affinity_score
from duetime.policy.registry import (
    INPUTS,
    Param,
    PolicyError,
    check_params,
    consumes,
    describe,
    make_policy,
    policy_class,
    policy_names,
)
from duetime.policy.retry import ExpectedTtca, Laar, SessionAffinity

POLICY_NAMES = policy_names()

__all__ = [
    "INPUTS",
    "POLICY_NAMES",
    "CacheAware",
    "Candidate",
    "Decision",
    "ExpectedTtca",
    "Feasible",
    "Laar",
    "LatencyAgnostic",
    "LoadAware",
    "LoraAffinity",
    "Lps",
    "Param",
    "Policy",
    "PolicyError",
    "PrefixLoad",
    "RoundRobin",
    "RoutingRequest",
    "SessionAffinity",
    "Sfs",
    "ShortestQueue",
    "SoftSfs",
    "Throughput",
    "check_params",
    "consumes",
    "describe",
    "load_aware_score",
    "lora_affinity_score",
    "make_policy",
    "policy_class",
    "policy_names",
    "queue_score",
    "utility",
]
