"""The in-flight ledger shared by gateway replicas through Redis.

Each replica forecasts from a shadow replica of every instance, fed by the requests it
dispatched. Behind a load balancer, N replicas each see about 1/N of every instance's queue and
under-count the rest: the coordination problem the SFS paper names and leaves open. The peers
chose differently (llm-d: one active endpoint picker; Dynamo: NATS; SGLang's router: CRDT
gossip; AIBrix and LiteLLM: Redis keys with TTLs); duetime shares through Redis.

:class:`RedisFlightStore` is a :class:`~duetime.gateway.state.flight.FlightStore` and the
instances' :class:`~duetime.gateway.state.peers.PeerFeed`. The hot path never waits on Redis:
this replica's flights live in its memory (a
:class:`~duetime.gateway.backends.memory.MemoryStore`) and their changes go to an outbox,
which a background task syncs in one round trip:

- **write** (one Lua script, :data:`WRITE`, atomic): the changed flights into the replica's
  hash ``{prefix}:flights:{replica}`` (a field per flight, ``{instance}\x1f{flight id}`` →
  ``[prompt tokens, predicted output, dispatched, first token, tokens, block keys]``,
  wall-clock times), the change itself appended to its stream ``{prefix}:changes:{replica}``
  with its new version, a notice published on ``{prefix}:notices``; every key's TTL renewed
  (``ttl_s``: a dead replica's flights expire), its heartbeat stamped in the sorted set
  ``{prefix}:replicas``, replicas silent for ``ttl_s`` dropped; the live replicas returned;
- **read**: the peers' changes since the last read (one ``XREAD`` over their streams).

A peer met for the first time, or whose versions jump (its stream is capped at ~1,000 changes),
is read whole (its hash, version and last change id in one ``MULTI``) in a second round trip.

A sync runs ``BATCH_S`` after something happens — a dispatch, first token or end here, or a
peer's notice (Redis pub/sub) — so that one sync carries a burst and the request that woke it
gets its bytes out first; and at least every ``sync_s`` (token counts, the heartbeat). Why
push, and why deltas: at a TTFT of 50–150 ms a request another replica dispatched 20 ms ago
matters, and with a 20 ms poll the shared store did no better than independent replicas;
reading whole hashes cost ~7 ms of CPU at 1,000 flights (both measured with
``benchmarks/replicas_live.py`` and docs/gateway.md's numbers).

The other replicas' flights are mirrored as :class:`Flight` objects (ids ``{replica}/{id}``)
and each change is handed to the instance's :class:`~duetime.gateway.state.peers.PeerListener`
(the gateway's :class:`~duetime.gateway.state.instance.InstanceState`), which folds it into its
shadow replica: a new flight joins the queue, a first token marks its prefill done, a vanished
one leaves.
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
import itertools
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import numpy as np
from redis.exceptions import NoScriptError

from duetime.gateway.backends.memory import MemoryStore
from duetime.gateway.backends.redis_connection import (
    FAILURES,
    RETRY_S,
    RedisConnection,
    still_running,
)
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.peers import PeerListener

log = logging.getLogger("duetime.gateway")

BATCH_S = 0.002  # how long a woken sync waits for more changes before it runs
SEP = "\x1f"   # between an instance's name and a flight's id in a hash field


# One replica's write, atomic: its changed flights into its hash (all of them, after a DEL, when
# it writes everything), the change itself appended to its stream of changes with its new
# version and a notice published (when anything changed), every key's TTL renewed, its
# heartbeat stamped, replicas silent for the TTL dropped; returns the live replicas.
# KEYS: hash, version, changes (stream), replicas (sorted set). ARGV: replica, wall-clock
# time, TTL (ms), notices channel, the change as JSON ("full": all rewritten; "": nothing
# changed), how many fields are set, then field/value pairs, then the fields deleted.
WRITE = """
local hash, ver, changes, zset = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttl, delta, nset = tonumber(ARGV[3]), ARGV[5], tonumber(ARGV[6])
if delta == 'full' then redis.call('DEL', hash) end
local i = 7
while nset > 0 do
  local n = math.min(nset, 500)
  redis.call('HSET', hash, unpack(ARGV, i, i + 2 * n - 1))
  i = i + 2 * n
  nset = nset - n
