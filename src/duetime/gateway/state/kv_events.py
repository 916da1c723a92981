"""vLLM's KV-cache events: the gateway's precise view of each instance's prefix cache.

With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` a vLLM
instance publishes what its block pool does, batch by batch, on a ZMQ PUB socket:

* ``BlockStored``: full blocks entered the prefix cache. ``block_hashes[i]`` is the engine's
  hash of block i, ``token_ids`` holds the tokens of all of them in order, and
  ``parent_block_hash`` is the hash of the block just before the first one (None when the
  first one starts a prompt). The same hash can be stored more than once (duplicate blocks);
  each copy is removed on its own.
* ``BlockRemoved``: blocks left the cache (evicted), one removal per stored copy.
* ``AllBlocksCleared``: the prefix cache was reset.

Wire format: a multipart message ``(topic, seq as 8 bytes big-endian, payload)``; ``seq``
starts at 0 in each publisher process and grows by one per batch. The payload is msgpack
(vLLM encodes it with msgspec) of a batch ``[ts, events, data_parallel_rank?]`` (a map
``{"ts", "events", ...}`` is accepted too). :func:`decode_batch` accepts both event encodings
vLLM has used: a map tagged by ``"type"`` (vLLM 0.32: ``{"type": "BlockStored",
"block_hashes": ..., ...}``, fields at their defaults omitted) and a positional array with the
tag first (vLLM 0.9/0.10: ``["BlockStored", hashes, parent, token_ids, block_size, lora_id,
medium?]``, ``["BlockRemoved", hashes, medium?]``, ``["AllBlocksCleared"]``). Block hashes are
32-byte sha256 digests (the default) or 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``);
both are kept as they come, as opaque keys. Unknown event types are skipped: newer vLLM
versions add some, and what the gateway does not know it cannot mirror anyway.

:class:`CacheMirror` turns engine hashes into the gateway's own block keys
(:func:`duetime.web.prefix_keys.token_block_keys`, chained from the event's parent), so
the gateway can compare a request's prompt blocks with what an instance holds. Blocks whose
key the gateway cannot reproduce (LoRA, extra keys such as a cache salt or multimodal
inputs, another block size, a parent the mirror never saw) are tracked as *unmapped*, so
their descendants are unmapped too; they produce no gateway keys. Blocks on other media (the
CPU offload tiers) are ignored: only GPU blocks serve a prefix hit without a transfer.

:class:`KvEventSubscriber` receives one instance's events. The events are applied to the
gateway's routing state on the asyncio thread (every mutation of that state happens there,
so it needs no locks); a daemon thread owns the ZMQ sockets, decodes each payload (msgpack
decoding of a long prompt's token list is the costly part) and buffers ``(seq, ts, events)``
until the event loop calls :meth:`KvEventSubscriber.drain`. The thread also keeps the
sequence whole:

* a gap (``seq > last + 1``, e.g. the PUB socket dropped messages while the connection was
  down or past its high-water mark) is asked of the replay endpoint (a ROUTER: the thread's
  DEALER sends ``[b"", start seq]`` and reads ``[b"", topic, seq, payload]`` per buffered
  batch until the end marker ``seq == -1``), and the missing batches are delivered in order;
* when there is no replay endpoint, or the replay did not cover the gap (the publisher's
  buffer no longer holds it, or no answer within ``replay_timeout``), the next batch
  delivered starts with a synthetic ``AllBlocksCleared()``: the consumer's map cannot be
  trusted any more, so it starts over from what follows (counted in ``lost_gaps``);
* a ``seq`` not above the last one means the publisher restarted (its seq starts at 0
  again, its cache is empty): the batch also starts with an ``AllBlocksCleared()``
  (counted in ``restarts``). Whatever seq arrives first is the start; it needs no replay;
* a payload that does not decode is counted (``bad_payloads``), logged once, and delivered
  as an ``AllBlocksCleared()`` alone (its events are lost, as in a gap).

Limits: one restart is missed if the new process has published past the last seq seen before
the subscriber hears from it (a new vLLM takes far longer to start than a ZMQ reconnect, so
this needs a long network partition). Blocks stored before the subscription and removed after
it are unknown, so their removal is ignored; a block stored both before and after counts one
copy only, so its key may disappear while a copy remains (an underestimate, never a phantom
block). Hybrid models (several KV-cache groups) store each hash once per group: the mirror
counts those as copies, so a key stays cached while any group holds it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from duetime.web.prefix_keys import token_block_keys

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheChange",
    "CacheMirror",
    "KvEvent",
    "KvEventFormatError",
    "KvEventSubscriber",
    "decode_batch",
]

log = logging.getLogger("duetime.gateway")

BlockHash = bytes | int
MEDIUM_GPU = "GPU"


class KvEventFormatError(ValueError):
    """A payload that is not a KV-event batch of any vLLM version this module knows."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered an instance's prefix cache (see the module doc)."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora: bool = False  # lora_id or lora_name set: the engine's hash depends on the adapter
    extra: bool = False  # an extra_keys entry is set (cache salt, multimodal, embeddings)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left an instance's prefix cache (one removal per stored copy)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset, or the subscriber lost track (a gap, a restart)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


