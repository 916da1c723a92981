"""The in-flight ledger shared by gateway replicas through Redis.

Each replica forecasts from a shadow replica of every instance, fed by the requests it
dispatched. Behind a load balancer, N replicas each see about 1/N of every instance's queue and
under-count the rest: the coordination problem the SFS paper names and leaves open. The peers
chose differently (llm-d: one active endpoint picker; Dynamo: NATS; SGLang's router: CRDT
gossip; AIBrix and LiteLLM: Redis keys with TTLs); duetime shares through Redis.

:class:`RedisFlightStore` is a :class:`~duetime.gateway.inflight.FlightStore`. The hot path never
waits on Redis: this replica's flights live in its memory (a
:class:`~duetime.gateway.inflight.MemoryStore`) and their changes go to an outbox; a background
task syncs every ``sync_s`` in two pipelined round trips:

1. write the outbox (one hash per replica, ``{prefix}:flights:{replica}``, a field per flight,
   ``{instance}\\x1f{flight id}`` → ``[prompt tokens, predicted output, dispatched, first
   token, tokens, block keys]`` with wall-clock times), bump the replica's version, renew both
   keys' TTL (``ttl_s``: a dead replica's flights expire), stamp the replica in the
   ``{prefix}:replicas`` sorted set, drop replicas silent for ``ttl_s``, read the live ones
   and the known ones' versions;
2. read the flights of each replica whose version moved (``HGETALL``).

The other replicas' flights are mirrored as :class:`Flight` objects (ids ``{replica}/{id}``)
and each change is handed to the instance's :class:`RemoteListener` (the gateway's
:class:`~duetime.gateway.instance.InstanceState`), which folds it into its shadow replica: a
new flight joins the queue, a first token marks its prefill done, a vanished one leaves.
Token counts are updated on the mirrored objects and reach the replica at its next refresh,
like this replica's own.

Redis down or slow (a call over ``timeout_s``) never fails a request: the sync logs once,
sets ``duetime_store_up`` to 0, drops the mirror (the replica routes on its own flights) and
retries every ``RETRY_S``; when Redis answers again this replica's whole state is written
anew and the peers' is read back. Times cross processes as wall-clock (``time.time``), so
hosts need synchronised clocks (NTP), as TTL'd state in Redis always does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from duetime.gateway.inflight import Flight, MemoryStore
from duetime.gateway.metrics import GatewayMetrics

log = logging.getLogger("duetime.gateway")

RETRY_S = 0.5  # how often a replica tries Redis again while it is down
SEP = "\x1f"   # between an instance's name and a flight's id in a hash field
FAILURES = (RedisError, OSError, asyncio.TimeoutError)


class RemoteListener(Protocol):
    """What an instance does with the other replicas' flights (``now``: monotonic)."""

    def remote_dispatch(self, flight: Flight, now: float) -> None: ...

    def remote_first_token(self, flight: Flight, now: float) -> None: ...

    def remote_end(self, flight: Flight, now: float) -> None: ...


def _pack(f: Flight, to_wall: float) -> str:
    hashes = (None if f.hashes is None else
              base64.b64encode(np.asarray(f.hashes, dtype=np.int64).tobytes()).decode())
    return json.dumps([f.prompt_tokens, f.predicted, round(f.dispatched + to_wall, 6),
                       None if f.first_token is None else round(f.first_token + to_wall, 6),
                       f.tokens, hashes], separators=(",", ":"))


def _unpack(fid: str, raw: str, to_mono: float) -> Flight:
    prompt, predicted, dispatched, first, tokens, hashes = json.loads(raw)
    keys = (None if hashes is None else
            np.frombuffer(base64.b64decode(hashes), dtype=np.int64).tolist())
    f = Flight(fid, int(prompt), int(predicted), float(dispatched) - to_mono, None, keys)
    f.first_token = None if first is None else float(first) - to_mono
    f.tokens = int(tokens)
    return f


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

    async def close(self) -> None:
        with contextlib.suppress(*FAILURES):
            await self.client.aclose()


