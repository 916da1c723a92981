"""The KV block ledger, reference form: how KV cache blocks are counted, allocated and freed
(the role of vLLM's ``KVCacheManager`` over its ``BlockPool``), request by request.

:class:`KVLedger` keeps the books of the reference loop (:mod:`duetime.engine.scheduler`):
per-request ``blocks`` on the :class:`~duetime.engine.request.Request` objects and a free-block
count. Its compiled form, for the compiled scheduler (:mod:`duetime.engine.scheduler_kernel`),
is :mod:`duetime.engine.kv_kernel` (the ``kv_*`` functions; ``tests/test_kv.py`` checks that the
two keep the same books). The plain helpers here (:func:`blocks_for`, :func:`held_blocks`,
:func:`block_shift`, :func:`stuck_reason`) serve both.

Rules (vLLM 0.32's ``KVCacheManager.allocate_slots`` over its ``BlockPool``;
``docs/scheduling-rules.md``, "KV blocks"):

* one of ``num_gpu_blocks`` is the null block: ``num_gpu_blocks - 1`` are usable, and usage is
  measured against them;
* a request with ``c`` computed tokens holds ``ceil(c / block_size)`` blocks; scheduling ``n``
  more tokens needs ``ceil((c + n) / block_size) - held`` new blocks from the free count; a
  finished, aborted or preempted request gives all its blocks back;
* a waiting (or preempted) request is admitted only if blocks for its whole current sequence,
  ``min(prompt + output, max_model_len)``, fit in the free blocks (``scheduler_reserve_full_isl``,
  vLLM's default) — not just its first chunk — and, while other requests run, only with
  ``watermark_blocks`` more to spare (for both checks); a running request never pays the
  watermark. A prompt whose full sequence exceeds the usable blocks is never admitted: it
  blocks the queue behind it.

With prefix caching (``SchedulerConfig.enable_prefix_caching``) blocks have identities and the
ledger keeps every one in a :class:`~duetime.engine.block_pool.BlockPool`: a waiting request
with nothing computed first looks up its cached prefix (:meth:`KVLedger.lookup`), is admitted
with those blocks counted as held (a hit on a block nobody holds costs one free block), reuses
them (:meth:`KVLedger.reuse`) and computes only the rest; every full block of known tokens is
registered when it is allocated. The compiled form caches too, with the same rules, through
the block pool's compiled form (:mod:`duetime.engine.block_pool_kernel`).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from duetime.engine.block_pool import BlockPool
from duetime.engine.config import NULL_BLOCKS, SchedulerConfig


def blocks_for(tokens, block_size: int):
    """KV blocks that hold ``tokens`` tokens (an int, or an int array: element by element)."""
    return -(-tokens // block_size)


def held_blocks(computed: np.ndarray, block_size: int) -> int:
    """Blocks held by requests with these computed-token counts (one block per started
    ``block_size`` tokens each)."""
    return int(blocks_for(np.asarray(computed, dtype=np.int64), block_size).sum())


def block_shift(block_size: int) -> int:
    """log2(block_size) if it is a power of two, else -1 (the compiled form shifts instead of
    dividing then: :mod:`duetime.engine.kv_kernel`)."""
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
    the ``usable_blocks`` (all but the null block). With prefix caching (``caching``) the
    blocks themselves are tracked by a :class:`~duetime.engine.block_pool.BlockPool` (the
    request's ``block_ids``), and the free count includes cached blocks nobody holds.
    """

    __slots__ = ("block_size", "free_blocks", "full_sequence", "num_blocks", "pool",
                 "usable_blocks", "watermark_blocks")

    def __init__(self, num_blocks: int, block_size: int, free_blocks: int | None = None, *,
                 watermark_blocks: int = 0, full_sequence: bool = True,
                 caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.usable_blocks = num_blocks - NULL_BLOCKS
        self.block_size = block_size
        self.free_blocks = self.usable_blocks if free_blocks is None else free_blocks
        self.watermark_blocks = watermark_blocks
        self.full_sequence = full_sequence
        self.pool = BlockPool(num_blocks) if caching else None
        if caching and free_blocks is not None:
            raise ValueError("with prefix caching the ledger owns the blocks: hand over "
                             "running requests with hold(), not a free count")

    @classmethod
    def of(cls, config: SchedulerConfig, free_blocks: int | None = None) -> KVLedger:
        return cls(config.num_gpu_blocks, config.block_size, free_blocks,
                   watermark_blocks=config.watermark_blocks,
                   full_sequence=config.scheduler_reserve_full_isl,
                   caching=config.enable_prefix_caching)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def need(self, request, tokens: int) -> int:
        """New blocks ``request`` needs to hold ``tokens`` computed tokens."""
        return blocks_for(tokens, self.block_size) - request.blocks

    def fits(self, blocks: int) -> bool:
        return blocks <= self.free_blocks

    def lookup(self, request) -> list[int]:
        """Cached blocks a waiting request with nothing computed can reuse: the longest cached
        run of its full blocks, all but its last token at most (vLLM recomputes that one to
        sample from it). Empty without prefix caching."""
        if self.pool is None:
            return []
        n = (request.prompt + request.output - 1) // self.block_size
        return self.pool.lookup(self._key(request, i) for i in range(n))

    def admit(self, request, full_tokens: int, tokens: int, others_running: bool,
              hits: list[int] | tuple[()] = ()) -> int | None:
        """New blocks a waiting request needs for its first chunk (``tokens`` computed
        tokens, ``hits`` of them cached blocks it reuses), or None if it may not be admitted
        now: its whole sequence (``full_tokens``) must fit, and the watermark be left while
        others run. A hit on a block nobody holds takes it out of the free blocks, so it
        counts as one more block needed."""
        spare = self.watermark_blocks if others_running else 0
        held = request.blocks + len(hits)
        if hits:
            spare += sum(1 for b in hits if self.pool.ref[b] == 0)
        if self.full_sequence and (max(blocks_for(full_tokens, self.block_size) - held, 0)
                                   + spare > self.free_blocks):
            return None
        need = max(blocks_for(tokens, self.block_size) - held, 0)
        return need if need + spare <= self.free_blocks else None

    def ever_fits(self, full_tokens: int) -> bool:
        """Whether a sequence of ``full_tokens`` can ever be admitted (the empty cache holds
        it)."""
        return blocks_for(full_tokens, self.block_size) <= self.usable_blocks

    def reuse(self, request, hits: list[int]) -> None:
        """A waiting request with nothing computed takes the cached blocks it hit (admitted
        with them by :meth:`admit`)."""
        self.pool.touch(hits)
        request.block_ids = list(hits)
        request.blocks = request.num_cached = len(hits)
        self.free_blocks = self.pool.free_count

    def take(self, request, blocks: int, cached_tokens: int = 0) -> None:
        """Give ``request`` ``blocks`` more blocks (the caller checked :meth:`fits`); with
        prefix caching, its full blocks of the first ``cached_tokens`` tokens (those known:
        prompt and applied outputs) are registered in the cache at once."""
        request.blocks += blocks
        if self.pool is None:
            self.free_blocks -= blocks
            return
        if blocks:
            request.block_ids += self.pool.allocate(blocks)
            self.free_blocks = self.pool.free_count
        full = cached_tokens // self.block_size
        if full > request.num_cached:
            ids, cache = request.block_ids, self.pool.cache
            for i in range(request.num_cached, full):
                cache(ids[i], self._key(request, i))
            request.num_cached = full

    def free(self, request) -> None:
        """``request`` gives back every block it holds (finished, aborted or preempted)."""
        if self.pool is None:
            self.free_blocks += request.blocks
        else:
            self.pool.free(request.block_ids)
            request.block_ids = []
            request.num_cached = 0
            self.free_blocks = self.pool.free_count
        request.blocks = 0

    def hold(self, request, computed: int) -> None:
        """``request`` holds the blocks of its ``computed`` tokens (state handed over; the
        caller checks the free count afterwards)."""
        request.blocks = 0
        request.block_ids = []
        request.num_cached = 0
        need = blocks_for(computed, self.block_size)
        if self.pool is None or need > self.free_blocks:
            request.blocks = need
            self.free_blocks -= need
        else:
            self.take(request, need, min(computed, request.prompt + request.output))

    @staticmethod
    def _key(request, i: int) -> Hashable:
        hashes = request.hashes
        return hashes[i] if i < len(hashes) else (request.id, i)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable cache in use (vLLM's ``kv_cache_usage_perc``; cached blocks
        nobody holds count as free)."""
        return self.used_blocks / self.usable_blocks if self.usable_blocks else 0.0
