"""Independent simulations fanned out: over local processes (by default) or a Ray cluster.

A plan's rate levels and an experiment's points are independent and deterministic (each
simulation draws from its own seeded generators), so running them elsewhere changes when they
finish, never what they return: results are gathered in the order of the inputs and equal a
serial run's. Local workers are started fresh (``spawn``: no state copied from the parent);
Ray (``--ray auto`` or a head's address, Ray from the package index) runs each call as a task
of one CPU. Functions and their arguments must pickle: module-level functions of plain data.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Fanout:
    """Where independent calls run: ``workers`` local processes (1: here, serially), or the
    Ray cluster at ``ray`` (``auto``: the one this machine has joined, or a head's address)."""

    workers: int = 1
    ray: str | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")

    @classmethod
    def local(cls) -> Fanout:
        """One process per CPU this process may use."""
        return cls(workers=max(1, len(os.sched_getaffinity(0))))

    @property
    def label(self) -> str:
        if self.ray is not None:
            return f"ray ({self.ray})"
        return "serial" if self.workers == 1 else f"{self.workers} local processes"

    def map(self, fn: Callable[..., Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(*item) for item in items]``, computed where this fan-out says."""
        items = [tuple(x) for x in items]
        if self.ray is not None:
            return _ray_map(self.ray, fn, items)
        if self.workers == 1 or len(items) <= 1:
            return [fn(*x) for x in items]
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(self.workers, len(items)), mp_context=ctx) as pool:
            futures = [pool.submit(fn, *x) for x in items]
            return [f.result() for f in futures]


def _ray_map(address: str, fn: Callable[..., Any], items: list[tuple]) -> list[Any]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install ray") from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    task = ray.remote(num_cpus=1)(fn)
    return ray.get([task.remote(*x) for x in items])
