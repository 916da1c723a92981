"""The in-flight ledger: every upstream attempt the gateway has dispatched to one instance and
not yet seen end, in a :class:`~duetime.gateway.state.flight.FlightStore` (this process's
memory, or Redis shared with the other gateway replicas).

The ledger is an attempt-lifecycle subscriber: it records dispatches, first tokens, token
progress and ends in the store, remembers recent ends (a published snapshot may still hold
those attempts) and keeps the windows behind the instance's time-averaged statistics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from duetime.estimate.base import InstanceStats
from duetime.gateway.state.flight import Flight, FlightStore
from duetime.gateway.state.lifecycle import Attempt, Subscriber

STATS_WINDOW = 256   # recent requests the time-averaged statistics look at


class Ledger(Subscriber):
    """One instance's ledger over a :class:`FlightStore`. ``version`` changes with every
    record (a cache key for views built from the flights)."""

    def __init__(self, instance: str, store: FlightStore) -> None:
        self.instance = instance
        self.store = store
        self.version = 0
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=STATS_WINDOW)
        self._finished: deque[tuple[float, float | None, float, int]] = deque(
            maxlen=STATS_WINDOW)

    @property
    def flights(self) -> Mapping[str, Flight]:
        return self.store.flights(self.instance)

    @property
    def ended(self) -> Mapping[str, float]:
        """Attempts that ended in the last seconds: id -> end time."""
        return self.store.ended(self.instance)

    def __len__(self) -> int:
        return len(self.flights)

    def on_dispatch(self, a: Attempt) -> None:
        f = a.flight
        self.store.add(self.instance, f)
        self._arrivals.append((f.dispatched, f.prompt_tokens))
        self.version += 1

    def on_first_token(self, a: Attempt) -> None:
        self.store.update(self.instance, a.flight)
        self.version += 1

    def on_progress(self, a: Attempt) -> None:
        self.store.update(self.instance, a.flight)

    def on_end(self, a: Attempt) -> None:
        f = a.flight
        assert a.ended is not None
        if self.store.remove(self.instance, f.id, a.ended) is None:
            return
        if a.output_tokens is not None:
            self._finished.append((f.dispatched, f.first_token, a.ended, a.output_tokens))
        self.version += 1

    def stats(self, now: float) -> InstanceStats:
        """Time-averaged observations over the last ``STATS_WINDOW`` attempts."""
        if not self._arrivals:
            return InstanceStats()
        s = InstanceStats(elapsed_s=max(now - self._arrivals[0][0], 1e-9),
                          arrivals=len(self._arrivals),
                          prompt_tokens_sum=sum(p for _, p in self._arrivals))
        for dispatched, first, finish, out in self._finished:
            if first is not None:
                s.ttft_s_sum += first - dispatched
                s.ttft_count += 1
            s.e2e_s_sum += finish - dispatched
            s.e2e_count += 1
            s.output_tokens_sum += out
        return s
