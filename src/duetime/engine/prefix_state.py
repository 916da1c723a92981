"""The prefix cache behind a snapshot of a live engine, and the replay arrays a forecast builds
from it.

A forecast with prefix caching must replay the cache exactly: which blocks a waiting request
(and the probe) hits depends on what the requests ahead register and evict on the way. Copying
the whole cache for every forecast would cost time in its size (50,000 blocks: milliseconds),
so a snapshot *borrows* the engine's block pool and key map: the replay changes them in place
and puts back what it changed (:func:`duetime.engine.block_pool_kernel.undo_all`), in time and
memory bounded by what it touched. A borrowed state is valid only while the engine has not
changed since the snapshot (its revision); a forecast from a stale one is refused. One replay
at a time holds the borrowed cache: a forecaster may keep it between calls
(:func:`duetime.engine.block_pool_kernel.lease`), and the next borrower takes it back first
(:func:`~duetime.engine.block_pool_kernel.reclaim`).

Nothing of the arenas is copied either. A forecast's block arena is the engine's own: each
resident request's blocks at the snapshot stay where the engine keeps them (columns ``H0``,
``B0OFF`` of the kernel's table), and the blocks it gets in the replay go to a slice of its
own in the free space past the engine's slices (which the engine overwrites when it places
its next request: the snapshot is stale by then). The replay writes nowhere else: a slice
has room for all the request's blocks, for when it is preempted and admitted again. Copying the 34,000 held blocks of a
200-request snapshot cost more than the rest of a first forecast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine._jit import njit
from duetime.engine.block_pool_kernel import reclaim


@njit(cache=True, nogil=True)
def fill_columns(req, rows, max_len, bs, at, n_probe_keys, probe_uid):  # pragma: no cover - jit
    """Fill the caching columns of a forecast's request table from the snapshot's ``rows``
    (see the C_* columns; the table's other rows are new: the probe's), each request's new
    blocks in a slice of the arena from ``at`` on. Returns the arena's end, or -1 if a row
    holds other than its computed tokens' blocks (a bug)."""
    k = rows.shape[0]
    for r in range(req.shape[0]):
        stop = req[r, kn.STOP] if req[r, kn.STOP] > req[r, kn.OUTPUT] else req[r, kn.OUTPUT]
        tokens = req[r, kn.PROMPT] + stop + 1
        if tokens > max_len:
            tokens = max_len
        cap = (tokens + bs - 1) // bs
        h0 = 0
        if r < k:
            h0 = rows[r, C_HELD]
            if h0 != req[r, kn.HELD]:
                return -1
            req[r, kn.NCACHED] = rows[r, C_NCACHED]
            req[r, kn.UID] = rows[r, C_UID]
            req[r, kn.NKEY] = rows[r, C_NKEY]
            req[r, kn.B0OFF] = rows[r, C_BOFF]
        else:
            req[r, kn.NKEY] = n_probe_keys
            req[r, kn.UID] = probe_uid
        if cap < h0:
            cap = h0
        # a slice for all its blocks: those past h0 go there, and all of them once it was
        # preempted (gave its blocks back, h0 = 0) and admitted again
        req[r, kn.H0] = h0
        req[r, kn.BOFF] = at
        req[r, kn.BCAP] = cap
        at += cap
    return at


def with_room(a: np.ndarray, used: int, more: int) -> np.ndarray:
    """``a``, or a copy at least twice as long, with room for ``more`` entries past ``used``."""
    if used + more <= a.shape[0]:
        return a
    out = np.zeros(max(used + more, 2 * a.shape[0], 1024), dtype=a.dtype)
    out[:used] = a[:used]
    return out


class OwnArenas:
    """The block and key arenas of a cache that has no engine (a snapshot read from JSON):
    :attr:`PrefixState.arena` over them."""

    def __init__(self, rb: np.ndarray, rk: np.ndarray) -> None:
        self.rb, self.rk = rb, rk
        self.rb_used, self.rk_used = rb.shape[0], rk.shape[0]

    def __call__(self, blocks: int, keys: int) -> tuple[np.ndarray, int, np.ndarray, int]:
        self.rb = with_room(self.rb, self.rb_used, blocks)
        self.rk = with_room(self.rk, self.rk_used, keys)
        return self.rb, self.rb_used, self.rk, self.rk_used


# columns of PrefixState.rows, one row per resident request (running, then waiting)
C_BOFF, C_HELD, C_NCACHED, C_KOFF, C_NKEY, C_UID = range(6)


@dataclass(frozen=True, slots=True)
class PrefixState:
    """A live engine's cache as a snapshot saw it: its pool, key map and arenas (borrowed),
    per resident request its slice columns (copied), the free count, and a uid no request
    has (for the probe's own keys)."""

    pool: np.ndarray
    kmap: Any
    rb: np.ndarray
    rk: np.ndarray
    rows: np.ndarray          # (running + waiting, 6): see the C_* columns
    free: int
    next_uid: int
    undo: np.ndarray  # the engine's undo log (block_pool_kernel.new_undo): a replay puts it back
    is_current: Callable[[], bool]  # the engine has not changed since
    # the block and key arenas with room for (blocks, keys) more entries past their used
    # parts: (blocks, where their free space starts, keys, where theirs starts); the engine's
    # (it may grow them), see the module doc
    arena: Callable[[int, int], tuple[np.ndarray, int, np.ndarray, int]]

    def replay_arrays(self, req: np.ndarray, st: np.ndarray, bs: int, max_len: int,
                      probe_hashes: np.ndarray | None) -> tuple:
        """Fill the caching columns of a forecast's request table ``req`` (rows as
        :func:`duetime.engine.scheduler_kernel.prepare` made them: running, waiting, then the probe's
        spare row) and its free count; return the pool arguments of the kernel (pool, key
        map, arenas, undo bookkeeping). ``probe_hashes``: int64 keys."""
        if not self.is_current():
            raise ValueError("snapshot: the engine has changed since this snapshot was taken; "
                             "a forecast with prefix caching needs a current one")
        reclaim(self.pool, self.kmap, self.undo)  # (what another forecaster kept)
        n = req.shape[0]
        k = self.rows.shape[0]
        rows = self.rows
        # the slices of the new blocks: at most each request's whole sequence (max_model_len)
        room = int(np.minimum(req[:, kn.PROMPT] + np.maximum(req[:, kn.STOP], req[:, kn.OUTPUT])
                              + 1, max_len).sum()) // bs + n + 1
        n_probe = 0 if probe_hashes is None else len(probe_hashes)
        rb, at, rk, kat = self.arena(room, n_probe)
        end = fill_columns(req, rows, max_len, bs, at, n_probe, self.next_uid)
        if end < 0:  # pragma: no cover - a bug
            raise AssertionError("prefix state: held blocks differ from the computed tokens")
        if end > at + room:  # pragma: no cover - a bug
            raise AssertionError("prefix state: the slices overrun the arena's free space")
        # the known keys of each request: where the engine keeps them (the probe's past them)
        req[:k, kn.KOFF] = rows[:, C_KOFF]
        req[k:, kn.KOFF] = kat
        if n_probe:
            rk[kat:kat + n_probe] = probe_hashes
        st[kn.FREE] = self.free
        return self.pool, self.kmap, rb, rk, self.undo
