"""The gateway's consumer of vLLM's KV-cache events (duetime.gateway.state.kv_events).

A fake publisher here speaks vLLM's wire protocol (PUB of ``(topic, seq, payload)`` and a
ROUTER replay endpoint over a buffer of past batches), encoding events the vLLM 0.32 way
(tagged msgspec structs, maps) or the 0.9/0.10 way (positional arrays, tag first), with
sha256-like bytes or 64-bit int hashes. Loopback only; ports from bind_to_random_port.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq

from duetime.gateway.state.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheMirror,
    KvEventFormatError,
    KvEventSubscriber,
    decode_batch,
)
from duetime.web.prefix_keys import token_block_keys

BS = 4


# --- the wire, as vLLM 0.32 writes it ----------------------------------------------------------

class WEvent(msgspec.Struct, tag=True, omit_defaults=True):
    """The base of vLLM 0.32's tagged event structs (a map with "type")."""


class WStored(WEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    session_id: str | None = None


class WRemoved(WEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class WCleared(WEvent, tag="AllBlocksCleared"):
    """No fields: the tag alone."""


class WFuture(WEvent, tag="BlockMoved"):  # a type a later vLLM might add
    block_hashes: list[bytes | int]


class WBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[WStored | WRemoved | WCleared | WFuture]
    data_parallel_rank: int | None = None


# --- the wire, as vLLM 0.9/0.10 wrote it (positional arrays, tag first) -----------------------

class OStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ORemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class OCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    """No fields: an array of the tag alone."""


class OFuture(msgspec.Struct, array_like=True, tag="BlockMoved"):
    block_hashes: list[bytes | int]


class OBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OStored | ORemoved | OCleared | OFuture]


_enc = msgspec.msgpack.Encoder()


def h(i: int, kind: str = "bytes") -> bytes | int:
    """An engine block hash: 32 bytes (sha256, vLLM's default) or a 64-bit int."""
    d = hashlib.sha256(str(i).encode()).digest()
    return d if kind == "bytes" else int.from_bytes(d, "big") & ((1 << 64) - 1)


def encode(events: list[Any], style: str = "new", ts: float = 1.0) -> bytes:
    """Events given as the module's dataclasses, encoded the 0.32 way or the old way."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored):
            if style == "new":
                out.append(WStored(list(e.block_hashes), e.parent, list(e.token_ids),
                                   e.block_size, 7 if e.lora else None, e.medium,
                                   "ad" if e.lora else None,
                                   [("salt",)] + [None] * (len(e.block_hashes) - 1)
                                   if e.extra else [None] * len(e.block_hashes),
                                   group_idx=0))
            else:
                out.append(OStored(list(e.block_hashes), e.parent, list(e.token_ids),
                                   e.block_size, 7 if e.lora else None, e.medium))
        elif isinstance(e, BlockRemoved):
            out.append((WRemoved if style == "new" else ORemoved)(list(e.block_hashes),
                                                                   e.medium))
        elif isinstance(e, AllBlocksCleared):
            out.append(WCleared() if style == "new" else OCleared())
        else:
            out.append(e)
    batch = WBatch(ts, out, 0) if style == "new" else OBatch(ts, out)
    return _enc.encode(batch)


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), kw.pop("block_size", BS),
                       kw.pop("medium", "GPU"), **kw)


# --- decoding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["new", "old"])
@pytest.mark.parametrize("kind", ["bytes", "int"])
def test_decode_both_encodings_and_hash_types(style, kind):
    a, b, c = h(1, kind), h(2, kind), h(3, kind)
    events = [stored([a, b], None, list(range(8))), stored([c], b, [8, 9, 10, 11]),
              BlockRemoved((a,), "GPU"), AllBlocksCleared()]
    future = WFuture([a]) if style == "new" else OFuture([a])
    ts, got = decode_batch(encode([events[0], future, *events[1:]], style, ts=12.5))
    assert ts == 12.5
    assert got == events  # the unknown BlockMoved is skipped
    assert type(got[0].block_hashes[0]) is (bytes if kind == "bytes" else int)
    if kind == "int":
        assert got[0].block_hashes[0] >= 2**63  # uint64 survives msgpack


def test_decode_flags_lora_extra_and_medium():
    e = stored([h(1)], None, [1, 2, 3, 4], lora=True, extra=True, medium="CPU")
    [got] = decode_batch(encode([e]))[1]
    assert (got.lora, got.extra, got.medium) == (True, True, "CPU")
    # extra_keys with only None entries (vLLM's usual case) is not "extra"
    [plain] = decode_batch(encode([stored([h(1)], None, [1, 2, 3, 4])]))[1]
    assert (plain.lora, plain.extra) == (False, False)
    # an old positional event without medium, and with it
    p = _enc.encode([0.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4, None],
                           ["BlockRemoved", [5]], ["BlockRemoved", [5], "CPU"]]])
    assert decode_batch(p)[1] == [BlockStored((5,), None, (1, 2, 3, 4), 4, None),
                                  BlockRemoved((5,), None), BlockRemoved((5,), "CPU")]


def test_decode_a_batch_given_as_a_map():
    p = _enc.encode({"ts": 3, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 0})
    assert decode_batch(p) == (3.0, [AllBlocksCleared()])


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"not msgpack at all \xff\xfe", _enc.encode(5), _enc.encode([1.0]),
    _enc.encode(["x", []]), _enc.encode([1.0, "events"]), _enc.encode([1.0, [3]]),
    _enc.encode([1.0, [{"block_hashes": [1]}]]),
    _enc.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
    _enc.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["s"], "medium": "GPU"}]]),
    _enc.encode([1.0, [["BlockStored", [1], None, [1.5], 4, None]]]),
    _enc.encode([1.0, [["BlockStored", [1], None, [1], 0, None]]]),
    _enc.encode([1.0, [[7, [1]]]]),
])
def test_decode_garbage_raises_a_one_line_format_error(payload):
    with pytest.raises(KvEventFormatError) as ei:
        decode_batch(payload)
    assert "\n" not in str(ei.value) and str(ei.value)
    assert isinstance(ei.value, ValueError)


# --- the mirror --------------------------------------------------------------------------------

TOKENS = list(range(100, 124))  # 6 blocks of 4


def test_mirror_keys_chain_like_the_gateways_prompt_keys():
    m = CacheMirror(BS)
    hs = [h(i) for i in range(6)]
    ch1 = m.apply([stored(hs[:2], None, TOKENS[:8])])
    ch2 = m.apply([stored(hs[2:], hs[1], TOKENS[8:])])
    want = token_block_keys(TOKENS, BS)
    assert ch1.stored + ch2.stored == want
    assert (ch1.removed, ch1.cleared, ch2.removed, ch2.cleared) == ([], False, [], False)
    assert [m.key_of(x) for x in hs] == want
    assert all(k in m for k in want) and len(m) == 6


def test_mirror_counts_duplicate_copies():
    m = CacheMirror(BS)
    a, b = h(1), h(2)
    key_a, key_b = token_block_keys(TOKENS[:8], BS)
    assert m.apply([stored([a, b], None, TOKENS[:8])]).stored == [key_a, key_b]
    assert m.apply([stored([a], None, TOKENS[:4])]).stored == []  # a second copy of a
    ch = m.apply([BlockRemoved((a, b), "GPU")])
    assert ch.removed == [key_b] and key_a in m and key_b not in m
    ch = m.apply([BlockRemoved((a,), "GPU")])
    assert ch.removed == [key_a] and len(m) == 0
    assert m.engine_blocks == 0  # removed hashes are forgotten
    assert m.apply([BlockRemoved((a,), "GPU")]).removed == []  # unknown: ignored


def test_mirror_changes_are_net_over_a_batch():
    m = CacheMirror(BS)
    a, b = h(1), h(2)
    key_a, key_b = token_block_keys(TOKENS[:8], BS)
    ch = m.apply([stored([a], None, TOKENS[:4]), BlockRemoved((a,), None),
                  stored([b], None, TOKENS[4:8])])
    assert (ch.stored, ch.removed) == ([token_block_keys(TOKENS[4:8], BS)[0]], [])
    m.apply([stored([a], None, TOKENS[:4])])
    ch = m.apply([BlockRemoved((a,), "GPU"), stored([a], None, TOKENS[:4])])
    assert (ch.stored, ch.removed) == ([], []) and key_a in m
    assert key_b not in m


def test_mirror_unknown_parent_leaves_the_blocks_and_their_children_unmapped():
    m = CacheMirror(BS)
    hs = [h(i) for i in range(4)]
    assert m.apply([stored(hs[1:3], h(99), TOKENS[4:12])]).stored == []
    assert m.apply([stored([hs[3]], hs[2], TOKENS[12:16])]).stored == []  # child of unmapped
    assert len(m) == 0 and m.key_of(hs[3]) is None and m.engine_blocks == 3
    # removing them forgets them without reporting any gateway key
    assert m.apply([BlockRemoved(tuple(hs[1:]), "GPU")]).removed == []
    assert m.engine_blocks == 0


@pytest.mark.parametrize("flags", [{"lora": True}, {"extra": True}, {"block_size": 8}])
def test_mirror_cannot_map_lora_extra_keys_or_another_block_size(flags):
    m = CacheMirror(BS)
    hs = [h(i) for i in range(3)]
    assert m.apply([stored(hs[:2], None, TOKENS[:8] if "block_size" not in flags
                           else TOKENS[:16], **flags)]).stored == []
    assert m.apply([stored([hs[2]], hs[1], TOKENS[8:12])]).stored == []
    assert len(m) == 0


@pytest.mark.parametrize("n_tokens", [8, 5, 3])
def test_mirror_tokens_not_one_block_per_hash_are_unmapped(n_tokens):
    """vLLM skips null / masked blocks' hashes (sliding window, Mamba) but not their tokens."""
    m = CacheMirror(BS)
    assert m.apply([stored([h(1)], None, TOKENS[:n_tokens])]).stored == []
    assert len(m) == 0 and m.engine_blocks == 1


def test_mirror_a_later_mappable_copy_maps_an_unmapped_hash():
    m = CacheMirror(BS)
    a, b = h(1), h(2)
    m.apply([stored([b], a, TOKENS[4:8])])  # parent unknown
    ch = m.apply([stored([a, b], None, TOKENS[:8])])
    assert ch.stored == token_block_keys(TOKENS[:8], BS)


def test_mirror_ignores_other_media():
    m = CacheMirror(BS)
    a = h(1)
    assert m.apply([stored([a], None, TOKENS[:4], medium="CPU")]).stored == []
    key = m.apply([stored([a], None, TOKENS[:4], medium=None)]).stored[0]
    assert m.apply([BlockRemoved((a,), "CPU")]).removed == [] and key in m
    assert m.apply([BlockRemoved((a,), "GPU")]).removed == [key]


def test_mirror_clear_in_the_middle_of_a_batch():
    m = CacheMirror(BS)
    hs = [h(i) for i in range(4)]
    keys = token_block_keys(TOKENS[:16], BS)
    m.apply([stored(hs[:2], None, TOKENS[:8])])
    ch = m.apply([stored(hs[2:], hs[1], TOKENS[8:16]), BlockRemoved((hs[0],), "GPU"),
                  AllBlocksCleared(), stored([hs[0]], None, TOKENS[:4]),
                  stored([hs[1]], hs[0], TOKENS[4:8])])
    assert ch.cleared and ch.stored == keys[:2] and ch.removed == []
    assert set(m.keys()) == set(keys[:2]) and m.engine_blocks == 2
    # after the clear, hs[2] is unknown: its removal reports nothing
    assert m.apply([BlockRemoved((hs[2],), "GPU")]).removed == []
    m.clear()
    assert len(m) == 0 and m.key_of(hs[0]) is None


# --- the subscriber over loopback --------------------------------------------------------------

class FakePublisher:
    """vLLM's ZmqEventPublisher's wire: PUB ``(topic, seq, payload)`` and a ROUTER that answers
    ``[id, b"", start]`` with every buffered batch from ``start``, then the end marker."""

    def __init__(self, ctx: zmq.Context, *, replay: bool = True, topic: str = "kv") -> None:
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.replay_endpoint: str | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if replay:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            port = router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{port}"
            self.thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self.thread.start()

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self.stop.is_set():
                if not router.poll(20):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self.lock:
                    batches = [b for b in self.buffer if b[0] >= first]
                for s, payload in batches:
                    router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"),
                                           payload])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                       b""])
        finally:
            router.close(linger=0)

    def publish(self, payload: bytes, *, send: bool = True, keep: bool = True,
                seq: int | None = None) -> int:
        """Next seq (or ``seq``); ``send=False`` skips the PUB (a gap), ``keep=False`` leaves
        it out of the replay buffer."""
        s = self.seq if seq is None else seq
        self.seq = s + 1
        if keep:
            with self.lock:
                self.buffer.append((s, payload))
        if send:
            self.pub.send_multipart([self.topic, s.to_bytes(8, "big"), payload])
        return s

    def close_pub(self) -> None:
        self.pub.close(linger=0)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(2)
        if not self.pub.closed:
            self.pub.close(linger=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def make(ctx):
    made: list[Any] = []

    def _make(replay: bool = True, sub_replay: bool | None = None,
              **kw: Any) -> tuple[FakePublisher, KvEventSubscriber]:
        pub = FakePublisher(ctx, replay=replay)
        use = replay if sub_replay is None else sub_replay
        sub = KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint if use
                                else None, topic="kv", name="test", context=ctx, **kw)
        made.extend([sub, pub])
        sub.start()
        sync(pub, sub)
        return pub, sub

    yield _make
    for x in made:
        x.close()


