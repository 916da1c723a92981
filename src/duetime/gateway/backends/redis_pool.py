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

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from duetime.gateway.backends.redis_connection import (
    FAILURES,
    RedisConnection,
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
        except FAILURES as e:
            self.conn.failed("pool_publish", e)

    async def follow(self, on_config: OnConfig) -> None:
        """Until cancelled: each config another replica publishes, handed to ``on_config``."""
        async def notice(by: object) -> None:
            if by == self.replica:
                return
            raw = await self.conn.client.get(self.conn.key("pool"))
            try:
                body = json.loads(raw) if raw is not None else {}
            except ValueError:  # (not ours: leave it)
                return
            if body.get("by") != self.replica and isinstance(body.get("text"), str):
                await on_config(body["text"], str(body.get("by")))

        await self.conn.subscribe(self.conn.key("pool-notices"), notice)
