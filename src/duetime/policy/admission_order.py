"""The order in which requests waiting for capacity are let go: priority band first, then the
key (tenant) that has been served least recently, then the earliest deadline.

Shared by the gateway's admission queue (:mod:`duetime.gateway.intake.admission`) and the
simulator's model of it (:mod:`duetime.sim.admission`), so that an experiment measures the
queue the gateway runs. It is pure and synchronous: no clock of its own (every call is told
``now``), no asyncio.

Why three levels, as llm-d's flow control has them: a *priority band* is strict (a critical
request never waits behind a standard one); within a band a *fairness* policy picks which
flow (here: which client key) goes next; within that flow an *ordering* policy picks the
request (llm-d offers FCFS or EDF by SLO deadline). The fairness level is *least attained
service*: the key that was served the fewest tokens recently goes first, so a heavy tenant
with many waiters cannot starve a light one, and a key that sends few large requests is not
favoured over one that sends many small ones (a count of requests would). "Recently" is an
exponential decay with a half-life (``half_life_s``): a key that was heavy an hour ago is not
punished now. Keys with equal attained service (none yet, typically) take turns (the one
let go least recently first); within a key the earliest deadline goes first (EDF: the
request with the least slack), arrival order breaking ties.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

FORGET_BELOW = 1e-3  # tokens: a key decayed below this is forgotten (it reads as never seen)


class AttainedService:
    """Tokens served per key, exponentially decayed with ``half_life_s`` (``math.inf``: never
    decayed). A key never seen has 0.

    Every key decays by the same factor, so values are kept scaled to a common reference time
    and compared without decaying them (:meth:`level`); the reference moves forward (and keys
    decayed to nothing are forgotten) at most once per half-life."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._ref = 0.0  # the reference time the stored levels are scaled to
        self._started = False
        self._levels: dict[str, float] = {}

    def _rebase(self, now: float) -> None:
        if not self._started:
            self._ref, self._started = now, True
            return
        if now - self._ref <= self.half_life_s:
            return
        factor = 2.0 ** (-(now - self._ref) / self.half_life_s)
        self._ref = now
        self._levels = {k: v * factor for k, v in self._levels.items()
                        if v * factor >= FORGET_BELOW}

    def add(self, key: str, tokens: float, now: float) -> None:
        """``key`` was served ``tokens`` tokens at ``now``."""
        if tokens <= 0:
            return
        self._rebase(now)
        scaled = tokens * 2.0 ** ((now - self._ref) / self.half_life_s)
        self._levels[key] = self._levels.get(key, 0.0) + scaled

    def level(self, key: str) -> float:
        """A number proportional to ``key``'s attained service now, by the same factor for
        every key: what orders keys (0 for a key never seen)."""
        return self._levels.get(key, 0.0)

    def value(self, key: str, now: float) -> float:
        """``key``'s attained service at ``now``, in tokens."""
        return self.level(key) * 2.0 ** (-(now - self._ref) / self.half_life_s)

    def values(self, now: float) -> dict[str, float]:
        """Every remembered key's attained service at ``now``, in tokens."""
        return {k: self.value(k, now) for k in self._levels}


@dataclass(eq=False, slots=True)
class Waiting(Generic[T]):
    """One waiting request: its key, priority band (``rank``: 0 the highest), deadline (an
    absolute time on the caller's clock), arrival order and the caller's ``payload``."""

    key: str
    rank: int
    deadline: float
    seq: int
    payload: T
    waiting: bool = True  # False once popped or removed


class _Flow(Generic[T]):
    """One key's waiters in one band, earliest deadline first (removal is lazy: a removed
    entry stays in the heap until it reaches the top, or the heap is compacted)."""

    __slots__ = ("heap", "live")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Waiting[T]]] = []
        self.live = 0

    def push(self, e: Waiting[T]) -> None:
        heapq.heappush(self.heap, (e.deadline, e.seq, e))
        self.live += 1

    def head(self) -> Waiting[T]:
        while not self.heap[0][2].waiting:
            heapq.heappop(self.heap)
        return self.heap[0][2]

    def discard(self, e: Waiting[T]) -> None:
        self.live -= 1
        if len(self.heap) > 2 * self.live + 16:  # (mostly removed entries: compact)
            self.heap = [x for x in self.heap if x[2].waiting]
            heapq.heapify(self.heap)

    def latest(self) -> Waiting[T]:
        """The waiter with the latest deadline (the last to go)."""
        return max((x for x in self.heap if x[2].waiting), key=lambda x: (x[0], x[1]))[2]