PROBE = encode([])


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def sync(pub: FakePublisher, sub: KvEventSubscriber) -> None:
    """Past ZMQ's slow joiner: probe until the subscriber hears, then until it heard every
    probe sent; the probes are drained away."""
    deadline = time.monotonic() + 5
    while sub.last_seq is None:
        assert time.monotonic() < deadline, "the subscriber never heard the publisher"
        pub.publish(PROBE)
        time.sleep(0.01)
    wait_for(lambda: sub.last_seq == pub.seq - 1)
    sub.drain()


def collect(sub: KvEventSubscriber, n: int) -> list[tuple[int, float, list[Any]]]:
    got: list[tuple[int, float, list[Any]]] = []

    def enough() -> bool:
        got.extend(sub.drain())
        return len(got) >= n

    wait_for(enough)
    return got


def batch(i: int, style: str = "new", kind: str = "bytes") -> bytes:
    return encode([stored([h(i, kind)], None, [i] * BS)], style, ts=float(i))


@pytest.mark.parametrize(("style", "kind"), [("new", "bytes"), ("old", "int")])
def test_subscriber_receives_batches_in_order(make, style, kind):
    pub, sub = make()
    n0 = sub.batches
    seqs = [pub.publish(batch(i, style, kind)) for i in range(5)]
    got = collect(sub, 5)
    assert [s for s, _, _ in got] == seqs
    assert [ts for _, ts, _ in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [ev[0].block_hashes[0] for _, _, ev in got] == [h(i, kind) for i in range(5)]
    assert sub.batches - n0 == 5 and sub.events == 5 and sub.last_seq == seqs[-1]
    assert sub.last_message_at is not None and sub.last_message_at <= time.monotonic()
    assert (sub.replayed, sub.lost_gaps, sub.restarts, sub.bad_payloads) == (0, 0, 0, 0)


def test_a_gap_is_recovered_through_replay_in_order(make):
    pub, sub = make()
    a = pub.publish(batch(1))
    b = pub.publish(batch(2), send=False)  # lost on PUB, kept for replay
    c = pub.publish(batch(3), send=False)
    d = pub.publish(batch(4))
    e = pub.publish(batch(5))
    got = collect(sub, 5)
    assert [s for s, _, _ in got] == [a, b, c, d, e]
    assert [ev for _, _, ev in got] == [decode_batch(batch(i))[1] for i in range(1, 6)]
    assert (sub.replayed, sub.lost_gaps) == (2, 0)


def test_a_gap_without_replay_clears(make):
    pub, sub = make(replay=False)
    pub.publish(batch(1))
    pub.publish(batch(2), send=False)
    c = pub.publish(batch(3))
    got = collect(sub, 2)
    assert got[1][0] == c
    assert got[1][2] == [AllBlocksCleared(), *decode_batch(batch(3))[1]]
    assert got[0][2] == decode_batch(batch(1))[1]
    assert (sub.lost_gaps, sub.replayed) == (1, 0)


def test_a_gap_the_replay_buffer_no_longer_holds_clears_then_delivers_what_it_has(make):
    pub, sub = make()
    pub.publish(batch(1), send=False, keep=False)  # gone from the buffer too
    b = pub.publish(batch(2), send=False)
    c = pub.publish(batch(3))
    got = collect(sub, 2)
    assert [s for s, _, _ in got] == [b, c]
    assert got[0][2] == [AllBlocksCleared(), *decode_batch(batch(2))[1]]
    assert (sub.lost_gaps, sub.replayed) == (1, 1)


def test_a_replay_endpoint_that_does_not_answer_clears_in_bounded_time(ctx, make):
    pub, sub = make(replay=False, sub_replay=False)
    silent = ctx.socket(zmq.ROUTER)  # bound, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub.replay_endpoint = f"tcp://127.0.0.1:{port}"
        sub.replay_timeout = 0.2
        pub.publish(batch(1), send=False)
        t0 = time.monotonic()
        c = pub.publish(batch(2))
        got = collect(sub, 1)
        assert time.monotonic() - t0 < 2
        assert got[0][0] == c and got[0][2][0] == AllBlocksCleared()
        assert sub.lost_gaps == 1
    finally:
        silent.close(linger=0)


def test_a_restart_clears(make):
    pub, sub = make()
    pub.publish(batch(1))
    pub.publish(batch(2), seq=0)  # a new publisher process: seq starts over
    pub.publish(batch(3))
    got = collect(sub, 3)
    assert [s for s, _, _ in got][1:] == [0, 1]
    assert got[1][2] == [AllBlocksCleared(), *decode_batch(batch(2))[1]]
    assert got[2][2] == decode_batch(batch(3))[1]
    assert (sub.restarts, sub.lost_gaps) == (1, 0)


def test_bad_payloads_are_counted_and_clear(make, caplog):
    pub, sub = make()
    with caplog.at_level("WARNING", logger="duetime.gateway"):
        bad = pub.publish(b"\xc1garbage")
        pub.publish(b"\xc1garbage")
        ok = pub.publish(batch(1))
        pub.pub.send_multipart([b"kv", b"short"])  # not (topic, 8-byte seq, payload)
        got = collect(sub, 3)
        wait_for(lambda: sub.bad_payloads == 3)
    assert got[0] == (bad, got[0][1], [AllBlocksCleared()])
    assert got[2][0] == ok and got[2][2] == decode_batch(batch(1))[1]
    assert len([r for r in caplog.records if "bad payload" in r.getMessage()]) == 1
    assert sub.lost_gaps == 0


def test_connected_follows_the_publisher_and_close_is_prompt(make):
    pub, sub = make()
    wait_for(lambda: sub.connected)
    pub.close_pub()
    wait_for(lambda: not sub.connected)
    t0 = time.monotonic()
    sub.close()
    sub.close()  # idempotent
    assert time.monotonic() - t0 < 0.6
    assert not sub.connected


def test_context_manager_and_on_batch(ctx):
    pub = FakePublisher(ctx, replay=False)
    woken = threading.Event()
    try:
        with KvEventSubscriber(pub.endpoint, topic="kv", context=ctx,
                               on_batch=woken.set) as sub:
            sync(pub, sub)
            assert woken.is_set()
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 0.6
        assert sub.start() is sub and not sub.connected  # closed for good
    finally:
        pub.close()


def test_other_topics_are_not_delivered(make):
    pub, sub = make()
    last = sub.last_seq
    pub.pub.send_multipart([b"other", (99).to_bytes(8, "big"), batch(1)])
    s = pub.publish(batch(2))
    got = collect(sub, 1)
    assert [x[0] for x in got] == [s] == [last + 1]
