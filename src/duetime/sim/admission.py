"""The gateway's admission queue, modelled for the simulator: the same order
(:class:`~duetime.policy.admission_order.AdmissionOrder`: priority band, then the key with the
least attained service, then the earliest deadline) over simulated time, so that an experiment
measures the queue the gateway runs.

:class:`~duetime.sim.cluster.ClusterSim` (``admission=``) drives it as the gateway's lifecycle
does: a request whose best forecast misses
its target is :meth:`SimAdmission.offer`-ed (False: the queue is full and it displaces nobody,
so it goes to the best forecast at once); each first token and each request's end releases one
waiter (:meth:`SimAdmission.release`), which is decided again; tokens served feed the keys'
attained service (:meth:`SimAdmission.served`); a waiter whose wait budget is spent, or that a
newcomer displaced, comes back from :meth:`SimAdmission.expired` to go to the best forecast.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from duetime.policy.admission_order import AdmissionOrder, Waiting, band_of

PRIORITIES = ("critical", "standard", "sheddable")  # (the gateway's bands, highest first)


@dataclass(slots=True)
class Waited:
    """One wait that ended: the request, its key, how long it waited, and how it ended
    (``released``, ``expired`` or ``displaced``)."""

    i: int
    key: str
    seconds: float
    how: str


class SimAdmission:
    """The admission queue over simulated time: at most ``max_queued`` waiters; attained
    service halves every ``half_life_s``. :attr:`waits` lists each wait as it ends."""

    def __init__(self, max_queued: int, half_life_s: float = 60.0) -> None:
        self.max_queued = max_queued
        self.order: AdmissionOrder[int] = AdmissionOrder(half_life_s)
        self.waits: list[Waited] = []
        # i -> (its entry, when it was queued, its give-up record's number)
        self._entries: dict[int, tuple[Waiting[int], float, int]] = {}
        self._give_up: list[tuple[float, int, int]] = []  # (give up at, seq, i), lazily pruned
        self._seq = itertools.count()
        self._displaced: list[int] = []

    def __len__(self) -> int:
        return len(self.order)

    def offer(self, i: int, key: str, priority: str | int, deadline_abs: float,
              give_up_at: float, now: float) -> bool:
        """Request ``i`` of ``key`` waits (True) until released, until ``give_up_at`` or until
        displaced; False when the queue is full and it displaces nobody (or nothing is left of
        its wait). ``deadline_abs`` orders it within its key (its end-to-end deadline, else its
        TTFT target's expiry)."""
        if give_up_at <= now or i in self._entries:
            return False
        rank = priority if isinstance(priority, int) else band_of(priority, PRIORITIES)
        if len(self.order) >= self.max_queued:
            victim = self.order.victim(key, rank) if self.max_queued > 0 else None
            if victim is None:
                return False
            self._end(victim.payload, now, "displaced")
            self._displaced.append(victim.payload)
        seq = next(self._seq)
        self._entries[i] = (self.order.push(key, rank, deadline_abs, i), now, seq)
        heapq.heappush(self._give_up, (give_up_at, seq, i))
        return True

    def _end(self, i: int, now: float, how: str) -> None:
        entry, since, _ = self._entries.pop(i)
        self.order.remove(entry)  # (False if it was popped)
        self.waits.append(Waited(i, entry.key, now - since, how))

    def _live(self, i: int, seq: int) -> bool:
        """Whether give-up record ``seq`` is request ``i``'s current wait's."""
        entry = self._entries.get(i)
        return entry is not None and entry[2] == seq

    def release(self, now: float, n: int = 1) -> list[int]:
        """Let up to ``n`` waiters go, in the order: the requests to decide again."""
        out: list[int] = []
        while len(out) < n and (e := self.order.pop()) is not None:
            self._end(e.payload, now, "released")
            out.append(e.payload)
        return out

    def served(self, key: str, tokens: float, now: float) -> None:
        """``key`` was served ``tokens`` tokens (a prompt at its first token, an output at its
        end)."""
        self.order.served(key, tokens, now)

    def expired(self, now: float) -> list[int]:
        """The waiters whose wait is over without a release (displaced ones first, then those
        whose ``give_up_at`` has come, earliest first): to the best forecast now."""
        out, self._displaced = self._displaced, []
        while self._give_up and self._give_up[0][0] <= now:
            _, seq, i = heapq.heappop(self._give_up)
            if self._live(i, seq):
                self._end(i, now, "expired")
                out.append(i)
        if len(self._give_up) > 2 * len(self._entries) + 64:  # (mostly gone: compact)
            self._give_up = [x for x in self._give_up if self._live(x[2], x[1])]
            heapq.heapify(self._give_up)
        return out

    def next_give_up(self) -> float | None:
        """When the earliest waiter's wait budget runs out (None: none waits)."""
        while self._give_up and not self._live(self._give_up[0][2], self._give_up[0][1]):
            heapq.heappop(self._give_up)
        return self._give_up[0][0] if self._give_up else None
