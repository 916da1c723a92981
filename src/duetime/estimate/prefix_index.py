"""What a cache-aware router knows of an instance's prefix cache: a :class:`PrefixIndex`.

An instance with automatic prefix caching (vLLM's APC, modelled in ``duetime.engine``) keeps KV
blocks of ``block_size`` tokens; every full block has a chained hash (the hash of the block's
tokens and of the previous block's hash), and a new request reuses the longest run of leading
blocks whose hashes are cached. A router can know that cache two ways:

* **precise**: the instance's own cache, as its KV events publish it (llm-d's
  ``precise-prefix-cache-scorer``); such an index ignores :meth:`PrefixIndex.record`;
* **estimated**: inferred from the router's own routing decisions only
  (:class:`EstimatedPrefixIndex`, as llm-d's ``approx-prefix-cache-producer`` and SGLang's
  router do): a request sent to an instance is assumed to leave its prompt's blocks cached there.

An :class:`~duetime.estimate.base.InstanceView` may carry one as a ``prefix_index`` attribute
(the protocol does not require it, so views without one stay valid): read it with
:func:`prefix_index_of`, which gives ``None`` where there is none (a policy then matches 0 blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from duetime.engine.engine import Engine


class PrefixIndex(Protocol):
    """One instance's prefix cache as the router sees it, in blocks of ``block_size`` tokens."""

    block_size: int
    capacity_blocks: int

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` (a prompt's full-block chained hashes, in
        order) the index believes cached: it stops at the first miss."""
        ...

    def cached_blocks(self) -> int:
        """How many blocks the index holds (SGLang's "smallest tree" compares this)."""
        ...

    def record(self, hashes: Sequence[int]) -> None:
        """The router sent a request with these prompt hashes to the instance (a no-op for a
        precise index, which learns from the instance's own events)."""
        ...


class EngineCacheIndex:
    """A :class:`PrefixIndex` over an engine's own cache, read as it is now: the simulator's
    *precise* view (the instance's engine), and the gateway's estimated one (the instance's
    shadow replica, which caches what the gateway sent there)."""

    __slots__ = ("block_size", "capacity_blocks", "engine")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_size = engine.config.block_size
        self.capacity_blocks = engine.config.usable_blocks

    def match(self, hashes: Sequence[int]) -> int:
        return self.engine.cached_prefix(hashes)

    def cached_blocks(self) -> int:
        return self.engine.cached_blocks

    def record(self, hashes: Sequence[int]) -> None:
        """A no-op: the engine's cache is read as it is."""

    def __repr__(self) -> str:
        return (f"EngineCacheIndex(block_size={self.block_size}, "
                f"capacity_blocks={self.capacity_blocks}, cached={self.cached_blocks()})")


def prefix_index_of(view: object) -> PrefixIndex | None:
    """The view's ``prefix_index``, or ``None`` when it has none."""
    return getattr(view, "prefix_index", None)


def _as_list(hashes: Sequence[int]) -> Sequence[int]:
    # a numpy array (``duetime.workload.segments.block_hashes``) as Python ints: faster dict keys
    tolist = getattr(hashes, "tolist", None)
    return tolist() if tolist is not None else hashes


class EstimatedPrefixIndex:
    """An LRU of block hashes for one instance, learnt only from the router's own decisions.

    Modelled on llm-d's approximate prefix-cache producer (github.com/llm-d/
    llm-d-inference-scheduler, ``pkg/epp/framework/plugins/requestcontrol/dataproducer/
    approximateprefix/``: ``indexer.go``, ``plugin.go``, ``types.go``), whose facts it follows:

    * one LRU of block hashes per server, its capacity the server's number of GPU KV blocks
      (``autoTune``: ``CacheNumBlocks`` from the server's metrics; ``defaultLRUCapacityPerServer
      = 31250`` without them, "llama3 8B on an H100 80GB ... 31.25K blocks" of 16 tokens);
      the block size likewise the server's own (``CacheBlockSize``; ``defaultBlockSizeTokens =
      16``, "vLLM default is 16"). Here both are constructor arguments: the caller sizes the
      index from the instance's KV config;
    * updated only after a routing decision (``PreRequest`` -> ``indexer.Add(hashes, server)``):
      the prompt's hashes are added in prompt order, each ``Add`` making its hash the most
      recent, so the last block is the most recent one and a full LRU evicts its least recent
      hashes first (hashicorp ``golang-lru``); :meth:`record` does the same;
    * looking up does not refresh recency (``indexer.Get`` reads the hash->servers map, not the
      LRU); :meth:`match` neither.

    Differences, documented: llm-d hashes the request *text* in blocks of ``4 x blockSize``
    characters (``averageCharactersPerToken = 4``) with xxhash, including a trailing partial
    block; here the hashes are the instance's own token-block hashes (full blocks only, as the
    KV cache shares only full blocks). llm-d's ``matchLongestPrefix`` walks the prompt's blocks
    while *any* server holds the block and counts, per server, the blocks it holds along that
    run; :meth:`match` stops at the instance's own first miss (the reusable prefix of a real
    prefix cache). llm-d's truncation to ``maxPrefixBlocksToMatch`` (default 256) belongs to the
    policy (:class:`duetime.policy.cache_aware.PrefixLoad`), not to the index.

    Every call is O(blocks of the call): an :class:`~collections.OrderedDict` with move-to-end.
    """

    __slots__ = ("_lru", "block_size", "capacity_blocks")

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks: must be >= 1, got {capacity_blocks}")
        self.block_size = int(block_size)
        self.capacity_blocks = int(capacity_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        lru = self._lru
        n = 0
        for h in _as_list(hashes):
            if h not in lru:
                break
            n += 1
        return n

    def cached_blocks(self) -> int:
        return len(self._lru)

    def record(self, hashes: Sequence[int]) -> None:
        lru = self._lru
        cap = self.capacity_blocks
        for h in _as_list(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > cap:
                    lru.popitem(last=False)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def __repr__(self) -> str:
        return (f"EstimatedPrefixIndex(block_size={self.block_size}, "
                f"capacity_blocks={self.capacity_blocks}, cached={len(self._lru)})")
