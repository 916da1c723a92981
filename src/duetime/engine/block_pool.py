"""vLLM's block pool with automatic prefix caching, block by block (the reference form).

With prefix caching the *identity* of blocks matters, not only their count: which cached blocks
a new allocation evicts depends on the order of the free queue, and whether a hit costs free
capacity depends on whether someone still holds the block. So this follows vLLM 0.32's
``BlockPool`` (``vllm/v1/core/block_pool.py``), ``FullAttentionManager`` and
``KVCacheManager.allocate_slots`` operation for operation, for one full-attention group whose
hash block size is the block size (``docs/scheduling-rules.md``, "Prefix caching"):

* blocks ``1 .. num_gpu_blocks - 1`` start in the free queue in that order (block 0 is the null
  block); the free count is the queue's length, cached blocks with no holder included;
* new blocks come from the head of the queue; a block that held a cached hash loses it
  (evicted);
* a hit on a block with no holder (``ref == 0``) takes it out of the queue (``touch``);
* a request frees its blocks last-first; a block nobody holds any more goes to the *front* of
  the queue if it has no hash (reused first) and to the *tail* if it has one (evicted last,
  LRU);
* a full block is registered under its hash as soon as it is allocated (``cache``), so a later
  request in the same step can hit it; two blocks may hold the same hash (vLLM does not
  de-duplicate), and a lookup takes the first registered that is still cached;
* a lookup takes the longest run of cached blocks from the start (the hashes are chained, so
  the first miss ends it), capped by the caller.

Hashes are opaque keys (ints, strings or tuples); :mod:`duetime.engine.kv` decides which.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import pairwise


class BlockPool:
    """The free queue, reference counts and the hash → blocks map of one instance."""

    __slots__ = ("_next", "_prev", "cached", "free_count", "key", "num_blocks", "ref")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[Hashable | None] = [None] * num_blocks
        # the free queue, a doubly linked list over block ids; sentinels: head n, tail n + 1
        # (block 0, the null block, is never queued)
        chain = [num_blocks, *range(1, num_blocks), num_blocks + 1]
        self._next = [-1] * (num_blocks + 2)
        self._prev = [-1] * (num_blocks + 2)
        for a, b in pairwise(chain):
            self._next[a], self._prev[b] = b, a
        self.free_count = num_blocks - 1
        self.cached: dict[Hashable, dict[int, None]] = {}

    # -- the free queue ---------------------------------------------------------------------------

    def _unlink(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p], self._prev[n] = n, p
        self.free_count -= 1

    def _insert_after(self, p: int, b: int) -> None:
        n = self._next[p]
        self._next[p], self._prev[b], self._next[b], self._prev[n] = b, p, n, b
        self.free_count += 1

    def queue(self) -> list[int]:
        """The free queue, head first (for tests and snapshots)."""
        out, b, tail = [], self._next[self.num_blocks], self.num_blocks + 1
        while b != tail:
            out.append(b)
            b = self._next[b]
        return out

    # -- operations -------------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks from the head of the free queue, each evicted from the cache if it
        held a hash, each held once (the caller checked the free count)."""
        assert count <= self.free_count
        head = self.num_blocks
        out = []
        for _ in range(count):
            b = self._next[head]
            self._unlink(b)
            self._evict(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        k = self.key[b]
        if k is not None:
            holders = self.cached[k]
            del holders[b]
            if not holders:
                del self.cached[k]
            self.key[b] = None

    def touch(self, blocks: Iterable[int]) -> None:
        """Hit blocks get one more holder; one that had none leaves the free queue."""
        for b in blocks:
            if self.ref[b] == 0:
                self._unlink(b)
            self.ref[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Give back one request's blocks (in allocation order; freed last-first)."""
        front: list[int] = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is None:
                    front.append(b)
                else:  # cached: to the tail, evicted last
                    self._insert_after(self._prev[self.num_blocks + 1], b)
        p = self.num_blocks
        for b in front:  # unhashed: to the front, in the order freed
            self._insert_after(p, b)
            p = b

    def cache(self, b: int, key: Hashable) -> None:
        """Register full block ``b`` under ``key`` (it holds no hash yet)."""
        assert self.key[b] is None
        self.key[b] = key
        self.cached.setdefault(key, {})[b] = None

    def lookup(self, keys: Iterable[Hashable]) -> list[int]:
        """The longest run of cached blocks for these keys, from the first."""
        out = []
        cached = self.cached
        for k in keys:
            holders = cached.get(k)
            if holders is None:
                break
            out.append(next(iter(holders)))
        return out

    def evictable(self, blocks: Iterable[int]) -> int:
        """How many of these blocks nobody holds (a hit on them costs free capacity)."""
        return sum(1 for b in blocks if self.ref[b] == 0)
