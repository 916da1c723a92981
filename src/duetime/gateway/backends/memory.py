"""The memory backend: one gateway process's flights, rate-limit buckets and session bindings
(nothing shared; several replicas each see only their own)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, MutableMapping
from typing import Any

from duetime.gateway.intake.ratelimit import MemoryLimitStore
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.peers import NO_PEERS, PeerFeed

ENDED_MEMORY_S = 5.0  # how long an ended attempt is remembered


class MemoryStore:
    """The flights of one gateway process, in its memory."""

    def __init__(self) -> None:
        self._flights: dict[str, dict[str, Flight]] = {}
        self._ended: dict[str, dict[str, float]] = {}

    def add(self, instance: str, flight: Flight) -> None:
        self._flights.setdefault(instance, {})[flight.id] = flight

    def update(self, instance: str, flight: Flight) -> None:
        pass  # the flight object itself is what this store holds

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        f = self._flights.get(instance, {}).pop(flight_id, None)
        if f is None:
            return None
        ended = self._ended.setdefault(instance, {})
        ended[flight_id] = t
        if len(ended) > 64:  # insertion order is time order: forget from the oldest
            cutoff = t - ENDED_MEMORY_S
            for k, when in list(itertools.islice(ended.items(), 16)):
                if when >= cutoff:
                    break
                del ended[k]
        return f

    def flights(self, instance: str) -> Mapping[str, Flight]:
        return self._flights.setdefault(instance, {})

    def ended(self, instance: str) -> Mapping[str, float]:
        return self._ended.setdefault(instance, {})

    def instances(self) -> list[str]:
        """The instances with flights recorded (in flight or not)."""
        return list(self._flights)


class MemoryState:
    """This process's state only (the :class:`~duetime.gateway.backends.SharedState` of a
    gateway without ``state.store``). ``bindings`` is None: a session-affinity policy keeps
    its own."""

    def __init__(self) -> None:
        self.flights = MemoryStore()
        self.limits = MemoryLimitStore()
        self.peers: PeerFeed = NO_PEERS
        self.bindings: MutableMapping[str, str] | None = None
        self.pool_config = None  # (alone: no other replica to agree with)

    async def start(self, metrics: GatewayMetrics) -> None:
        pass  # (nothing to sync)

    async def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"kind": "memory"}
