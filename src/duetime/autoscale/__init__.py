"""Autoscalers: how many replicas of each model a pool should have, decided at every interval
from what the pool shows (:class:`PoolStatus`). Registered by name with typed parameters, as
routing policies are (:mod:`duetime.autoscale.registry`); the simulator's scaling pools
(:mod:`duetime.sim.scaling`) carry out what they decide."""

from duetime.autoscale.registry import (
    autoscaler_names,
    describe_autoscalers,
    make_autoscaler,
)
from duetime.autoscale.status import Autoscaler, PoolStatus, Recent
from duetime.autoscale.timetable import Scripted, Static

__all__ = ["Autoscaler", "PoolStatus", "Recent", "Scripted", "Static", "autoscaler_names",
           "describe_autoscalers", "make_autoscaler"]
