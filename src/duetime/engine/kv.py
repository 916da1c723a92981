"""The KV block ledger: the one place that knows how KV cache blocks are counted, allocated and
freed (the role of vLLM's ``KVCacheManager`` over its ``BlockPool``).

Two forms of the same rules, kept side by side so that they cannot drift apart:

* :class:`KVLedger`, for the reference loop (:mod:`duetime.engine.scheduler`): per-request
  ``blocks`` on the :class:`~duetime.engine.request.Request` objects and a free-block count;
* the compiled functions below (``kv_*``), for the kernel (:mod:`duetime.engine.kernel`) and the
  compiled engine: blocks held per request in column ``HELD`` of the kernel's request table,
  the free count in the kernel's state. The kernel calls nothing else to count or move blocks.

Rules (no prefix caching yet): a request with ``c`` computed tokens holds ``ceil(c /
block_size)`` blocks; scheduling ``n`` more tokens needs ``ceil((c + n) / block_size) - held``
new blocks, taken from the free count; a finished, aborted or preempted request gives all its
blocks back. Prefix caching (hashes of full blocks, hits, eviction of free cached blocks)
changes this module and nothing outside it.

The block count of a token count is a division; the kernel shifts instead when the block size
is a power of two (``shift`` = log2(block size), else -1): in a decode step the division would
cost more than the rest of the request's bookkeeping.
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit


def blocks_for(tokens, block_size: int):
    """KV blocks that hold ``tokens`` tokens (an int, or an int array: element by element)."""
    return -(-tokens // block_size)


def held_blocks(computed: np.ndarray, block_size: int) -> int:
    """Blocks held by requests with these computed-token counts (one block per started
    ``block_size`` tokens each)."""
    return int(blocks_for(np.asarray(computed, dtype=np.int64), block_size).sum())


def block_shift(block_size: int) -> int:
    """log2(block_size) if it is a power of two, else -1 (see the module doc)."""
    return block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1


class KVLedger:
    """Block accounting of one instance's KV cache, request by request (the reference form).

    A request's ``blocks`` attribute is what it holds; :attr:`free_blocks` is what is left.
    """

    __slots__ = ("block_size", "free_blocks", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int, free_blocks: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = num_blocks if free_blocks is None else free_blocks

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def need(self, request, tokens: int) -> int:
        """New blocks ``request`` needs to hold ``tokens`` computed tokens."""
        return blocks_for(tokens, self.block_size) - request.blocks

    def fits(self, blocks: int) -> bool:
        return blocks <= self.free_blocks

    def take(self, request, blocks: int) -> None:
        """Give ``request`` ``blocks`` more blocks (the caller checked :meth:`fits`)."""
        self.free_blocks -= blocks
        request.blocks += blocks

    def free(self, request) -> None:
        """``request`` gives back every block it holds (finished, aborted or preempted)."""
        self.free_blocks += request.blocks
        request.blocks = 0

    def hold(self, request, computed: int) -> None:
        """``request`` holds the blocks of its ``computed`` tokens (state handed over; the
        caller checks the free count afterwards)."""
        request.blocks = blocks_for(computed, self.block_size)
        self.free_blocks -= request.blocks

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the cache in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.num_blocks


# -- the compiled form --------------------------------------------------------------------------
# The kernel keeps each request's blocks in column ``HELD`` of its request table ``req`` (the
# row a step reads anyway); the free count lives in the kernel's state.

HELD = 4


@njit(cache=True, nogil=True, inline="always")
def kv_blocks(tokens, bs, shift):  # pragma: no cover - jit
    """Blocks that hold ``tokens`` tokens (``shift`` >= 0: block size 2**shift)."""
    if shift >= 0:
        return (tokens + bs - 1) >> shift
    return (tokens + bs - 1) // bs


@njit(cache=True, nogil=True, inline="always")
def kv_need(req, r, tokens, bs, shift):  # pragma: no cover - jit
    """New blocks row ``r`` needs to hold ``tokens`` computed tokens."""
    return kv_blocks(tokens, bs, shift) - req[r, HELD]


@njit(cache=True, nogil=True, inline="always")
def kv_take(req, r, blocks):  # pragma: no cover - jit
    """Row ``r`` takes ``blocks`` more blocks; returns them (subtract from the free count)."""
    req[r, HELD] += blocks
    return blocks


@njit(cache=True, nogil=True, inline="always")
def kv_release(req, r):  # pragma: no cover - jit
    """Row ``r`` gives back all its blocks; returns how many (add to the free count)."""
    b = req[r, HELD]
    req[r, HELD] = 0
    return b
