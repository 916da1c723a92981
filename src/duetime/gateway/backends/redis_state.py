"""The Redis backend: what gateway replicas share through one Redis (``state.store``) — their
flights and ejections (:mod:`.redis_flights`), session bindings, rate-limit buckets
(:mod:`.redis_limits`) and the pool config they last applied (:mod:`.redis_pool`)."""

from __future__ import annotations

from typing import Any

from duetime.gateway.backends.redis_connection import RedisConnection
from duetime.gateway.backends.redis_flights import RedisFlightStore, SessionBindings
from duetime.gateway.backends.redis_limits import RedisLimitStore
from duetime.gateway.backends.redis_pool import SharedPoolConfig
from duetime.gateway.config import StateSpec
from duetime.gateway.prometheus import GatewayMetrics


class RedisState:
    """The :class:`~duetime.gateway.backends.SharedState` of a replica of a gateway whose
    ``state.store`` names a Redis URL."""

    def __init__(self, spec: StateSpec) -> None:
        assert spec.store is not None
        conn = RedisConnection(spec.store, prefix=spec.store_prefix)
        self.flights = RedisFlightStore(conn, sync_s=spec.store_sync_s, ttl_s=spec.store_ttl_s)
        self.peers = self.flights  # (the store mirrors the other replicas' flights)
        self.limits = RedisLimitStore(conn)
        self.bindings: SessionBindings = self.flights.bindings
        self.pool_config = SharedPoolConfig(conn, self.flights.replica)

    async def start(self, metrics: GatewayMetrics) -> None:
        await self.flights.start(metrics)

    async def close(self) -> None:
        await self.flights.close()

    def describe(self) -> dict[str, Any]:
        return self.flights.describe()
