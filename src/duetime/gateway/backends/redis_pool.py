"""The pool config the gateway replicas agree on, shared through Redis: a replica that applies
a new config (its file changed, or SIGHUP) writes the text under ``{prefix}:pool`` and
publishes a notice on ``{prefix}:pool-notices``; the others read it and apply it as if their
own file had changed (:mod:`duetime.service.config_watch`). So every replica's membership
follows the first replica to see a change — a ConfigMap volume reaches each pod up to a
minute apart — and a replica's refusal (a config it cannot apply) is its own log line.

Only changes are shared: at start a replica serves its own file, which is the pool's config
as its operator deployed it (the store's copy may be older). DNS groups are not shared: every
replica asks the same DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from duetime.gateway.backends.redis_connection import (
    FAILURES,
    RETRY_S,
    RedisConnection,
    still_running,
)

log = logging.getLogger("duetime.gateway")

OnConfig = Callable[[str, str], Awaitable[None]]  # (the config's text, the replica that sent it)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class SharedPoolConfig:
    """This replica's side of the shared pool config (``replica``: its id)."""

    def __init__(self, conn: RedisConnection, replica: str) -> None:
        self.conn = conn
        self.replica = replica
        self.sent: str | None = None  # the digest of the last text this replica published

    async def publish(self, text: str) -> None:
        """This replica applied ``text``: the others follow (best effort: Redis down, they
        keep theirs, and their own files still change)."""
        body = json.dumps({"text": text, "digest": digest(text), "by": self.replica,
                           "t": time.time()})
        try:
            pipe = self.conn.client.pipeline(transaction=False)
            pipe.set(self.conn.key("pool"), body)
            pipe.publish(self.conn.key("pool-notices"), self.replica)
            await pipe.execute()
            self.sent = digest(text)
        except FAILURES as e:
            self.conn.failed("pool_publish", e)

    async def follow(self, on_config: OnConfig) -> None:
        """Until cancelled: each config another replica publishes, handed to ``on_config``."""
        channel = self.conn.key("pool-notices")
        while True:
            still_running()
            pubsub = self.conn.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for msg in pubsub.listen():
                    if msg.get("data") == self.replica:
                        continue
                    raw = await self.conn.client.get(self.conn.key("pool"))
                    if raw is None:
                        continue
                    body = json.loads(raw)
                    if body.get("by") != self.replica and isinstance(body.get("text"), str):
                        await on_config(body["text"], str(body.get("by")))
            except FAILURES:  # (the flights' sync reports Redis down; this retries quietly)
                still_running()
            finally:
                with contextlib.suppress(*FAILURES):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_S)
