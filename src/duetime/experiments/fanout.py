"""Independent simulations fanned out: over local processes (by default) or a Ray cluster.

A plan's rate levels and an experiment's points are independent and deterministic (each
simulation draws from its own seeded generators), so running them elsewhere changes when they
finish, never what they return: results are gathered in the order of the inputs and equal a
serial run's. Local workers are started fresh (``spawn``: no state copied from the parent);
Ray (``--ray auto`` or a head's address, Ray from the package index) runs each call as a task
of one CPU. Functions and their arguments must pickle: module-level functions of plain data.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from duetime.argtypes import positive_int


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

    def map(self, fn: Callable[..., Any], items: Iterable[Any],
            done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(*item) for item in items]``, computed where this fan-out says; ``done(k,
        result)`` is called here as each finishes (in the order they finish: progress)."""
        items = [tuple(x) for x in items]
        if self.ray is not None:
            return _ray_map(self.ray, fn, items, done)
        if self.workers == 1 or len(items) <= 1:
            out = []
            for k, x in enumerate(items):
                out.append(fn(*x))
                if done is not None:
                    done(k, out[-1])
            return out
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(self.workers, len(items)), mp_context=ctx) as pool:
            futures = {pool.submit(fn, *x): k for k, x in enumerate(items)}
            results: list[Any] = [None] * len(items)
            for f in as_completed(futures):
                results[futures[f]] = f.result()
                if done is not None:
                    done(futures[f], results[futures[f]])
            return results


_connected: str | None = None  # the address this process's Ray client was started for


def _ray_map(address: str, fn: Callable[..., Any], items: list[tuple],
             done: Callable[[int, Any], None] | None) -> list[Any]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install ray") from None
    global _connected
    if not ray.is_initialized() or _connected != address:  # (another cluster: leave it)
        ray.shutdown()
        _reachable(address)
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
        _connected = address
    task = ray.remote(num_cpus=1)(fn)
    refs = [task.remote(*x) for x in items]
    index = {ref: k for k, ref in enumerate(refs)}
    results: list[Any] = [None] * len(items)
    waiting = list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        k = index[ready[0]]
        results[k] = ray.get(ready[0])
        if done is not None:
            done(k, results[k])
    return results


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once where a head's address does not answer (``ray.init`` retries for
    minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"no Ray head answers at {address} ({e.strerror or e})") from None


def fanout_from(workers: int | None, ray: str | None) -> Fanout:
    """The fan-out the command-line options ``--workers`` and ``--ray`` ask for (default:
    one local process per CPU)."""
    if ray:
        return Fanout(ray=ray)
    return Fanout(workers) if workers else Fanout.local()


def add_fanout_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--workers`` and ``--ray`` on a command whose independent simulations fan out."""
    parser.add_argument("--workers", type=positive_int, default=None, metavar="N",
                        help=f"{what} in N local processes (default: one per CPU; 1: serially)")
    parser.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                        help=f"{what} on a Ray cluster instead (auto: the one this machine "
                        "joined; or a head's address, e.g. 127.0.0.1:6379); the same results")
