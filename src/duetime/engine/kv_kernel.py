"""The KV block ledger, compiled: the kernel's form of :class:`duetime.engine.kv.KVLedger`
(the same rules, stated there; tested side by side in ``tests/test_kv.py``).

The compiled scheduler (:mod:`duetime.engine.scheduler_kernel`) keeps each request's blocks in
column ``HELD`` of its request table ``req`` (the row a step reads anyway) and the free count
in its state array. Every allocation it makes is checked here (:func:`kv_need` for a running
request's next chunk, :func:`kv_admit` for a waiting one: full-sequence admission and the
watermark). Without prefix caching blocks are only counted, and :func:`kv_take` /
:func:`kv_release` move them; with prefix caching they have identities, and the block pool's
compiled form (:mod:`duetime.engine.block_pool_kernel`) takes and frees them instead.

The block count of a token count is a division; these shift instead when the block size is a
power of two (``shift`` = log2(block size), else -1: :func:`duetime.engine.kv.block_shift`):
in a decode step the division would cost more than the rest of the request's bookkeeping.

Every function is inlined into its caller (``inline="always"``): a call per request and step
would cost more than the arithmetic.
"""

from __future__ import annotations

from duetime.engine._jit import njit

HELD = 4  # the column of ``req`` that holds a request's blocks


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
    while others run, plus, with prefix caching, the hit blocks nobody holds; else 0)."""
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
