"""Segments: which tokens a prompt holds, without token ids, and the KV-block hashes they give.

A prompt is ``((segment_id, length), ...)``. A segment id names one stream of content and
``(s, L)`` is that stream's first ``L`` tokens, so two prompts that start with the same segments
start with the same tokens whatever the block size, and a simulator can hash KV blocks
(:func:`block_hashes`) at the block size of each instance.

Segment ids are int64: ``(tag << 56) + counter``, the counter from 1 in every run, one tag per
source (the generators of :mod:`duetime.workload.prefix`, Mooncake traces), so content of
different sources never collides.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from duetime.workload.requests import RequestSet

TAG_BITS = 56
TAG_MULTI_TURN, TAG_TENANTS, TAG_SHARED_PREFIX, TAG_MOONCAKE, TAG_MOONCAKE_ANSWER = 1, 2, 3, 4, 5

Segments = tuple[tuple[int, int], ...]

# -- block hashes -------------------------------------------------------------------------------

_PIECE = struct.Struct("<3q")
_ROOT = b"duetime\0"  # the "parent" of block 0


def block_hashes(segments: Sequence[tuple[int, int]], block_size: int) -> np.ndarray:
    """The chained hash of every *full* block of ``block_size`` tokens (int64 array; a trailing
    partial block gets none, as a KV cache only shares full blocks).

    Block k's hash = blake2b-64(hash of block k-1, the pieces of segments it covers as
    (segment id, start offset, end offset)), so two sequences get equal hashes for block k iff
    their first (k+1)*block_size tokens come from the same segments at the same offsets (up to
    64-bit collisions). Deterministic across processes and Python versions (no ``hash()``).
    Speed, one core: ~0.5 us per block inside one segment, ~1.5 us with three pieces per block
    (``python -m timeit -s "from duetime.workload.prefix import block_hashes as b;
    s=((1,5000),(2,3000),(3,200))" "b(s, 16)"``: ~270 us for 512 blocks), so a 32k-token prompt
    at block size 16 hashes in ~1 ms.
    """
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    total = 0
    for sid, length in segments:
        if length < 0:
            raise ValueError(f"segment {sid}: negative length {length}")
        total += length
    digests: list[bytes] = []
    pack, blake2b = _PIECE.pack, hashlib.blake2b
    prev = _ROOT
    last = len(segments) - 1
    si, off = 0, 0  # current segment, offset inside it
    sid, length = segments[0] if segments else (0, 0)
    for _ in range(total // block_size):
        need = block_size
        if length - off >= need:  # the common case: the block lies inside one segment
            data = prev + pack(sid, off, off + need)
            off += need
        else:
            data = prev
            while need:
                take = min(length - off, need)
                if take > 0:
                    data += pack(sid, off, off + take)
                    off += take
                    need -= take
                if off >= length and si < last:
                    si, off = si + 1, 0
                    sid, length = segments[si]
        if off >= length and si < last:
            si, off = si + 1, 0
            sid, length = segments[si]
        prev = blake2b(data, digest_size=8).digest()
        digests.append(prev)
    return np.frombuffer(b"".join(digests), dtype="<i8").astype(np.int64)


def prompt_hashes(requests: RequestSet, i: int, block_size: int) -> np.ndarray:
    """Block hashes of request ``i``'s prompt."""
    if requests.segments is None:
        raise ValueError("this request set has no segments (not a shared-prefix workload)")
    return block_hashes(requests.segments[i], block_size)


def sequence_hashes(requests: RequestSet, i: int, output_tokens: int,
                    block_size: int) -> np.ndarray:
    """Block hashes of request ``i``'s prompt followed by ``output_tokens`` of its answer (what
    a KV cache holds when the request finishes; a later turn of its session shares them)."""
    if requests.segments is None or requests.answer_segment is None:
        raise ValueError("this request set has no segments (not a shared-prefix workload)")
    seq = (*requests.segments[i], (int(requests.answer_segment[i]), int(output_tokens)))
    return block_hashes(seq, block_size)


class SegmentIds:
    """Segment ids of one generator run: tag << 56, counted from 1."""

    def __init__(self, tag: int) -> None:
        self.next = (tag << TAG_BITS) + 1

    def take(self, n: int = 1) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out
