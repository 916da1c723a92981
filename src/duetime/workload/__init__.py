"""Workloads: tasks and their length/quality profiles, arrival processes, TTFT targets, and
shared-prefix workloads (segments and their KV-block hashes) for prefix-caching experiments."""

from duetime.workload.arrivals import MMPP2, Deterministic, Poisson, make_arrivals
from duetime.workload.mooncake import load_mooncake_trace
from duetime.workload.prefix import Geometric, multi_turn, shared_prefix, tenants
from duetime.workload.profile import (
    ProfileError,
    TargetRule,
    TaskSpec,
    WorkloadProfile,
    builtin_profiles,
    load_workload,
    profile_from_dict,
)
from duetime.workload.requests import RequestSet, load_trace, sample_requests
from duetime.workload.segments import block_hashes, prompt_hashes, sequence_hashes

__all__ = [
    "MMPP2",
    "Deterministic",
    "Geometric",
    "Poisson",
    "ProfileError",
    "RequestSet",
    "TargetRule",
    "TaskSpec",
    "WorkloadProfile",
    "block_hashes",
    "builtin_profiles",
    "load_mooncake_trace",
    "load_trace",
    "load_workload",
    "make_arrivals",
    "multi_turn",
    "profile_from_dict",
    "prompt_hashes",
    "sample_requests",
    "sequence_hashes",
    "shared_prefix",
    "tenants",
]
