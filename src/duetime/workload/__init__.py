"""Workloads: tasks and their length/quality profiles, arrival processes, TTFT targets."""

from duetime.workload.arrivals import MMPP2, Deterministic, Poisson, make_arrivals
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

__all__ = [
    "MMPP2",
    "Deterministic",
    "Poisson",
    "ProfileError",
    "RequestSet",
    "TargetRule",
    "TaskSpec",
    "WorkloadProfile",
    "builtin_profiles",
    "load_trace",
    "load_workload",
    "make_arrivals",
    "profile_from_dict",
    "sample_requests",
]
