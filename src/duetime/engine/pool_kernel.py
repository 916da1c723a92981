"""The block pool with prefix caching, compiled: the kernel's form of
:mod:`duetime.engine.block_pool` (the same rules, operation for operation; tested against it).

Layout:

* ``pool`` (int64, (num_gpu_blocks + 2, 6)): per block its holders (``P_REF``), whether it is
  registered in the cache (``P_HAS``) and under which key (``P_KEY``), its links in the free
  queue (``P_NXT``, ``P_PRV``; rows ``num_gpu_blocks`` and ``num_gpu_blocks + 1`` are the
  queue's head and tail sentinels) and the next block registered under the same key
  (``P_DUP``, -1 if none: vLLM keeps duplicates, and a lookup takes the first registered);
* ``kmap``: a numba typed dict, key → the first block registered under it;
* a request's blocks are a slice of the arena ``rb`` and its known block keys a slice of
  ``rk`` (offsets and counts in its row of the kernel's request table; see
  :mod:`duetime.engine.kernel`). A full block past its known keys gets a key of its own made
  from the request's ``uid`` (:func:`own_key`), as the reference form's ``(id, index)``.

Keys are int64 (vLLM's block hashes, or the workloads' 64-bit chained hashes).
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit

P_REF, P_HAS, P_KEY, P_NXT, P_PRV, P_DUP = range(6)
POOL_COLUMNS = 6
OWN_KEY_BLOCKS = 1 << 20  # own keys: -(uid * OWN_KEY_BLOCKS + index) - 1


def new_pool(num_blocks: int) -> np.ndarray:
    """A pool with every block but the null block (0) free, in id order."""
    pool = np.zeros((num_blocks + 2, POOL_COLUMNS), dtype=np.int64)
    pool[:, P_DUP] = -1
    chain = np.array([num_blocks, *range(1, num_blocks), num_blocks + 1], dtype=np.int64)
    pool[chain[:-1], P_NXT] = chain[1:]
    pool[chain[1:], P_PRV] = chain[:-1]
    return pool


def new_key_map():
    """An empty key → block map (a numba typed dict; a plain dict without numba)."""
    try:
        from numba import types
        from numba.typed import Dict
    except ImportError:  # pragma: no cover - no numba
        return {}
    return Dict.empty(key_type=types.int64, value_type=types.int64)


def queue_of(pool: np.ndarray) -> list[int]:
    """The free queue, head first (tests)."""
    head, tail = pool.shape[0] - 2, pool.shape[0] - 1
    out, b = [], int(pool[head, P_NXT])
    while b != tail:
        out.append(b)
        b = int(pool[b, P_NXT])
    return out


@njit(cache=True, nogil=True, inline="always")
def own_key(uid, i):  # pragma: no cover - jit
    """The key of a request's full block ``i`` past its known keys."""
    return -(uid * OWN_KEY_BLOCKS + i) - 1


@njit(cache=True, nogil=True, inline="always")
def req_key(rk, koff, nkey, uid, i):  # pragma: no cover - jit
    return rk[koff + i] if i < nkey else own_key(uid, i)


@njit(cache=True, nogil=True, inline="always")
def _unlink(pool, b):  # pragma: no cover - jit
    p = pool[b, P_PRV]
    n = pool[b, P_NXT]
    pool[p, P_NXT] = n
    pool[n, P_PRV] = p


@njit(cache=True, nogil=True, inline="always")
def _insert_after(pool, p, b):  # pragma: no cover - jit
    n = pool[p, P_NXT]
    pool[p, P_NXT] = b
    pool[b, P_PRV] = p
    pool[b, P_NXT] = n
    pool[n, P_PRV] = b


@njit(cache=True, nogil=True)
def _evict(pool, kmap, b):  # pragma: no cover - jit
    """Block ``b`` leaves the cache (it is being reused)."""
    k = pool[b, P_KEY]
    first = kmap[k]
    if first == b:
        nxt = pool[b, P_DUP]
        if nxt < 0:
            del kmap[k]
        else:
            kmap[k] = nxt
    else:
        p = first
        while pool[p, P_DUP] != b:
            p = pool[p, P_DUP]
        pool[p, P_DUP] = pool[b, P_DUP]
    pool[b, P_DUP] = -1
    pool[b, P_HAS] = 0


@njit(cache=True, nogil=True)
def pool_allocate(pool, kmap, rb, at, count):  # pragma: no cover - jit
    """``rb[at:at + count]`` = blocks from the head of the free queue, each evicted from the
    cache if it held a key, each held once (the caller checked the free count and subtracts
    ``count`` from it)."""
    head = pool.shape[0] - 2
    for j in range(count):
        b = pool[head, P_NXT]
        _unlink(pool, b)
        if pool[b, P_HAS]:
            _evict(pool, kmap, b)
        pool[b, P_REF] = 1
        rb[at + j] = b


@njit(cache=True, nogil=True)
def pool_touch(pool, rb, at, count):  # pragma: no cover - jit
    """Hit blocks ``rb[at:at + count]`` get one more holder; returns how many had none (they
    leave the free queue: subtract from the free count)."""
    left = 0
    for j in range(count):
        b = rb[at + j]
        if pool[b, P_REF] == 0:
            _unlink(pool, b)
            left += 1
        pool[b, P_REF] += 1
    return left


@njit(cache=True, nogil=True)
def pool_release(pool, rb, at, count):  # pragma: no cover - jit
    """A request gives back its blocks ``rb[at:at + count]`` (freed last-first): one nobody
    holds any more goes to the front of the queue without a key, to the tail with one.
    Returns how many joined the queue (add to the free count)."""
    tail = pool.shape[0] - 1
    p = pool.shape[0] - 2  # unhashed ones go to the front, in the order freed
    back = 0
    for j in range(count - 1, -1, -1):
        b = rb[at + j]
        pool[b, P_REF] -= 1
        if pool[b, P_REF] == 0:
            back += 1
            if pool[b, P_HAS]:
                _insert_after(pool, pool[tail, P_PRV], b)
            else:
                _insert_after(pool, p, b)
                p = b
    return back


@njit(cache=True, nogil=True)
def pool_cache(pool, kmap, b, key):  # pragma: no cover - jit
    """Register full block ``b`` (no key yet) under ``key``, after any block that has it."""
    pool[b, P_KEY] = key
    pool[b, P_HAS] = 1
    pool[b, P_DUP] = -1
    if key in kmap:
        p = kmap[key]
        while pool[p, P_DUP] >= 0:
            p = pool[p, P_DUP]
        pool[p, P_DUP] = b
    else:
        kmap[key] = b


@njit(cache=True, nogil=True)
def pool_lookup(kmap, rk, koff, nkey, uid, n, rb, at):  # pragma: no cover - jit
    """The longest cached run of a request's first ``n`` full blocks: written to
    ``rb[at:]``; returns its length."""
    for i in range(n):
        k = req_key(rk, koff, nkey, uid, i)
        if k not in kmap:
            return i
        rb[at + i] = kmap[k]
    return n


@njit(cache=True, nogil=True)
def pool_evictable(pool, rb, at, count):  # pragma: no cover - jit
    """How many of ``rb[at:at + count]`` nobody holds (a hit on them costs a free block)."""
    e = 0
    for j in range(count):
        if pool[rb[at + j], P_REF] == 0:
            e += 1
    return e