class AdmissionOrder(Generic[T]):
    """Waiting requests in the order they are let go (:meth:`pop`): the highest band (lowest
    ``rank``) first; within it the key with the least attained service (:class:`AttainedService`,
    fed by :meth:`served`), keys that tie taking turns; within the key the earliest deadline,
    then arrival order."""

    def __init__(self, half_life_s: float = 60.0) -> None:
        self.service = AttainedService(half_life_s)
        self._bands: dict[int, dict[str, _Flow[T]]] = {}
        self._seq = itertools.count()
        self._turn = itertools.count(1)
        self._last_turn: dict[str, int] = {}  # key -> when it was last let go (ties' turns)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Waiting[T]]:
        """The waiting entries, in no particular order."""
        for band in self._bands.values():
            for flow in band.values():
                yield from (x[2] for x in flow.heap if x[2].waiting)

    def push(self, key: str, rank: int, deadline: float, payload: T) -> Waiting[T]:
        """A request of ``key`` waits in band ``rank`` with its absolute ``deadline``."""
        e = Waiting(key, rank, deadline, next(self._seq), payload)
        self._bands.setdefault(rank, {}).setdefault(key, _Flow()).push(e)
        self._size += 1
        return e

    def served(self, key: str, tokens: float, now: float) -> None:
        """``key`` was served ``tokens`` tokens (prompt or output) at ``now``."""
        self.service.add(key, tokens, now)

    def _next_key(self, band: dict[str, _Flow[T]]) -> str:
        def order(k: str) -> tuple[float, int, float, int]:
            head = band[k].head()
            return self.service.level(k), self._last_turn.get(k, 0), head.deadline, head.seq
        return min(band, key=order)

    def peek(self) -> Waiting[T] | None:
        """The entry :meth:`pop` would return, left waiting."""
        if not self._bands:
            return None
        band = self._bands[min(self._bands)]
        return band[self._next_key(band)].head()

    def pop(self) -> Waiting[T] | None:
        """The next request to let go (None when none waits)."""
        e = self.peek()
        if e is not None:
            self.remove(e)
            self._last_turn[e.key] = next(self._turn)
            if len(self._last_turn) > 4 * self._size + 64:  # (keys long gone: forget their turns)
                waiting = {x.key for x in self}
                self._last_turn = {k: t for k, t in self._last_turn.items() if k in waiting}
        return e

    def remove(self, e: Waiting[T]) -> bool:
        """Take ``e`` out (its wait ended otherwise); False if it was not waiting."""
        if not e.waiting:
            return False
        e.waiting = False
        self._size -= 1
        band = self._bands[e.rank]
        flow = band[e.key]
        flow.discard(e)
        if flow.live == 0:
            del band[e.key]
            if not band:
                del self._bands[e.rank]
        return True

    def victim(self, key: str, rank: int) -> Waiting[T] | None:
        """Whom a newcomer of ``key`` in band ``rank`` displaces when the queue is full: the
        latest-deadline waiter of the lowest band below ``rank``, else of the key in the same
        band served more than ``key`` (the most served); None if there is none (the newcomer
        is the one turned away). So a full queue of a heavy key's waiters does not lock a
        light key out."""
        if not self._bands:
            return None
        low = max(self._bands)
        if low < rank:
            return None
        band = self._bands[low]
        top = max(band, key=self.service.level)
        if low == rank and (top == key
                            or self.service.level(top) <= self.service.level(key)):
            return None
        return band[top].latest()


def band_of(priority: str, bands: tuple[str, ...]) -> int:
    """A priority's band (its index in ``bands``, highest first); unknown: the lowest."""
    return bands.index(priority) if priority in bands else len(bands)

