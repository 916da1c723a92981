"""Per-key rate limits shared by gateway replicas: the token buckets of
:mod:`duetime.gateway.intake.ratelimit` kept in Redis.

One hash per bucket (``{prefix}:limit:{bucket}``: units left and when they were counted), read,
refilled and taken by one Lua script, so a draw is atomic across replicas and every replica
reads the same clock (Redis's ``TIME``). A key's limit then holds for the whole deployment, not
per replica. The script takes all draws or none, as :class:`MemoryLimitStore` does; output
tokens are charged in the background (the request has ended; nobody waits on them).

Redis down or slower than ``timeout_s`` never fails a request: the draw goes to this
replica's own buckets (per-replica limits, as without a store), the failure is logged once and
counted (``duetime_store_errors_total{op="limits"}``), and Redis is tried again once the
flight sync (:mod:`duetime.gateway.backends.redis_flights`) finds it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from duetime.gateway.backends.redis_connection import FAILURES, RedisConnection
from duetime.gateway.intake.ratelimit import Draw, Level, MemoryLimitStore, levels

# KEYS: the buckets; ARGV[1]: 1 to charge (take whatever the level), 0 to acquire (all or
# none); then per bucket its per-minute limit and the draw's cost. Returns the outcome (1/0)
# and each bucket's units before the draw, as strings (Lua numbers become integers in a reply).
TOKEN_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local charge = ARGV[1] == '1'
local units, ok = {}, true
for i = 1, #KEYS do
  local per, cost = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local v = redis.call('HMGET', KEYS[i], 'u', 't')
  local u = tonumber(v[1])
  if u == nil then
    u = per
  else
    u = math.min(per, u + math.max(0, now - tonumber(v[2])) * per / 60)
  end
  units[i] = u
  if u < cost then ok = false end
end
local out = {(ok or charge) and 1 or 0}
for i = 1, #KEYS do
  local per, cost = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if ok or charge then
    local left = units[i] - cost
    redis.call('HSET', KEYS[i], 'u', string.format('%.17g', left),
               't', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[i], math.ceil(((per - left) * 60 / per + 1) * 1000))
  end
  out[i + 1] = string.format('%.17g', units[i])
end
return out
"""


class RedisLimitStore:
    """The buckets in Redis, this replica's own while Redis is away."""

    def __init__(self, conn: RedisConnection, *, timeout_s: float = 0.05) -> None:
        self.conn = conn
        self.timeout_s = timeout_s
        self.fallback = MemoryLimitStore()
        self._script = conn.client.register_script(TOKEN_BUCKET)
        self._charges: list[Draw] = []
        self._flushing: asyncio.Task[None] | None = None

    async def _run(self, draws: Sequence[Draw], charge: bool) -> list[str]:
        keys = [self.conn.key("limit", d.bucket) for d in draws]
        args: list[str | int | float] = ["1" if charge else "0"]
        for d in draws:
            args += [d.per_minute, d.cost]
        async with asyncio.timeout(self.timeout_s):
            return await self._script(keys=keys, args=args)

    async def acquire(self, draws: Sequence[Draw], now: float) -> tuple[bool, list[Level]]:
        if self.conn.up is False:  # (the sync retries Redis; until then, this replica's own)
            return self.fallback.take(draws, now)
        try:
            res = await self._run(draws, charge=False)
        except FAILURES as e:
            self.conn.failed("limits", e)
            return self.fallback.take(draws, now)
        ok = int(res[0]) == 1
        return ok, levels(draws, [float(u) for u in res[1:]], ok)

    def charge(self, draw: Draw, now: float) -> None:
        if self.conn.up is False:
            self.fallback.charge(draw, now)
            return
        self._charges.append(draw)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush(now))

    @property
    def pending(self) -> int:
        """Charges not yet taken in Redis."""
        busy = self._flushing is not None and not self._flushing.done()
        return len(self._charges) + busy

    async def _flush(self, now: float) -> None:
        while self._charges:
            draw = self._charges.pop(0)
            try:
                await self._run([draw], charge=True)
            except FAILURES as e:
                self.conn.failed("limits", e)
                self.fallback.charge(draw, now)
