"""The KV block ledger: the one place that knows how KV cache blocks are counted, allocated and
freed (the role of vLLM's ``KVCacheManager`` over its ``BlockPool``).

Two forms of the same rules, kept side by side so that they cannot drift apart:

* :class:`KVLedger`, for the reference loop (:mod:`duetime.engine.scheduler`): per-request
  ``blocks`` on the :class:`~duetime.engine.request.Request` objects and a free-block count;
* the compiled functions below (``kv_*``), for the kernel (:mod:`duetime.engine.kernel`) and the
  compiled engine: blocks held per request in column ``HELD`` of the kernel's request table,
  the free count in the kernel's state. The kernel calls nothing else to count or move blocks.

Rules (vLLM 0.32's ``KVCacheManager.allocate_slots`` over its ``BlockPool``, no prefix caching
yet):

* one of ``num_gpu_blocks`` is the null block (``block_pool.py``): ``num_gpu_blocks - 1`` are
  usable, and usage is measured against them;
* a request with ``c`` computed tokens holds ``ceil(c / block_size)`` blocks; scheduling ``n``
  more tokens needs ``ceil((c + n) / block_size) - held`` new blocks from the free count; a
  finished, aborted or preempted request gives all its blocks back;
* a waiting (or preempted) request is admitted only if blocks for its whole current sequence,
  ``min(prompt + output, max_model_len)``, fit in the free blocks (``scheduler_reserve_full_isl``,
  vLLM's default) — not just its first chunk — and, while other requests run, only with
  ``watermark_blocks`` more to spare (for both checks); a running request never pays the
  watermark. A prompt whose full sequence exceeds the usable blocks is never admitted: it
  blocks the queue behind it.

Prefix caching (hashes of full blocks, hits, eviction of free cached blocks) changes this
module and nothing outside it.

The block count of a token count is a division; the kernel shifts instead when the block size
is a power of two (``shift`` = log2(block size), else -1): in a decode step the division would
cost more than the rest of the request's bookkeeping.
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit
from duetime.engine.config import NULL_BLOCKS, SchedulerConfig


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


def stuck_reason(request_id: str, prompt: int, output: int, stop: int,
                 config: SchedulerConfig) -> str:
    """Why request ``request_id`` (the waiting queue's head) will never run to its end: its
    current sequence cannot be admitted, or it outgrows the whole cache before it finishes (it
    is preempted and recomputed for ever; vLLM refuses to start when ``max_model_len`` does not
    fit its cache, so only a smaller cache than vLLM would accept gets here)."""
    bs, usable = config.block_size, config.usable_blocks
    full = min(prompt + output, config.max_model_len)
    if config.scheduler_reserve_full_isl and blocks_for(full, bs) > usable:
        return (f"request {request_id!r} can never be admitted: its {full} tokens need "
                f"{blocks_for(full, bs)} KV blocks and the instance has {usable}; it blocks "
                "the queue behind it")
    # its last step computes all but its last output token (or ends at max_model_len)
    end = max(min(prompt + stop - 1, config.max_model_len - 1), prompt + output)
    return (f"request {request_id!r} outgrows the KV cache before it finishes: up to {end} "
            f"tokens need {blocks_for(end, bs)} KV blocks and the instance has {usable}; it "
            "can never finish and blocks the queue behind it")


class KVLedger:
    """Block accounting of one instance's KV cache, request by request (the reference form).

    A request's ``blocks`` attribute is what it holds; :attr:`free_blocks` is what is left of
    the ``usable_blocks`` (all but the null block).
    """

    __slots__ = ("block_size", "free_blocks", "full_sequence", "num_blocks", "usable_blocks",
                 "watermark_blocks")

    def __init__(self, num_blocks: int, block_size: int, free_blocks: int | None = None, *,
                 watermark_blocks: int = 0, full_sequence: bool = True) -> None:
        self.num_blocks = num_blocks
        self.usable_blocks = num_blocks - NULL_BLOCKS
        self.block_size = block_size
        self.free_blocks = self.usable_blocks if free_blocks is None else free_blocks
        self.watermark_blocks = watermark_blocks
        self.full_sequence = full_sequence

    @classmethod
    def of(cls, config: SchedulerConfig, free_blocks: int | None = None) -> KVLedger:
        return cls(config.num_gpu_blocks, config.block_size, free_blocks,
                   watermark_blocks=config.watermark_blocks,
                   full_sequence=config.scheduler_reserve_full_isl)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def need(self, request, tokens: int) -> int:
        """New blocks ``request`` needs to hold ``tokens`` computed tokens."""
        return blocks_for(tokens, self.block_size) - request.blocks

    def fits(self, blocks: int) -> bool:
        return blocks <= self.free_blocks

    def admit(self, request, full_tokens: int, tokens: int, others_running: bool) -> int | None:
        """New blocks a waiting request needs for its first chunk (``tokens`` computed
        tokens), or None if it may not be admitted now: its whole sequence (``full_tokens``)
        must fit, and the watermark be left while others run."""
        spare = self.watermark_blocks if others_running else 0
        if self.full_sequence and (blocks_for(full_tokens, self.block_size) - request.blocks
                                   + spare > self.free_blocks):
            return None
        need = self.need(request, tokens)
        return need if need + spare <= self.free_blocks else None

    def ever_fits(self, full_tokens: int) -> bool:
        """Whether a sequence of ``full_tokens`` can ever be admitted (the empty cache holds
        it)."""
        return blocks_for(full_tokens, self.block_size) <= self.usable_blocks

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
        return self.usable_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable cache in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.usable_blocks if self.usable_blocks else 0.0


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
def kv_admit(req, r, full_tokens, tokens, free, spare, full_sequence, bs,
             shift):  # pragma: no cover - jit
    """New blocks waiting row ``r`` needs for its first chunk (``tokens`` computed tokens),
    or -1 if it may not be admitted now (``KVLedger.admit``; ``spare``: the watermark blocks
    while others run, else 0)."""
    if full_sequence and kv_blocks(full_tokens, bs, shift) - req[r, HELD] + spare > free:
        return -1
    need = kv_need(req, r, tokens, bs, shift)
    if need + spare > free:
        return -1
    return need


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
