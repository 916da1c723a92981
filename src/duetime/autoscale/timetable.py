"""Autoscalers that do not read the pool: a fixed pool, and a timetable."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from duetime.autoscale.status import PoolStatus


@dataclass(slots=True)
class Static:
    """A fixed pool: never changes it."""

    name: ClassVar[str] = "static"
    summary: ClassVar[str] = "a fixed pool (the pool the run starts with)"
    params: ClassVar[tuple] = ()

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        return {}


@dataclass(slots=True)
class Scripted:
    """Replicas per model from a timetable: ``steps`` of (from time s, {model: replicas}), in
    time order (a plan's schedule, or a test's)."""

    steps: tuple[tuple[float, Mapping[str, int]], ...]
    name: ClassVar[str] = "scripted"

    def desired(self, status: PoolStatus) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for t0, want in self.steps:
            if t0 <= status.t:
                out.update(want)
        return out