# --- decoding ---------------------------------------------------------------------------------

_decoder = msgspec.msgpack.Decoder()  # untyped: plain lists, dicts, bytes, ints


def _bad(msg: str) -> KvEventFormatError:
    return KvEventFormatError(msg)


def _hash(v: Any, what: str) -> BlockHash:
    if isinstance(v, bytes):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _bad(f"{what}: expected bytes or int, got {type(v).__name__}")


def _hashes(v: Any) -> tuple[BlockHash, ...]:
    if not isinstance(v, list):
        raise _bad(f"block_hashes: expected a list, got {type(v).__name__}")
    return tuple(_hash(h, "block hash") for h in v)


def _medium(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise _bad(f"medium: expected a string or None, got {type(v).__name__}")


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any,
            medium: Any, lora_name: Any, extra_keys: Any) -> BlockStored:
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad("token_ids: expected a list of ints")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise _bad(f"block_size: expected a positive int, got {block_size!r}")
    if extra_keys is not None and not isinstance(extra_keys, list):
        raise _bad(f"extra_keys: expected a list or None, got {type(extra_keys).__name__}")
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=_medium(medium),
        lora=lora_id is not None or lora_name is not None,
        extra=bool(extra_keys) and any(k is not None for k in extra_keys),
    )


