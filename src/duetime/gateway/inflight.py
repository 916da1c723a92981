"""The in-flight ledger: every upstream attempt the gateway has dispatched and not yet seen
end, per instance, behind a small store interface.

:class:`FlightStore` is where the flights live. :class:`MemoryStore` keeps them in this
process; a shared store (Redis, for several gateway replicas that must see each other's
queues) implements the same five calls. :class:`InFlight` is one instance's ledger on top of a
store: it records dispatches, first tokens, token progress and completions, remembers recent
completions (a published snapshot may still hold them) and the windows behind the instance's
time-averaged statistics.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from duetime.estimate.base import InstanceStats

STATS_WINDOW = 256   # recent requests the time-averaged statistics look at
DONE_MEMORY_S = 5.0  # how long a completion is remembered


class Flight:
    """One upstream attempt, as the gateway observes it."""

    __slots__ = ("cached_tokens", "dispatched", "first_token", "forecast", "hashes", "id",
                 "predicted", "prompt_tokens", "raw_forecast", "shadowed", "tokens")

    def __init__(self, fid: str, prompt_tokens: int, predicted: int, dispatched: float,
                 forecast: float | None, hashes: Sequence[int] | None = None) -> None:
        self.id = fid
        self.prompt_tokens = prompt_tokens
        self.hashes = hashes  # its prompt's block keys at the instance's block size, if caching
        self.predicted = predicted
        self.dispatched = dispatched
        self.forecast = forecast
        self.first_token: float | None = None
        self.tokens = 0
        self.shadowed = False  # whether it joined the instance's shadow replica
        self.cached_tokens = 0  # prompt tokens the gateway believed cached there at dispatch
        self.raw_forecast: float | None = None  # the forecast before the online correction


class FlightStore(Protocol):
    """Where in-flight attempts are kept, per instance (by name)."""

    def add(self, instance: str, flight: Flight) -> None:
        """A dispatched attempt."""
        ...

    def update(self, instance: str, flight: Flight) -> None:
        """The attempt's first token or token count changed (already set on ``flight``)."""
        ...

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        """The attempt ended at ``t`` (finished, failed or cancelled); None if unknown."""
        ...

    def flights(self, instance: str) -> Mapping[str, Flight]:
        """The instance's attempts in flight, in dispatch order."""
        ...

    def done(self, instance: str) -> Mapping[str, float]:
        """Attempts that ended in the last seconds: id -> end time, oldest first."""
        ...


class MemoryStore:
    """The flights of one gateway process, in its memory."""

    def __init__(self) -> None:
        self._flights: dict[str, dict[str, Flight]] = {}
        self._done: dict[str, dict[str, float]] = {}

    def add(self, instance: str, flight: Flight) -> None:
        self._flights.setdefault(instance, {})[flight.id] = flight

    def update(self, instance: str, flight: Flight) -> None:
        pass  # the flight object itself is what this store holds

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        f = self._flights.get(instance, {}).pop(flight_id, None)
        if f is None:
            return None
        done = self._done.setdefault(instance, {})
        done[flight_id] = t
        if len(done) > 64:  # insertion order is time order: forget from the oldest
            cutoff = t - DONE_MEMORY_S
            for k, when in list(itertools.islice(done.items(), 16)):
                if when >= cutoff:
                    break
                del done[k]
        return f

    def flights(self, instance: str) -> Mapping[str, Flight]:
        return self._flights.setdefault(instance, {})

    def done(self, instance: str) -> Mapping[str, float]:
        return self._done.setdefault(instance, {})

    def instances(self) -> list[str]:
        """The instances with flights recorded (in flight or not)."""
        return list(self._flights)


class InFlight:
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
    def done(self) -> Mapping[str, float]:
        return self.store.done(self.instance)

    def __len__(self) -> int:
        return len(self.flights)

    def dispatch(self, flight: Flight) -> None:
        self.store.add(self.instance, flight)
        self._arrivals.append((flight.dispatched, flight.prompt_tokens))
        self.version += 1

    def first_token(self, flight: Flight, t: float) -> None:
        flight.first_token = t
        flight.tokens = max(flight.tokens, 1)
        self.store.update(self.instance, flight)
        self.version += 1

    def progress(self, flight: Flight, tokens: int) -> None:
        """The attempt has streamed ``tokens`` tokens so far."""
        if tokens != flight.tokens:
            flight.tokens = tokens
            self.store.update(self.instance, flight)

    def complete(self, flight: Flight, t: float, output_tokens: int | None) -> bool:
        """The attempt ended at ``t``; False if it had ended already."""
        if self.store.remove(self.instance, flight.id, t) is None:
            return False
        if output_tokens is not None:
            self._finished.append((flight.dispatched, flight.first_token, t, output_tokens))
        self.version += 1
        return True

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
