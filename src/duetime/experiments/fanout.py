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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
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

    @property
    def serial(self) -> bool:
        return self.ray is None and self.workers == 1

    def width(self) -> int:
        """How many calls run at once: the local workers, or the Ray cluster's CPUs."""
        if self.ray is None:
            return self.workers
        ray = _ray(self.ray)
        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable[..., Any], items: Iterable[Any],
            done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(*item) for item in items]``, computed where this fan-out says; ``done(k,
        result)`` is called here as each finishes (in the order they finish: progress)."""
        items = [tuple(x) for x in items]
        fan = self if len(items) > 1 or self.ray is not None else Fanout()
        with replace(fan, workers=min(fan.workers, max(1, len(items)))).pool() as pool:
            return pool.map(fn, items, done)

    @contextmanager
    def pool(self) -> Iterator[Workers]:
        """Workers that live as long as the ``with`` block (a search that maps pool after
        pool starts its processes once)."""
        if self.ray is not None:
            yield _RayWorkers(self.ray, self.width())
        elif self.workers == 1:
            yield Workers()
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(self.workers, mp_context=ctx) as pool:
                yield _LocalWorkers(pool, self.workers)


class Workers:
    """Where calls run: here, serially (the subclasses: local processes, a Ray cluster)."""

    width = 1

    def map(self, fn: Callable[..., Any], items: Iterable[Any],
            done: Callable[[int, Any], None] | None = None) -> list[Any]:
        out = []
        for k, x in enumerate(items):
            out.append(fn(*x))
            if done is not None:
                done(k, out[-1])
        return out

    def imap(self, fn: Callable[..., Any], items: Iterable[tuple],
             ahead: int | None = None) -> Iterator[Any]:
        """``fn(*item)`` for each item, yielded in order as they are consumed; elsewhere, up to
        ``width`` run at once, and at most ``ahead`` (default 2 x width) are started beyond
        the one awaited. Items are drawn from ``items`` only when a call can start, so a
        consumer that stops early stops the work (what is running finishes)."""
        for x in items:
            yield fn(*x)


class _LocalWorkers(Workers):
    def __init__(self, pool: ProcessPoolExecutor, width: int) -> None:
        self.executor, self.width = pool, width

    def map(self, fn, items, done=None):
        items = list(items)
        futures = {self.executor.submit(fn, *x): k for k, x in enumerate(items)}
        results: list[Any] = [None] * len(items)
        for f in as_completed(futures):
            results[futures[f]] = f.result()
            if done is not None:
                done(futures[f], results[futures[f]])
        return results

    def imap(self, fn, items, ahead=None):
        return _ordered(iter(items), lambda x: self.executor.submit(fn, *x),
                        lambda f: f.done(), lambda fs: wait(fs, return_when=FIRST_COMPLETED),
                        lambda f: f.result(), lambda f: f.cancel(), self.width,
                        ahead or 2 * self.width)


class _RayWorkers(Workers):
    def __init__(self, address: str, width: int) -> None:
        self.ray, self.width = _ray(address), width

    def map(self, fn, items, done=None):
        ray = self.ray
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(*x) for x in items]
        index = {ref: k for k, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            k = index[ready[0]]
            results[k] = ray.get(ready[0])
            if done is not None:
                done(k, results[k])
        return results

    def imap(self, fn, items, ahead=None):
        ray = self.ray
        task = ray.remote(num_cpus=1)(fn)
        finished: set = set()

        def settle(refs):
            ready, _ = ray.wait(list(refs), num_returns=1)
            finished.update(ready)

        return _ordered(iter(items), lambda x: task.remote(*x), lambda r: r in finished,
                        settle, ray.get, lambda r: ray.cancel(r), self.width,
                        ahead or 2 * self.width)


def _ordered(items: Iterator[tuple], start, is_done, wait_any, result, cancel, width: int,
             ahead: int) -> Iterator[Any]:
    """The results of calls started by ``start``, in the order of ``items``: whenever fewer
    than ``width`` run (and fewer than ``ahead`` wait beyond the awaited one), the next item
    starts."""
    started: dict[int, Any] = {}
    n = k = 0
    more = True

    def top_up() -> None:
        nonlocal n, more
        while more and n - k < ahead and sum(not is_done(f) for f in started.values()) < width:
            x = next(items, None)
            if x is None:
                more = False
            else:
                started[n], n = start(x), n + 1

    try:
        while True:
            top_up()
            if k >= n:
                return
            while not is_done(started[k]):
                wait_any([f for f in started.values() if not is_done(f)])
                top_up()
            yield result(started.pop(k))
            k += 1
    finally:
        for f in started.values():
            cancel(f)


_connected: str | None = None  # the address this process's Ray client was started for


def _ray(address: str) -> Any:
    """The ``ray`` module, connected to the cluster at ``address``."""
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
    return ray


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
