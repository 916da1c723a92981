"""One Redis client for a gateway replica, and whether Redis answers: the connection the shared
flights (:mod:`.redis_flights`) and the shared rate limits (:mod:`.redis_limits`) use."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from duetime.gateway.prometheus import GatewayMetrics

log = logging.getLogger("duetime.gateway")

RETRY_S = 0.5  # how often a replica tries Redis again while it is down
FAILURES = (RedisError, OSError, asyncio.TimeoutError)


def still_running() -> None:
    """Raise CancelledError if this task was cancelled: redis-py may swallow a cancel that
    meets a command under way (or turn it into a connection error), and the sync loops would
    then run on forever after close()."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RedisConnection:
    """One Redis client for a gateway replica, and whether Redis answers (logged once per
    change, exported as ``duetime_store_up``)."""

    def __init__(self, url: str, *, timeout_s: float = 0.5, prefix: str = "duetime") -> None:
        self.url = url
        self.prefix = prefix
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s,
                                              decode_responses=True)
        self.up: bool | None = None  # unknown until the first call
        self.metrics: GatewayMetrics | None = None

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def ok(self) -> None:
        if self.up is not True:
            if self.up is False:
                log.warning("shared store back", extra={"fields": {"event": "store_up"}})
            self.up = True
            if self.metrics is not None:
                self.metrics.store_up.set(1)

    def failed(self, op: str, err: BaseException) -> None:
        if self.metrics is not None:
            self.metrics.store_errors.labels(op).inc()
            self.metrics.store_up.set(0)
        if self.up is not False:
            log.warning("shared store unreachable: routing on this replica's state only",
                        extra={"fields": {"event": "store_down", "op": op,
                                          "error": f"{type(err).__name__}: {err}"[:200]}})
        self.up = False

    async def subscribe(self, channel: str,
                        handle: Callable[[object], Awaitable[None]]) -> None:
        """Until cancelled: each message published on ``channel`` (its ``data``) handed to
        ``handle``; resubscribed every :data:`RETRY_S` while Redis is down (quietly: the
        flights' sync reports it)."""
        while True:
            still_running()
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for msg in pubsub.listen():
                    await handle(msg.get("data"))
            except FAILURES:
                still_running()
            finally:
                with contextlib.suppress(*FAILURES):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_S)

    async def close(self) -> None:
        with contextlib.suppress(*FAILURES):
            await self.client.aclose()