end
while i <= #ARGV do
  local j = math.min(#ARGV, i + 999)
  redis.call('HDEL', hash, unpack(ARGV, i, j))
  i = j + 1
end
if delta ~= '' then
  local v = redis.call('INCR', ver)
  redis.call('XADD', changes, 'MAXLEN', '~', 1000, '*', 'v', v, 'd', delta)
  redis.call('PUBLISH', ARGV[4], ARGV[1])
end
redis.call('PEXPIRE', hash, ttl)
redis.call('PEXPIRE', ver, ttl)
redis.call('PEXPIRE', changes, ttl)
local wall = tonumber(ARGV[2])
redis.call('ZADD', zset, ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', zset, '-inf', wall - ttl / 1000)
return redis.call('ZRANGE', zset, 0, -1)
"""


def _pack(f: Flight, to_wall: float) -> str:
    """A flight as the other replicas read it; its LoRA adapter only when it has one (so a
    base-model flight is what replicas before adapters read too)."""
    hashes = (None if f.hashes is None else
              base64.b64encode(np.asarray(f.hashes, dtype=np.int64).tobytes()).decode())
    fields = [f.prompt_tokens, f.predicted, round(f.dispatched + to_wall, 6),
              None if f.first_token is None else round(f.first_token + to_wall, 6),
              f.tokens, hashes]
    if f.lora:
        fields.append(f.lora)
    return json.dumps(fields, separators=(",", ":"))


def _unpack(fid: str, raw: str, to_mono: float) -> Flight:
    prompt, predicted, dispatched, first, tokens, hashes, *rest = json.loads(raw)
    keys = (None if hashes is None else
            np.frombuffer(base64.b64decode(hashes), dtype=np.int64).tolist())
    f = Flight(fid, int(prompt), int(predicted), float(dispatched) - to_mono, None, keys,
               int(rest[0]) if rest else 0)
    f.first_token = None if first is None else float(first) - to_mono
    f.tokens = int(tokens)
    return f


class SessionBindings(MutableMapping[str, str]):
    """Session-affinity bindings (session → instance) shared by the replicas: a binding made
    here goes out with the next sync; the others' come in with their changes. Only bindings
    made while a replica runs reach it (none is read back at its start). Bounded: the least
    recently bound are forgotten first."""

    def __init__(self, store: RedisFlightStore, limit: int = 100_000) -> None:
        self.store = store
        self.limit = limit
        self.local: OrderedDict[str, str] = OrderedDict()

    def put(self, session: str, instance: str) -> None:
        """A binding (made here or by another replica)."""
        self.local[session] = instance
        self.local.move_to_end(session)
        while len(self.local) > self.limit:
            self.local.popitem(last=False)

    def __getitem__(self, session: str) -> str:
        return self.local[session]

    def __setitem__(self, session: str, instance: str) -> None:
        if self.local.get(session) != instance:
            self.store.bind(session, instance)
        self.put(session, instance)

    def __delitem__(self, session: str) -> None:
        del self.local[session]

    def __iter__(self) -> Iterator[str]:
        return iter(self.local)

    def __len__(self) -> int:
        return len(self.local)


class RedisFlightStore:
    """This replica's flights in memory, shared through Redis; the other replicas' mirrored.
    ``replica``: this replica's id (random unless given)."""

    def __init__(self, conn: RedisConnection, *, sync_s: float = 0.05, ttl_s: float = 5.0,
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
        # peer -> (id of its last change read, its version then)
        self._cursors: dict[str, tuple[str, int]] = {}
        self._resync: set[str] = set()  # peers to read whole at the next sync
        self._sha: str | None = None  # the write script's, once loaded
        self._beat = -math.inf  # when this replica last wrote (its heartbeat)
        self._listeners: dict[str, PeerListener] = {}
        self._firsts: set[str] = set()  # own flights whose first token went to the outbox
        self._ejected: set[str] = set()  # instances this replica holds ejected
        self._eject_out: dict[str, bool] = {}  # ejections and readmissions not yet written
        self._bind_out: dict[str, str] = {}  # session bindings not yet written
        self.bindings = SessionBindings(self)
        self._wake = asyncio.Event()  # (created unbound: it binds to the loop at first wait)
        self._tasks: list[asyncio.Task[None]] = []
        self.syncs = 0  # completed syncs (tests wait on it)

    # -- FlightStore ------------------------------------------------------------------------------

    def add(self, instance: str, flight: Flight) -> None:
        self.local.add(instance, flight)
        self._outbox[(instance, flight.id)] = flight
        self._wake.set()

    def update(self, instance: str, flight: Flight) -> None:
        self._outbox[(instance, flight.id)] = flight
        if flight.first_token is not None and flight.id not in self._firsts:
            self._firsts.add(flight.id)
            self._wake.set()  # (a first token goes out at once; token counts at the period)

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        f = self.local.remove(instance, flight_id, t)
        if f is not None:
            self._outbox[(instance, flight_id)] = None
            self._firsts.discard(flight_id)
            self._wake.set()
        return f

    def flights(self, instance: str) -> Mapping[str, Flight]:
        return self.local.flights(instance)

    def ended(self, instance: str) -> Mapping[str, float]:
        return self.local.ended(instance)

    # -- the other replicas -----------------------------------------------------------------------

    def remote(self, instance: str) -> Mapping[str, Flight]:
        """The other replicas' flights on ``instance`` as last synced."""
        return self._remote.get(instance, {})

    def listen(self, instance: str, listener: PeerListener) -> None:
        self._listeners[instance] = listener

    def eject(self, instance: str, ejected: bool) -> None:
        """This replica ejected (or readmitted) ``instance``: the others follow."""
        (self._ejected.add if ejected else self._ejected.discard)(instance)
        self._eject_out[instance] = ejected
        self._wake.set()

    def bind(self, session: str, instance: str) -> None:
        """A session bound here (:class:`SessionBindings`): it goes out with the next sync."""
        self._bind_out[session] = instance
        self._wake.set()

    def peers(self) -> list[str]:
        """The other live replicas, as last synced."""
        return sorted(self._fields)

    # -- the sync ---------------------------------------------------------------------------------

    async def start(self, metrics: GatewayMetrics | None = None) -> None:
        if metrics is not None:
            self.conn.metrics = metrics
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(), name="duetime-store-sync"),
                           asyncio.create_task(self._notices(), name="duetime-store-notices")]

    async def close(self) -> None:
        """Stop syncing; tell the peers this replica's flights are gone (best effort)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self.conn.up and self._sha is not None:
            # (a last change: everything rewritten as nothing; peers read the empty hash and
            # end every flight of this replica at once, not at the TTL)
            c = self.conn
            with contextlib.suppress(*FAILURES):
                pipe = c.client.pipeline(transaction=False)
                pipe.evalsha(self._sha, 4, c.key("flights", self.replica),
                             c.key("version", self.replica), c.key("changes", self.replica),
                             c.key("replicas"), self.replica, f"{time.time():.6f}",
                             max(1, int(self.ttl_s * 1000)), c.key("notices"), "full", 0)
                pipe.zrem(c.key("replicas"), self.replica)
                async with asyncio.timeout(0.5):
                    await pipe.execute()
        await self.conn.close()

    async def _run(self) -> None:
        """Sync ``BATCH_S`` after something happened (a dispatch, first token or end here, a
        peer's notice), and at least every ``sync_s`` (token counts, the heartbeat)."""
        m = self.conn.metrics
        while True:
            still_running()
            t0 = time.perf_counter()
            self._wake.clear()
            try:
                await self.sync()
            except FAILURES as e:
                still_running()
                self.conn.failed("sync", e)
                self._forget_peers()
                self._full = True
                await asyncio.sleep(RETRY_S)
                continue
            dt = time.perf_counter() - t0
            if m is not None:
                m.store_sync.observe(dt)
            # (asyncio.timeout, not wait_for: on 3.11 a cancel that meets wait_for's timeout
            # becomes a TimeoutError, and the task would sync on after close() cancelled it)
            try:
                async with asyncio.timeout(max(0.0, self.sync_s - (time.perf_counter() - t0))):
                    await self._wake.wait()
            except TimeoutError:
                continue
            # woken: let the request that woke the sync get its bytes out first, and gather
            # what comes with it (a burst's dispatches, a first token) into one sync
            await asyncio.sleep(BATCH_S)

    async def _notices(self) -> None:
        """Peers publish a notice with each write: wake the sync to read them at once."""
        async def notice(peer: object) -> None:
            if peer != self.replica:
                if isinstance(peer, str) and peer not in self._cursors:
                    self._resync.add(peer)  # (a new replica: read it whole)
                self._wake.set()

        await self.conn.subscribe(self.conn.key("notices"), notice)

    async def sync(self) -> None:
        """One sync: write this replica's changes (when it has any, or its heartbeat is due)
        and read the peers' new changes, in one round trip; a second one only for peers to
        read whole (new ones, or ones whose changes were trimmed before this replica read
        them)."""
        c = self.conn
        wall, mono = time.time(), time.monotonic()
        to_wall = wall - mono
        full = self._full
        outbox: Mapping[tuple[str, str], Flight | None] = (
            {(inst, fid): f for inst in self.local.instances()
             for fid, f in self.local.flights(inst).items()} if full else self._outbox)
        binds, self._bind_out = self._bind_out, {}
        write = full or bool(outbox) or bool(binds) or mono - self._beat >= self.sync_s
        ejections = dict(self._eject_out)
        if write or full:  # (the heartbeat renews this replica's ejections' TTL)
            ejections.update({i: True for i in self._ejected})
        self._outbox, self._full, self._eject_out = {}, False, {}
        try:
            if self._sha is None:
                self._sha = await c.client.script_load(WRITE)
            pipe = c.client.pipeline(transaction=False)
            if write:
                self._queue_write(pipe, outbox, binds, full, wall, to_wall)
            watched, cursors = self._queue_reads(pipe, ejections)
            res = await pipe.execute()
        except NoScriptError:  # (Redis restarted: load the script again, write everything)
            self._sha = None
            self._full = True
            self._bind_out = {**binds, **self._bind_out}
            return
        except BaseException:
            self._full = True  # (whatever was written, the next sync writes everything)
            self._bind_out = {**binds, **self._bind_out}
            for inst, on in ejections.items():
                self._eject_out.setdefault(inst, on)
            raise
        now = time.monotonic()
        if watched:
            self._take_ejections(watched, res[-2] if cursors else res[-1])
        if write:
            self._beat = mono
            self._take_live(res[0], now, to_wall)
        for stream, entries in (res[-1] if cursors else []):
            self._read(stream.rsplit(":", 1)[1], entries, now, to_wall)
        if self._resync:
            await self._read_whole(sorted(self._resync), now, to_wall)
        m = c.metrics
        if m is not None:
            for inst, fl in self._remote.items():
                m.store_remote.labels(inst).set(len(fl))
        self.syncs += 1
        c.ok()

    def _queue_write(self, pipe: Any, outbox: Mapping[tuple[str, str], Flight | None],
                     binds: dict[str, str], full: bool, wall: float, to_wall: float) -> None:
        """This replica's write (:data:`WRITE`): its changed flights and bindings, or all of
        its flights when ``full``."""
        c = self.conn
        sets = {f"{inst}{SEP}{fid}": _pack(f, to_wall)
                for (inst, fid), f in outbox.items() if f is not None}
        dels = [f"{inst}{SEP}{fid}" for (inst, fid), f in outbox.items() if f is None]
        change: dict[str, Any] = {"s": sets, "d": dels}
        if binds and full:  # (a whole rewrite carries no change: they go next time)
            self._bind_out = {**binds, **self._bind_out}
        elif binds:
            change["b"] = binds
        delta = ("full" if full else json.dumps(change, separators=(",", ":"))
                 if sets or dels or binds else "")
        pipe.evalsha(self._sha, 4, c.key("flights", self.replica),
                     c.key("version", self.replica), c.key("changes", self.replica),
                     c.key("replicas"), self.replica, f"{wall:.6f}",
                     max(1, int(self.ttl_s * 1000)), c.key("notices"), delta,
                     len(sets), *itertools.chain.from_iterable(sets.items()), *dels)

    def _queue_reads(self, pipe: Any, ejections: dict[str, bool]
                     ) -> tuple[list[str], dict[str, str]]:
        """This replica's ejections written, and the reads of the others' (the instances
        watched) and of the peers' new changes (from their cursors)."""
        c = self.conn
        ttl_ms = max(1, int(self.ttl_s * 1000))
        for inst, on in ejections.items():
            if on:
                pipe.set(c.key("ejected", inst), self.replica, px=ttl_ms)
            else:
                pipe.delete(c.key("ejected", inst))
        watched = list(self._listeners)
        if watched:
            pipe.mget([c.key("ejected", i) for i in watched])
        cursors = {c.key("changes", r): cur[0] for r, cur in self._cursors.items()
                   if r not in self._resync}
        if cursors:
            pipe.xread(cursors)
        return watched, cursors

    def _take_ejections(self, watched: list[str], held: list[str | None]) -> None:
        """Who holds each watched instance ejected: another replica (eject it here too), or
        nobody (readmit it, unless this replica ejected it)."""
        for inst, by in zip(watched, held, strict=True):
            lst = self._listeners[inst]
            if by is not None and by != self.replica:
                lst.on_peer_eject(by)
            elif by is None and inst not in self._ejected:
                lst.on_peer_readmit()

    def _take_live(self, replicas: list[str], now: float, to_wall: float) -> None:
        """The live replicas, as the write returned them: the flights of those gone end, the
        new ones are read whole."""
        live = {r for r in replicas if r != self.replica}
        for r in [r for r in self._fields if r not in live]:
            self._apply(r, {}, now, to_wall)
            del self._fields[r]
            self._cursors.pop(r, None)
        self._resync |= {r for r in live if r not in self._cursors}

    def _read(self, peer: str, entries: list[tuple[str, dict[str, str]]], now: float,
              to_wall: float) -> None:
        """A peer's changes, in order; a gap in its versions (changes trimmed before they were
        read) or a whole rewrite sends it to be read whole."""
        cur = self._cursors.get(peer)
        if cur is None:
            return
        sid, version = cur
        fields = self._fields.setdefault(peer, {})
        for eid, entry in entries:
            v = int(entry.get("v", -1))
            delta = entry.get("d", "")
            if v != version + 1 or delta == "full":
                self._resync.add(peer)
                return
            try:
                change = json.loads(delta)
            except ValueError:
                self._resync.add(peer)
                return
            for key in change.get("d", ()):
                fields.pop(key, None)
                self._ended(peer, key, now)
            for key, raw in change.get("s", {}).items():
                fields[key] = raw
                self._changed(peer, key, raw, now, to_wall)
            for session, inst in change.get("b", {}).items():
                self.bindings.put(session, inst)
            sid, version = eid, v
            self._cursors[peer] = (sid, version)

    async def _read_whole(self, peers: list[str], now: float, to_wall: float) -> None:
        """Read peers whole: their flights, their version and where their changes stand, each
        atomically (MULTI), then the changes from there on."""
        c = self.conn
        pipe = c.client.pipeline(transaction=True)
        for r in peers:
            pipe.hgetall(c.key("flights", r))
            pipe.get(c.key("version", r))
            pipe.xrevrange(c.key("changes", r), count=1)
        res = await pipe.execute()
        for i, r in enumerate(peers):
            fields, version, last = res[3 * i], res[3 * i + 1], res[3 * i + 2]
            self._apply(r, fields, now, to_wall)
            self._cursors[r] = (last[0][0] if last else "0-0", int(version or 0))
            self._resync.discard(r)

    def _apply(self, peer: str, fields: dict[str, str], now: float, to_wall: float) -> None:
        """The peer's flights are now ``fields``: hand every change to the listeners."""
        old = self._fields.get(peer, {})
        self._fields[peer] = fields
        for key in old.keys() - fields.keys():
            self._ended(peer, key, now)
        for key, raw in fields.items():
            if old.get(key) != raw:
                self._changed(peer, key, raw, now, to_wall)

    def _ended(self, peer: str, key: str, now: float) -> None:
        inst, _, fid = key.partition(SEP)
        f = self._remote.get(inst, {}).pop(f"{peer}/{fid}", None)
        if f is not None and (lst := self._listeners.get(inst)) is not None:
            lst.on_peer_end(f, now)

    def _changed(self, peer: str, key: str, raw: str, now: float, to_wall: float) -> None:
        inst, _, fid = key.partition(SEP)
        mid = f"{peer}/{fid}"
        try:
            new = _unpack(mid, raw, to_wall)
        except (ValueError, TypeError) as e:  # (a peer of another version, or garbage)
            log.debug("unreadable flight in the store", extra={"fields": {
                "peer": peer, "field": key[:100], "error": str(e)[:100]}})
            return
        mirror = self._remote.setdefault(inst, {})
        lst = self._listeners.get(inst)
        f = mirror.get(mid)
        if f is None:
            mirror[mid] = new
            m = self.conn.metrics
            if m is not None:
                m.store_staleness.observe(max(0.0, now - new.dispatched))
            if lst is not None:
                lst.on_peer_dispatch(new, now)
                if new.first_token is not None:
                    lst.on_peer_first_token(new, now)
            return
        first = f.first_token is None and new.first_token is not None
        f.first_token = new.first_token
        f.tokens = new.tokens
        if first and lst is not None:
            lst.on_peer_first_token(f, now)

    def _forget_peers(self) -> None:
        """Redis is away: drop the mirror, so that this replica routes on its own flights."""
        now = time.monotonic()
        for r in list(self._fields):
            self._apply(r, {}, now, 0.0)
        self._fields.clear()
        self._cursors.clear()
        self._resync.clear()
        for lst in self._listeners.values():  # (and the others' ejections)
            lst.on_peer_readmit()

    def describe(self) -> dict[str, Any]:
        return {"kind": "redis", "replica": self.replica, "up": self.conn.up,
                "peers": self.peers(), "sync_s": self.sync_s, "ttl_s": self.ttl_s}