def _event_from_map(ev: dict[Any, Any]) -> KvEvent | None:
    kind = ev.get("type")
    try:
        if kind == "BlockStored":
            return _stored(ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"],
                           ev["block_size"], ev.get("lora_id"), ev.get("medium"),
                           ev.get("lora_name"), ev.get("extra_keys"))
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(ev["block_hashes"]), _medium(ev.get("medium")))
    except KeyError as e:
        raise _bad(f"{kind} event without {e.args[0]!r}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(kind, str):
        raise _bad(f"event map without a string 'type': {sorted(map(str, ev))[:6]}")
    return None  # a type this module does not know (a newer vLLM): skipped


def _event_from_array(ev: list[Any]) -> KvEvent | None:
    kind = ev[0] if ev else None
    if not isinstance(kind, str):
        raise _bad("event array without a string tag first")

    def at(i: int) -> Any:
        return ev[i] if i < len(ev) else None

    if kind == "BlockStored":
        if len(ev) < 5:
            raise _bad(f"BlockStored array of {len(ev)} elements (at least 5)")
        # [tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
        return _stored(ev[1], ev[2], ev[3], ev[4], at(5), at(6), at(7), at(8))
    if kind == "BlockRemoved":
        if len(ev) < 2:
            raise _bad("BlockRemoved array without block hashes")
        return BlockRemoved(_hashes(ev[1]), _medium(at(2)))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """``(ts, events)`` of one published payload; events of unknown types are left out.

    Raises KvEventFormatError (one line) for anything that is not a batch."""
    try:
        obj = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise _bad(f"not msgpack: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                   ) from None
    if isinstance(obj, list) and len(obj) >= 2:
        ts, raw = obj[0], obj[1]
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw = obj.get("ts", 0.0), obj["events"]
    else:
        raise _bad(f"not an event batch: a {type(obj).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise _bad(f"batch ts: expected a number, got {type(ts).__name__}")
    if not isinstance(raw, list):
        raise _bad(f"batch events: expected a list, got {type(raw).__name__}")
    events: list[KvEvent] = []
    for ev in raw:
        if isinstance(ev, dict):
            out = _event_from_map(ev)
        elif isinstance(ev, list):
            out = _event_from_array(ev)
        else:
            raise _bad(f"event: expected a map or an array, got {type(ev).__name__}")
        if out is not None:
            events.append(out)
    return float(ts), events


# --- the mirror -------------------------------------------------------------------------------

@dataclass(slots=True)
class CacheChange:
    """What one :meth:`CacheMirror.apply` changed, in gateway keys.

    Net over the batch: a key stored and removed again within it is in neither list, so
    the two lists are disjoint and can be applied in any order. With ``cleared`` the
    consumer first forgets everything, then adds ``stored`` (``removed`` is then empty)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


class CacheMirror:
    """One instance's cached GPU blocks, keyed both by engine hash and by gateway key.

    Per engine hash: how many copies are stored and its gateway key (None: unmapped). A
    gateway key is cached while some engine hash with a copy maps to it. Only cached hashes
    are held, so memory follows the instance's cache size."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._copies: dict[BlockHash, int] = {}
        self._keys: dict[BlockHash, int | None] = {}
        self._refs: dict[int, int] = {}  # gateway key -> engine hashes mapped to it

    def __contains__(self, key: object) -> bool:
        return key in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    @property
    def engine_blocks(self) -> int:
        """Engine hashes tracked (mapped or not): the mirror's memory."""
        return len(self._copies)

    def key_of(self, engine_hash: BlockHash) -> int | None:
        """The gateway key of a cached engine hash; None if unknown or unmapped."""
        return self._keys.get(engine_hash)

    def keys(self) -> list[int]:
        """The gateway keys cached now."""
        return list(self._refs)

    def clear(self) -> None:
        self._copies.clear()
        self._keys.clear()
        self._refs.clear()

    def apply(self, events: Iterable[KvEvent]) -> CacheChange:
        """Apply one batch's events in order; see :class:`CacheChange` for what comes back."""
        change = CacheChange()
        first: dict[int, bool] = {}  # gateway key -> cached before its first change here
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.medium is None or ev.medium == MEDIUM_GPU:
                    self._store(ev, first)
            elif isinstance(ev, BlockRemoved):
                if ev.medium is None or ev.medium == MEDIUM_GPU:
                    for h in ev.block_hashes:
                        self._remove(h, first)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
                first.clear()
                change.cleared = True
        refs = self._refs
        change.stored = [k for k, was in first.items() if not was and k in refs]
        change.removed = [k for k, was in first.items() if was and k not in refs]
        return change

    def _gateway_keys(self, ev: BlockStored) -> list[int] | None:
        n = len(ev.block_hashes)
        if (ev.lora or ev.extra or ev.block_size != self.block_size
                or len(ev.token_ids) != n * ev.block_size):
            return None  # keys the gateway cannot reproduce (or tokens not one per hash)
        if ev.parent is None:
            parent = None
        else:
            parent = self._keys.get(ev.parent)
            if parent is None:  # never seen, or unmapped: so are its descendants
                return None
        keys = token_block_keys(ev.token_ids, self.block_size, parent=parent)
        return keys if len(keys) == n else None

    def _store(self, ev: BlockStored, first: dict[int, bool]) -> None:
        keys = self._gateway_keys(ev)
        for i, h in enumerate(ev.block_hashes):
            key = None if keys is None else keys[i]
            copies = self._copies.get(h, 0)
            self._copies[h] = copies + 1
            if copies and (self._keys.get(h) is not None or key is None):
                continue  # another copy: the key (or its absence) is already known
            self._keys[h] = key
            if key is not None:
                self._ref(key, +1, first)

    def _remove(self, h: BlockHash, first: dict[int, bool]) -> None:
        copies = self._copies.get(h)
        if copies is None:
            return  # stored before the mirror started, or already forgotten
        if copies > 1:
            self._copies[h] = copies - 1
            return
        del self._copies[h]
        key = self._keys.pop(h, None)
        if key is not None:
            self._ref(key, -1, first)

    def _ref(self, key: int, delta: int, first: dict[int, bool]) -> None:
        refs = self._refs
        n = refs.get(key, 0)
        if key not in first:
            first[key] = n > 0
        n += delta
        if n > 0:
            refs[key] = n
        else:
            refs.pop(key, None)


# --- the subscriber ---------------------------------------------------------------------------

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_UP = (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DOWN = (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED)
_POLL_MS = 100  # how often the thread looks at its stop flag
_BURST = 256  # messages read per wake-up before the stop flag is looked at again

Delivered = tuple[int, float, list[KvEvent]]


class KvEventSubscriber:
    """One instance's KV-event subscription, on a daemon thread (see the module doc).

    ``connected`` follows a ZMQ socket monitor on the SUB socket: True after
    ``EVENT_CONNECTED`` or ``EVENT_HANDSHAKE_SUCCEEDED``, False after ``EVENT_DISCONNECTED``
    or ``EVENT_CLOSED`` (and once the subscriber is closed). ``on_batch``, when given, is
    called from the thread after new batches are buffered (at most once per wake-up), e.g.
    ``lambda: loop.call_soon_threadsafe(event.set)``; it must be thread-safe and quick.
    At most ``max_pending`` batches wait for :meth:`drain`; past that they are dropped and the
    next one starts with an ``AllBlocksCleared()`` (counted in ``lost_gaps``)."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 name: str = "", replay_timeout: float = 1.0, max_pending: int = 100_000,
                 on_batch: Callable[[], None] | None = None,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.name = name or endpoint
        self.replay_timeout = replay_timeout
        self.max_pending = max_pending
        self._on_batch = on_batch
        self._ctx = context
        self._lock = threading.Lock()
        self._pending: list[Delivered] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._clear_next = False  # prepend an AllBlocksCleared() to the next delivery
        self._warned = False
        self._batches = self._events = self._replayed = 0
        self._lost_gaps = self._restarts = self._bad_payloads = 0
        self._last_seq: int | None = None
        self._last_message_at: float | None = None
        self._connected = False
        self._replay_sock: zmq.Socket | None = None  # the thread's own

    # counters (written by the thread only; ints and floats read atomically)
    @property
    def batches(self) -> int:
        """Batches delivered (received live or replayed)."""
        return self._batches

    @property
    def events(self) -> int:
        """Decoded events delivered (the synthetic clears not counted)."""
        return self._events

    @property
    def replayed(self) -> int:
        """Batches delivered from the replay endpoint."""
        return self._replayed

    @property
    def lost_gaps(self) -> int:
        """Gaps the replay did not fill (each delivered an AllBlocksCleared())."""
        return self._lost_gaps

    @property
    def restarts(self) -> int:
        """Publisher restarts seen (seq not above the last one)."""
        return self._restarts

    @property
    def bad_payloads(self) -> int:
        return self._bad_payloads

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    @property
    def last_message_at(self) -> float | None:
        """time.monotonic() when the last live batch arrived, None before the first."""
        return self._last_message_at

    @property
    def connected(self) -> bool:
        return self._connected

    # lifecycle
    def start(self) -> KvEventSubscriber:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"kv-events {self.name}")
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (it closes its sockets, linger 0); idempotent."""
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._connected = False

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def drain(self) -> list[Delivered]:
        """Everything delivered since the last call, oldest first: ``(seq, ts, events)``."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    # the thread
    def _run(self) -> None:
        ctx = self._ctx or zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        monitor: zmq.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            mask = 0
            for ev in (*_UP, *_DOWN):
                mask |= ev
            monitor = sub.get_monitor_socket(mask)  # before connect: see the first CONNECTED
            sub.connect(self.endpoint)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if monitor in ready:
                    self._read_monitor(monitor)
                if sub in ready:
                    before = self._batches
                    for _ in range(_BURST):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                        if self._stop.is_set():
                            break
                    if self._batches != before and self._on_batch is not None:
                        try:
                            self._on_batch()
                        except Exception:
                            log.exception("kv events %s: on_batch failed", self.name)
        except Exception:
            if not self._stop.is_set():
                log.exception("kv events %s: subscriber thread stopped", self.name)
        finally:
            self._connected = False
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            if self._replay_sock is not None:
                self._replay_sock.close(linger=0)
                self._replay_sock = None

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = msg.get("event")
            if ev in _UP:
                self._connected = True
            elif ev in _DOWN:
                self._connected = False

    def _on_message(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad_payload(None, f"a message of {len(frames)} frames, not (topic, seq, "
                                    "payload)")
            return
        seq = int.from_bytes(frames[1], "big")
        self._last_message_at = time.monotonic()
        last = self._last_seq
        if last is not None and seq <= last:
            self._restarts += 1
            self._clear_next = True
        elif last is not None and seq > last + 1:
            got = self._replay(last + 1, seq)
            if not got or got[0][0] != last + 1:
                self._lost_gaps += 1
                self._clear_next = True
            for s, payload in got:  # the replayed run that ends just before seq
                self._replayed += 1
                self._deliver(s, payload)
        self._deliver(seq, frames[2])

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._last_seq = seq
        try:
            ts, events = decode_batch(payload)
        except KvEventFormatError as e:
            self._bad_payload(seq, str(e))
            return
        if self._clear_next:
            self._clear_next = False
            events.insert(0, AllBlocksCleared())
            n = len(events) - 1
        else:
            n = len(events)
        self._push((seq, ts, events))
        self._batches += 1
        self._events += n

    def _bad_payload(self, seq: int | None, why: str) -> None:
        self._bad_payloads += 1
        if not self._warned:
            self._warned = True
            log.warning("kv events %s: bad payload (seq %s): %s (logged once; counted in "
                        "bad_payloads)", self.name, seq, why)
        if seq is not None:  # its events are lost: the consumer starts over
            self._clear_next = False
            self._push((seq, time.time(), [AllBlocksCleared()]))

    def _push(self, item: Delivered) -> None:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._pending.clear()
                self._lost_gaps += 1
                seq, ts, events = item
                if not events or not isinstance(events[0], AllBlocksCleared):
                    item = (seq, ts, [AllBlocksCleared(), *events])
            self._pending.append(item)

    def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]]:
        """The batches ``start .. stop-1`` the replay endpoint still has: the longest run
        ending at ``stop - 1`` (empty when it has none, or none came in time)."""
        if self.replay_endpoint is None:
            return []
        sock = self._replay_sock
        if sock is None:
            ctx = self._ctx or zmq.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.replay_endpoint)
            self._replay_sock = sock
        got: dict[int, bytes] = {}
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.replay_timeout
        answered = False  # (the replay's end marker came)
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not sock.poll(min(_POLL_MS, max(1, int(left * 1000)))):
                continue
            frames = sock.recv_multipart()
            if len(frames) == 4 and frames[2] == _END_SEQ:
                answered = True
                break
            if len(frames) == 4 and len(frames[2]) == 8:
                s = int.from_bytes(frames[2], "big")
                if start <= s < stop:
                    got[s] = frames[3]
        if not answered:  # a late answer would be read as the next request's: drop the socket
            sock.close(linger=0)
            self._replay_sock = None
        run: list[tuple[int, bytes]] = []
        s = stop - 1
        while s in got:
            run.append((s, got[s]))
            s -= 1
        run.reverse()
        return run
