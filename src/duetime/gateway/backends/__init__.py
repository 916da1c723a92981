"""Shared-state backends: where a gateway keeps what its replicas may share — in-flight
attempts, the other replicas' attempts and ejections, rate-limit buckets, session bindings.

:class:`SharedState` is what the gateway's composition root wires in (``gateway/app.py``):
:class:`~duetime.gateway.backends.memory.MemoryState` (this process only) or
:class:`~duetime.gateway.backends.redis_state.RedisState` (``state.store: redis://...``).
Live state and the intake depend only on the protocols they name
(:class:`~duetime.gateway.state.flight.FlightStore`,
:class:`~duetime.gateway.state.peers.PeerFeed`,
:class:`~duetime.gateway.intake.ratelimit.RateLimitStore`); nothing below the composition root
imports a backend.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from duetime.gateway.config import StateSpec
from duetime.gateway.intake.ratelimit import RateLimitStore
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import FlightStore
from duetime.gateway.state.peers import PeerFeed


class PoolConfigFeed(Protocol):
    """The pool config the replicas last applied (:mod:`.redis_pool`)."""

    async def publish(self, text: str) -> None:
        """This replica applied ``text``."""
        ...

    async def follow(self, on_config: Callable[[str, str], Awaitable[None]]) -> None:
        """Hand each config another replica applies (its text, that replica) to
        ``on_config``, until cancelled."""
        ...


class SharedState(Protocol):
    """A backend's parts: ``flights`` (this replica's attempts), ``peers`` (the others'),
    ``limits`` (rate-limit buckets), ``bindings`` (session bindings; None: each policy keeps
    its own), ``pool_config`` (the pool config the replicas agree on; None: alone)."""

    flights: FlightStore
    peers: PeerFeed
    limits: RateLimitStore
    bindings: MutableMapping[str, str] | None
    pool_config: PoolConfigFeed | None

    async def start(self, metrics: GatewayMetrics) -> None:
        """Start syncing (nothing for memory)."""
        ...

    async def close(self) -> None:
        ...

    def describe(self) -> dict[str, Any]:
        """For ``GET /duetime/instances``: the kind of store and its state."""
        ...


def open_shared_state(spec: StateSpec) -> SharedState:
    """The backend ``state.store`` names: Redis for a URL, else this process's memory."""
    if spec.store is None:
        from duetime.gateway.backends.memory import MemoryState
        return MemoryState()
    from duetime.gateway.backends.redis_state import RedisState
    return RedisState(spec)