class RedisFlightStore:
    """This replica's flights in memory, shared through Redis; the other replicas' mirrored.
    ``replica``: this replica's id (random unless given)."""

    def __init__(self, conn: RedisConnection, *, sync_s: float = 0.02, ttl_s: float = 5.0,
                 replica: str | None = None) -> None:
        self.conn = conn
        self.replica = replica or uuid.uuid4().hex[:12]
        self.sync_s = sync_s
        self.ttl_s = ttl_s
        self.local = MemoryStore()
        self._outbox: dict[tuple[str, str], Flight | None] = {}
        self._full = True  # write the whole local state at the next sync
        self._remote: dict[str, dict[str, Flight]] = {}  # instance -> mirrored id -> flight
        self._fields: dict[str, dict[str, str]] = {}  # peer -> its hash as last read
        self._versions: dict[str, str | None] = {}  # peer -> its version as last read
        self._listeners: dict[str, RemoteListener] = {}
        self._task: asyncio.Task[None] | None = None
        self.syncs = 0  # completed syncs (tests wait on it)

    # -- FlightStore ------------------------------------------------------------------------------

    def add(self, instance: str, flight: Flight) -> None:
        self.local.add(instance, flight)
        self._outbox[(instance, flight.id)] = flight

    def update(self, instance: str, flight: Flight) -> None:
        self._outbox[(instance, flight.id)] = flight

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        f = self.local.remove(instance, flight_id, t)
        if f is not None:
            self._outbox[(instance, flight_id)] = None
        return f

    def flights(self, instance: str) -> Mapping[str, Flight]:
        return self.local.flights(instance)

    def done(self, instance: str) -> Mapping[str, float]:
        return self.local.done(instance)

    # -- the other replicas -----------------------------------------------------------------------

    def remote(self, instance: str) -> Mapping[str, Flight]:
        """The other replicas' flights on ``instance`` as last synced."""
        return self._remote.get(instance, {})

    def listen(self, instance: str, listener: RemoteListener) -> None:
        self._listeners[instance] = listener

    def peers(self) -> list[str]:
        """The other live replicas, as last synced."""
        return sorted(self._fields)

    # -- the sync ---------------------------------------------------------------------------------

    async def start(self, metrics: GatewayMetrics | None = None) -> None:
        if metrics is not None:
            self.conn.metrics = metrics
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="duetime-store-sync")

    async def close(self) -> None:
        """Stop syncing; tell the peers this replica's flights are gone (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.conn.up:
            c = self.conn
            with contextlib.suppress(*FAILURES):
                pipe = c.client.pipeline(transaction=False)
                pipe.delete(c.key("flights", self.replica), c.key("version", self.replica))
                pipe.zrem(c.key("replicas"), self.replica)
                await asyncio.wait_for(pipe.execute(), 0.5)
        await self.conn.close()

    async def _run(self) -> None:
        m = self.conn.metrics
        while True:
            t0 = time.perf_counter()
            try:
                await self.sync()
            except FAILURES as e:
                self.conn.failed("sync", e)
                self._forget_peers()
                self._full = True
                await asyncio.sleep(RETRY_S)
                continue
            dt = time.perf_counter() - t0
            if m is not None:
                m.store_sync.observe(dt)
            await asyncio.sleep(max(0.0, self.sync_s - dt))

    async def sync(self) -> None:
        """One sync: write this replica's changes, read the peers' (two round trips)."""
        c = self.conn
        wall, mono = time.time(), time.monotonic()
        to_wall = wall - mono
        own, version = c.key("flights", self.replica), c.key("version", self.replica)
        if self._full:
            outbox: Mapping[tuple[str, str], Flight | None] = {
                (inst, fid): f for inst in self.local.instances()
                for fid, f in self.local.flights(inst).items()}
        else:
            outbox = self._outbox
        self._outbox = {}
        full, self._full = self._full, False
        try:
            sets = {f"{inst}{SEP}{fid}": _pack(f, to_wall)
                    for (inst, fid), f in outbox.items() if f is not None}
            dels = [f"{inst}{SEP}{fid}" for (inst, fid), f in outbox.items() if f is None]
            pipe = c.client.pipeline(transaction=False)
            if full:
                pipe.delete(own)
            if sets:
                pipe.hset(own, mapping=sets)
            if dels:
                pipe.hdel(own, *dels)
            if full or sets or dels:
                pipe.incr(version)
            ttl_ms = max(1, int(self.ttl_s * 1000))
            pipe.pexpire(own, ttl_ms)
            pipe.pexpire(version, ttl_ms)
            replicas = c.key("replicas")
            pipe.zadd(replicas, {self.replica: wall})
            pipe.zremrangebyscore(replicas, "-inf", wall - self.ttl_s)
            pipe.zrange(replicas, 0, -1)
            known = list(self._versions)
            if known:
                pipe.mget([c.key("version", r) for r in known])
            res = await pipe.execute()
        except BaseException:
            self._full = True  # (whatever was written, the next sync writes everything)
            raise
        live = [r for r in (res[-2] if known else res[-1]) if r != self.replica]
        seen = dict(zip(known, res[-1], strict=True)) if known else {}
        stale = [r for r in live if r not in seen or seen[r] != self._versions.get(r)
                 or seen[r] is None]
        fetched: dict[str, dict[str, str]] = {}
        if stale:
            pipe = c.client.pipeline(transaction=False)
            for r in stale:
                pipe.hgetall(c.key("flights", r))
                pipe.get(c.key("version", r))
            res = await pipe.execute()
            for i, r in enumerate(stale):
                fetched[r] = res[2 * i]
                self._versions[r] = res[2 * i + 1]
        now = time.monotonic()
        for r in [r for r in self._fields if r not in live]:
            self._apply(r, {}, now, wall - now)
            del self._fields[r]
            self._versions.pop(r, None)
        for r, fields in fetched.items():
            self._apply(r, fields, now, wall - mono)
        m = c.metrics
        if m is not None:
            for inst, fl in self._remote.items():
                m.store_remote.labels(inst).set(len(fl))
        self.syncs += 1
        c.ok()

    def _apply(self, peer: str, fields: dict[str, str], now: float, to_wall: float) -> None:
        """The peer's flights are now ``fields``: hand every change to the listeners."""
        old = self._fields.get(peer, {})
        self._fields[peer] = fields
        m = self.conn.metrics
        wall_now = now + to_wall
        for key in old.keys() - fields.keys():
            inst, _, fid = key.partition(SEP)
            f = self._remote.get(inst, {}).pop(f"{peer}/{fid}", None)
            if f is not None and (lst := self._listeners.get(inst)) is not None:
                lst.remote_end(f, now)
        for key, raw in fields.items():
            if old.get(key) == raw:
                continue
            inst, _, fid = key.partition(SEP)
            mid = f"{peer}/{fid}"
            try:
                new = _unpack(mid, raw, to_wall)
            except (ValueError, TypeError) as e:  # (a peer of another version, or garbage)
                log.debug("unreadable flight in the store", extra={"fields": {
                    "peer": peer, "field": key[:100], "error": str(e)[:100]}})
                continue
            mirror = self._remote.setdefault(inst, {})
            lst = self._listeners.get(inst)
            f = mirror.get(mid)
            if f is None:
                mirror[mid] = new
                if m is not None:
                    m.store_staleness.observe(max(0.0, wall_now - (new.dispatched + to_wall)))
                if lst is not None:
                    lst.remote_dispatch(new, now)
                f = new
                if new.first_token is not None and lst is not None:
                    lst.remote_first_token(new, now)
                continue
            first = f.first_token is None and new.first_token is not None
            f.first_token = new.first_token
            f.tokens = new.tokens
            if first and lst is not None:
                lst.remote_first_token(f, now)

    def _forget_peers(self) -> None:
        """Redis is away: drop the mirror, so that this replica routes on its own flights."""
        now = time.monotonic()
        for r in list(self._fields):
            self._apply(r, {}, now, 0.0)
        self._fields.clear()
        self._versions.clear()

    def describe(self) -> dict[str, Any]:
        return {"kind": "redis", "replica": self.replica, "up": self.conn.up,
                "peers": self.peers(), "sync_s": self.sync_s, "ttl_s": self.ttl_s}

