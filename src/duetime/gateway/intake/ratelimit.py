"""Per-key rate limits (requests and tokens per minute) as token buckets, behind a small store
interface.

Each limit is a bucket that holds at most ``per_minute`` units and refills at ``per_minute /
60`` units a second: a request takes 1 from its key's request bucket and its prompt tokens from
its token bucket at admission; its output tokens are charged when known (the bucket may go into
debt, and the key's next request waits for the refill). Why a token bucket: two numbers per key
(a sliding-window log keeps one entry per request in the window), no burst of twice the limit
at a window's edge (a fixed window has one), and the exact time until a request would fit
(``Retry-After``) is one division. It is GCRA's equivalent, which is what a shared store (Redis:
one hash per bucket, the same arithmetic in a script) would run.

:class:`RateLimitStore` is where the buckets live. :class:`MemoryLimitStore` keeps them in this
process (N replicas would admit up to N times a key's limit);
:class:`~duetime.gateway.backends.redis_limits.RedisLimitStore` keeps them in Redis, shared by
every replica. ``now`` is passed in by the caller (:class:`Limiter`'s clock), so tests need not
sleep; a shared store reads the time from Redis instead, so that replicas agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Draw:
    """Take ``cost`` units from ``bucket``, a bucket of ``per_minute`` units."""

    bucket: str
    per_minute: int
    cost: float


@dataclass(frozen=True, slots=True)
class Level:
    """Where a bucket stands after a draw (or, if the draws were refused, now)."""

    per_minute: int
    remaining: float  # units left (negative: in debt)
    wait_s: float     # until the draw would fit (0 if it did; inf if it never can)
    reset_s: float    # until the bucket is full again


class RateLimitStore(Protocol):
    """Where the buckets are kept (this process's memory, or Redis)."""

    async def acquire(self, draws: Sequence[Draw], now: float) -> tuple[bool, list[Level]]:
        """Take every draw if all fit at ``now``, else none; each bucket's level after."""
        ...

    def charge(self, draw: Draw, now: float) -> None:
        """Take the draw whether or not it fits (output tokens, known after the fact; a
        shared store takes it in the background)."""
        ...


class MemoryLimitStore:
    """The buckets of one gateway process: bucket -> (units, when they were counted)."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float, float]] = {}

    def _units(self, d: Draw, now: float) -> float:
        units, t = self._buckets.get(d.bucket, (float(d.per_minute), now))
        return min(float(d.per_minute), units + max(0.0, now - t) * d.per_minute / 60.0)

    def take(self, draws: Sequence[Draw], now: float) -> tuple[bool, list[Level]]:
        """:meth:`acquire`, without awaiting (what a shared store falls back to)."""
        units = [self._units(d, now) for d in draws]
        ok = all(u >= d.cost for u, d in zip(units, draws, strict=True))
        for u, d in zip(units, draws, strict=True):
            if ok:
                self._buckets[d.bucket] = (u - d.cost, now)
        return ok, levels(draws, units, ok)

    async def acquire(self, draws: Sequence[Draw], now: float) -> tuple[bool, list[Level]]:
        return self.take(draws, now)

    def charge(self, draw: Draw, now: float) -> None:
        self._buckets[draw.bucket] = (self._units(draw, now) - draw.cost, now)


def levels(draws: Sequence[Draw], units: Sequence[float], ok: bool) -> list[Level]:
    """Each bucket's level after the draws were taken (``ok``) or refused, from the ``units``
    each held before."""
    out = []
    for u, d in zip(units, draws, strict=True):
        left = u - d.cost if ok else u
        wait = 0.0 if ok else (math.inf if d.cost > d.per_minute
                               else max(0.0, (d.cost - u) * 60.0 / d.per_minute))
        out.append(Level(d.per_minute, left, wait,
                         max(0.0, (d.per_minute - left) * 60.0 / d.per_minute)))
    return out


class Limiter:
    """The gateway's limits over a store, on a clock (``time.monotonic`` unless a test gives
    another)."""

    def __init__(self, store: RateLimitStore | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store: RateLimitStore = store if store is not None else MemoryLimitStore()
        self.clock = clock

    async def acquire(self, draws: Sequence[Draw]) -> tuple[bool, list[Level]]:
        return await self.store.acquire(draws, self.clock())

    def charge(self, draw: Draw) -> None:
        self.store.charge(draw, self.clock())
