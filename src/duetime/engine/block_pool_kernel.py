"""The block pool with prefix caching, compiled: the kernel's form of
:mod:`duetime.engine.block_pool` (the same rules, operation for operation; tested against it).

Layout:

* ``pool`` (int64, (num_gpu_blocks + 2, 7)): per block its holders (``P_REF``), whether it is
  registered in the cache (``P_HAS``) and under which key (``P_KEY``), its links in the free
  queue (``P_NXT``, ``P_PRV``; rows ``num_gpu_blocks`` and ``num_gpu_blocks + 1`` are the
  queue's head and tail sentinels), the next block registered under the same key
  (``P_DUP``, -1 if none: vLLM keeps duplicates, and a lookup takes the first registered)
  and the undo log's mark (``P_GEN``, below);
* ``kmap`` (int64, (capacity, 3)): key → the first block registered under it (and the undo
  log's mark, ``T_GEN``), an
  open-addressing hash table (linear probing, deletion by backward shift: no tombstones;
  block 0 marks an empty slot, the null block never holds a key). Its capacity is fixed at
  twice the blocks or more (a key exists only while a block holds it), so it never grows. A
  numba typed dict did the same at ~5x the cost per operation, which the forecasts felt;
* a request's blocks are a slice of the arena ``rb`` and its known block keys a slice of
  ``rk`` (offsets and counts in its row of the kernel's request table; see
  :mod:`duetime.engine.scheduler_kernel`). A full block past its known keys gets a key of its own made
  from the request's ``uid`` (:func:`own_key`), as the reference form's ``(id, index)``.

Keys are int64 (vLLM's block hashes, or the workloads' 64-bit chained hashes).

A forecast replays on the engine's own pool and key table, then puts them back: every function
that writes takes ``undo`` — ``None`` for the engine's own steps (numba then compiles the
function without the bookkeeping), or the engine's undo log (:func:`new_undo`): a pool row or
table slot is saved before its first change in the replay (marked, in its own row, with the
replay's generation, so nothing is cleared between replays), and :func:`undo_all` restores
them. Time
and memory are bounded by what the replay touches, not by the size of the cache.

A forecaster may *keep* its changes between calls, to extend its replay later without
replaying from the snapshot again: it writes its token in the log's owner slot
(:func:`lease`). Whoever needs the pool as the engine has it — the engine before it steps or
reads its cache, another replay before it borrows — first calls :func:`reclaim`, which puts
back whatever is held; the holder sees the generation moved on and starts afresh next time.
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit

P_REF, P_HAS, P_KEY, P_NXT, P_PRV, P_DUP, P_GEN = range(7)
POOL_COLUMNS = 7
SAVED = 6  # the columns a replay saves and puts back (not P_GEN: see _save)
T_GEN = 2  # the key table's column of the same mark
OWN_KEY_BLOCKS = 1 << 20  # own keys: -(uid * OWN_KEY_BLOCKS + index) - 1
_MIX = 0x2545F4914F6CDD1D  # an odd 63-bit multiplier (int64 in numba and in Python alike)
_LOW48 = (1 << 48) - 1


def new_pool(num_blocks: int) -> np.ndarray:
    """A pool with every block but the null block (0) free, in id order."""
    pool = np.zeros((num_blocks + 2, POOL_COLUMNS), dtype=np.int64)
    pool[:, P_DUP] = -1
    chain = np.array([num_blocks, *range(1, num_blocks), num_blocks + 1], dtype=np.int64)
    pool[chain[:-1], P_NXT] = chain[1:]
    pool[chain[1:], P_PRV] = chain[:-1]
    return pool


@njit(cache=True, nogil=True)
def new_key_map(num_blocks):  # pragma: no cover - jit
    """An empty key table for a pool of ``num_blocks`` blocks (or keys)."""
    cap = 16
    while cap < 2 * num_blocks:
        cap *= 2
    return np.zeros((cap, 3), dtype=np.int64)


def key_items(kmap: np.ndarray) -> dict[int, int]:
    """The key table as a dict, key → first block (tests)."""
    used = kmap[:, 1] != 0
    return dict(zip(kmap[used, 0].tolist(), kmap[used, 1].tolist(), strict=True))


# the undo log: one flat int64 array (one argument is cheaper to pass through every call than
# a tuple of five): a header, then the saved rows (block, its 6 data columns) and slots
# (slot, key, block), then the key
# events: (stamp, key, +1 added / -1 removed), stamped by the kernel with 2 x step (while it
# schedules) or 2 x step + 1 (after: outputs applied, blocks freed); a forecaster reads when a
# probe's keys were cached from them (counted past the capacity: an overflow shows)
# (U_OWNER: the token of the forecaster that keeps its changes, 0 if none; see lease)
(U_GEN, U_NPOOL, U_NTAB, U_SPOOL, U_STAB, U_STAMP, U_NEV, U_EV, U_EVCAP,
 U_OWNER) = range(10)
U_HEAD = 10


def new_undo(pool: np.ndarray, kmap: np.ndarray) -> np.ndarray:
    """The undo log of a pool and its key table (kept with them, reused by every replay; see
    the module doc)."""
    n, t = pool.shape[0], kmap.shape[0]
    spool = U_HEAD
    stab = spool + n * (SAVED + 1)
    ev = stab + t * 3
    evcap = 4 * n
    u = np.empty(ev + 3 * evcap, dtype=np.int64)
    u.fill(0)  # touched now, at the engine's creation: not page by page in a forecast
    u[U_GEN], u[U_SPOOL], u[U_STAB] = 1, spool, stab
    u[U_EV], u[U_EVCAP] = ev, evcap
    return u


@njit(cache=True, nogil=True)
def _event(undo, k, sign):  # pragma: no cover - jit
    n = undo[U_NEV]
    if n < undo[U_EVCAP]:
        at = undo[U_EV] + 3 * n
        undo[at] = undo[U_STAMP]
        undo[at + 1] = k
        undo[at + 2] = sign
    undo[U_NEV] = n + 1


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


@njit(cache=True, nogil=True)
def _save(pool, b, undo):  # pragma: no cover - jit
    """Block ``b``'s row is about to change: keep it if this is its first change. (The mark
    of the generation that saved it lives in the row itself, ``P_GEN``: a mark array of its
    own cost a cache miss more per block on a cache of 50,000 blocks, ~40% of a replay.)"""
    if undo is not None:  # noqa: SIM102 (alone, numba prunes it for undo=None)
        if pool[b, P_GEN] != undo[U_GEN]:
            pool[b, P_GEN] = undo[U_GEN]
            at = undo[U_SPOOL] + undo[U_NPOOL] * (SAVED + 1)
            undo[at] = b
            for c in range(SAVED):
                undo[at + 1 + c] = pool[b, c]
            undo[U_NPOOL] += 1


@njit(cache=True, nogil=True)
def _save_slot(kmap, i, undo):  # pragma: no cover - jit
    """Table slot ``i`` is about to change: keep it if this is its first change."""
    if undo is not None:  # noqa: SIM102 (alone, numba prunes it for undo=None)
        if kmap[i, T_GEN] != undo[U_GEN]:
            kmap[i, T_GEN] = undo[U_GEN]
            at = undo[U_STAB] + undo[U_NTAB] * 3
            undo[at] = i
            undo[at + 1] = kmap[i, 0]
            undo[at + 2] = kmap[i, 1]
            undo[U_NTAB] += 1


@njit(cache=True, nogil=True)
def undo_all(pool, kmap, undo):  # pragma: no cover - jit
    """Put back every row and slot a replay changed; the next replay starts a new
    generation."""
    for j in range(undo[U_NPOOL]):
        at = undo[U_SPOOL] + j * (SAVED + 1)
        b = undo[at]
        for c in range(SAVED):
            pool[b, c] = undo[at + 1 + c]
    for j in range(undo[U_NTAB]):
        at = undo[U_STAB] + j * 3
        i = undo[at]
        kmap[i, 0] = undo[at + 1]
        kmap[i, 1] = undo[at + 2]
    undo[U_NPOOL] = 0
    undo[U_NTAB] = 0
    undo[U_NEV] = 0
    undo[U_OWNER] = 0
    undo[U_GEN] += 1


def reclaim(pool: np.ndarray | None, kmap: np.ndarray | None, undo: np.ndarray | None) -> None:
    """Put back the changes a forecaster kept (see the module doc); nothing if none."""
    if undo is not None and (undo[U_OWNER] or undo[U_NPOOL] or undo[U_NTAB] or undo[U_NEV]):
        undo_all(pool, kmap, undo)


def lease(undo: np.ndarray, token: int) -> int:
    """The changes in the log are kept by ``token``'s holder (until :func:`reclaim`); returns
    the generation that holds them (the lease is the holder's while the log has it)."""
    undo[U_OWNER] = token
    return int(undo[U_GEN])


def holds(undo: np.ndarray, token: int, generation: int) -> bool:
    """Whether the pool still has the changes ``token``'s holder kept in ``generation``."""
    return bool(undo[U_OWNER] == token and undo[U_GEN] == generation)


@njit(cache=True, nogil=True)
def free_queue_keys(pool, out):  # pragma: no cover - jit
    """The keys of the cached blocks in the free queue, head first, into ``out``; returns
    (how many, how many free blocks hold no key)."""
    tail = pool.shape[0] - 1
    b = pool[pool.shape[0] - 2, P_NXT]
    n = empty = 0
    while b != tail:
        if pool[b, P_HAS]:
            out[n] = pool[b, P_KEY]
            n += 1
        else:
            empty += 1
        b = pool[b, P_NXT]
    return n, empty


# -- the key table ---------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _home(k, mask):  # pragma: no cover - jit
    """A key's home slot (the same in numba's wrapping int64 and in Python's exact ints: only
    low bits of the product are used)."""
    h = ((k ^ (k >> 31)) * _MIX) & _LOW48
    h ^= h >> 24
    return h & mask


@njit(cache=True, nogil=True)
def key_get(kmap, k):  # pragma: no cover - jit
    """The first block registered under ``k``, or -1."""
    mask = kmap.shape[0] - 1
    i = _home(k, mask)
    while True:
        v = kmap[i, 1]
        if v == 0:
            return -1
        if kmap[i, 0] == k:
            return v
        i = (i + 1) & mask


@njit(cache=True, nogil=True)
def key_put(kmap, k, v):  # pragma: no cover - jit
    """``k`` → ``v`` (> 0) in a table of the same form that is not the pool's (no undo)."""
    _key_put(kmap, k, v, None)


@njit(cache=True, nogil=True)
def _key_put(kmap, k, b, undo):  # pragma: no cover - jit
    """``k`` → ``b`` (a new key, or a new first block for it)."""
    mask = kmap.shape[0] - 1
    i = _home(k, mask)
    while kmap[i, 1] != 0 and kmap[i, 0] != k:
        i = (i + 1) & mask
    _save_slot(kmap, i, undo)
    if undo is not None:  # noqa: SIM102 (alone, numba prunes it for undo=None)
        if kmap[i, 1] == 0:
            _event(undo, k, 1)
    kmap[i, 0] = k
    kmap[i, 1] = b


@njit(cache=True, nogil=True)
def _key_del(kmap, k, undo):  # pragma: no cover - jit
    """Remove ``k`` (present); later entries of its probe run shift back into the gap."""
    mask = kmap.shape[0] - 1
    i = _home(k, mask)
    while kmap[i, 0] != k or kmap[i, 1] == 0:
        if kmap[i, 1] == 0:  # (a bug: a corrupt pool would otherwise loop for ever)
            raise AssertionError("block_pool_kernel: removing a key that is not in the table")
        i = (i + 1) & mask
    _save_slot(kmap, i, undo)
    if undo is not None:
        _event(undo, k, -1)
    kmap[i, 1] = 0
    j = i
    while True:
        j = (j + 1) & mask
        if kmap[j, 1] == 0:
            return
        h = _home(kmap[j, 0], mask)
        # the entry at j may fill the gap at i unless its home lies cyclically in (i, j]
        if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
            _save_slot(kmap, j, undo)
            kmap[i, 0] = kmap[j, 0]
            kmap[i, 1] = kmap[j, 1]
            kmap[j, 1] = 0
            i = j


@njit(cache=True, nogil=True)
def key_match(kmap, keys):  # pragma: no cover - jit
    """How many leading ``keys`` the table holds."""
    for i in range(keys.shape[0]):
        if key_get(kmap, keys[i]) < 0:
            return i
    return keys.shape[0]


# -- the free queue and the pool ------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _unlink(pool, b, undo):  # pragma: no cover - jit
    p = pool[b, P_PRV]
    n = pool[b, P_NXT]
    _save(pool, p, undo)
    _save(pool, n, undo)
    pool[p, P_NXT] = n
    pool[n, P_PRV] = p


@njit(cache=True, nogil=True)
def _insert_after(pool, p, b, undo):  # pragma: no cover - jit
    n = pool[p, P_NXT]
    _save(pool, p, undo)
    _save(pool, b, undo)
    _save(pool, n, undo)
    pool[p, P_NXT] = b
    pool[b, P_PRV] = p
    pool[b, P_NXT] = n
    pool[n, P_PRV] = b


@njit(cache=True, nogil=True)
def _evict(pool, kmap, b, undo):  # pragma: no cover - jit
    """Block ``b`` leaves the cache (it is being reused)."""
    k = pool[b, P_KEY]
    first = key_get(kmap, k)
    _save(pool, b, undo)
    if first == b:
        nxt = pool[b, P_DUP]
        if nxt < 0:
            _key_del(kmap, k, undo)
        else:
            _key_put(kmap, k, nxt, undo)
    else:
        p = first
        while pool[p, P_DUP] != b:
            p = pool[p, P_DUP]
            if p < 0:  # (a bug, as above)
                raise AssertionError("block_pool_kernel: a block missing from its key's chain")
        _save(pool, p, undo)
        pool[p, P_DUP] = pool[b, P_DUP]
    pool[b, P_DUP] = -1
    pool[b, P_HAS] = 0


@njit(cache=True, nogil=True)
def pool_allocate(pool, kmap, rb, at, count, undo):  # pragma: no cover - jit
    """``rb[at:at + count]`` = blocks from the head of the free queue, each evicted from the
    cache if it held a key, each held once (the caller checked the free count and subtracts
    ``count`` from it)."""
    head = pool.shape[0] - 2
    for j in range(count):
        b = pool[head, P_NXT]
        _unlink(pool, b, undo)
        if pool[b, P_HAS]:
            _evict(pool, kmap, b, undo)
        _save(pool, b, undo)
        pool[b, P_REF] = 1
        rb[at + j] = b


@njit(cache=True, nogil=True)
def pool_touch(pool, rb, at, count, undo):  # pragma: no cover - jit
    """Hit blocks ``rb[at:at + count]`` get one more holder; returns how many had none (they
    leave the free queue: subtract from the free count)."""
    left = 0
    for j in range(count):
        b = rb[at + j]
        if pool[b, P_REF] == 0:
            _unlink(pool, b, undo)
            left += 1
        _save(pool, b, undo)
        pool[b, P_REF] += 1
    return left


@njit(cache=True, nogil=True)
def pool_release(pool, rb, at, count, undo, at0=0, h0=0):  # pragma: no cover - jit
    """A request gives back its blocks ``rb[at:at + count]`` (freed last-first): one nobody
    holds any more goes to the front of the queue without a key, to the tail with one.
    Returns how many joined the queue (add to the free count). (A forecast's request that held
    blocks at the snapshot keeps its first ``h0`` of them where the engine has them,
    ``rb[at0:at0 + h0]``; see :mod:`duetime.engine.prefix_state`.)"""
    tail = pool.shape[0] - 1
    p = pool.shape[0] - 2  # unhashed ones go to the front, in the order freed
    back = 0
    for j in range(count - 1, -1, -1):
        b = rb[at + j] if j >= h0 else rb[at0 + j]
        _save(pool, b, undo)
        pool[b, P_REF] -= 1
        if pool[b, P_REF] == 0:
            back += 1
            if pool[b, P_HAS]:
                _insert_after(pool, pool[tail, P_PRV], b, undo)
            else:
                _insert_after(pool, p, b, undo)
                p = b
    return back


@njit(cache=True, nogil=True)
def pool_cache(pool, kmap, b, key, undo):  # pragma: no cover - jit
    """Register full block ``b`` (no key yet) under ``key``, after any block that has it."""
    _save(pool, b, undo)
    pool[b, P_KEY] = key
    pool[b, P_HAS] = 1
    pool[b, P_DUP] = -1
    p = key_get(kmap, key)
    if p >= 0:
        n = 0
        while pool[p, P_DUP] >= 0:
            p = pool[p, P_DUP]
            n += 1
            if n > pool.shape[0]:  # (a bug, as above)
                raise AssertionError("block_pool_kernel: a cycle in a key's chain")
        _save(pool, p, undo)
        pool[p, P_DUP] = b
    else:
        _key_put(kmap, key, b, undo)


@njit(cache=True, nogil=True)
def cache_many(pool, kmap, blocks, keys):  # pragma: no cover - jit
    """Register ``blocks[i]`` under ``keys[i]``, in order (building a cache from a snapshot)."""
    for i in range(blocks.shape[0]):
        pool_cache(pool, kmap, blocks[i], keys[i], None)


# -- told by the instance (KV events) ------------------------------------------------------------

@njit(cache=True, nogil=True)
def store_free(pool, kmap, keys):  # pragma: no cover - jit
    """The instance cached ``keys`` (vLLM's ``BlockStored``): each key the pool does not hold
    takes a free block from the queue's head (evicting its key, as an allocation would) and
    joins the tail with it, most recent; a key already held stays as it is. Stops when no free
    block is left. Returns how many keys were placed (the free count is unchanged)."""
    head, tail = pool.shape[0] - 2, pool.shape[0] - 1
    placed = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        if key_get(kmap, k) >= 0:
            continue
        b = pool[head, P_NXT]
        if b == tail:
            break
        _unlink(pool, b, None)
        if pool[b, P_HAS]:
            _evict(pool, kmap, b, None)
        pool_cache(pool, kmap, b, k, None)
        _insert_after(pool, pool[tail, P_PRV], b, None)
        placed += 1
    return placed


@njit(cache=True, nogil=True)
def drop_keys(pool, kmap, keys):  # pragma: no cover - jit
    """The instance no longer caches ``keys`` (vLLM's ``BlockRemoved``): every block under
    each leaves the cache; a free one moves to the queue's front, as a block without a key (a
    held one stays held and, freed later, goes there too). Returns how many blocks."""
    head = pool.shape[0] - 2
    n = 0
    for i in range(keys.shape[0]):
        b = key_get(kmap, keys[i])
        while b >= 0:
            _evict(pool, kmap, b, None)
            if pool[b, P_REF] == 0:
                _unlink(pool, b, None)
                _insert_after(pool, head, b, None)
            n += 1
            b = key_get(kmap, keys[i])
    return n


@njit(cache=True, nogil=True)
def pool_lookup(kmap, rk, koff, nkey, uid, n, rb, at):  # pragma: no cover - jit
    """The longest cached run of a request's first ``n`` full blocks: written to
    ``rb[at:]``; returns its length."""
    for i in range(n):
        b = key_get(kmap, req_key(rk, koff, nkey, uid, i))
        if b < 0:
            return i
        rb[at + i] = b
    return n


@njit(cache=True, nogil=True)
def pool_evictable(pool, rb, at, count):  # pragma: no cover - jit
    """How many of ``rb[at:at + count]`` nobody holds (a hit on them costs a free block)."""
    e = 0
    for j in range(count):
        if pool[rb[at + j], P_REF] == 0:
            e += 1
    return e
