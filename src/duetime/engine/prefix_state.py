"""The prefix cache behind a snapshot of a live engine, and the replay arrays a forecast builds
from it.

A forecast with prefix caching must replay the cache exactly: which blocks a waiting request
(and the probe) hits depends on what the requests ahead register and evict on the way. Copying
the whole cache for every forecast would cost time in its size (50,000 blocks: milliseconds),
so a snapshot *borrows* the engine's block pool and key map: the replay changes them in place
and puts back what it changed (:func:`duetime.engine.pool_kernel.undo_all`), in time and
memory bounded by what it touched. A borrowed state is valid only while the engine has not
changed since the snapshot (its revision); a forecast from a stale one is refused.

Only the resident requests' own slices of the engine's arenas are copied (their block ids and
known block keys), laid out afresh with room for the stop lengths the forecast assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.engine import kernel as kn
from duetime.engine._jit import njit
from duetime.engine.kv import blocks_for


@njit(cache=True, nogil=True)
def copy_slices(src, src_off, lens, dst, dst_off):  # pragma: no cover - jit
    """``dst[dst_off[i]:][:lens[i]] = src[src_off[i]:][:lens[i]]`` for every i (numpy's fancy
    indexing took ~4x as long on the 70,000 entries of a 200-request snapshot)."""
    for i in range(lens.shape[0]):
        a, b = src_off[i], dst_off[i]
        for j in range(lens[i]):
            dst[b + j] = src[a + j]


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
    undo: np.ndarray  # the engine's undo log (pool_kernel.new_undo): a replay puts it back
    is_current: Callable[[], bool]  # the engine has not changed since

    def replay_arrays(self, req: np.ndarray, st: np.ndarray, bs: int, max_len: int,
                      probe_hashes: Sequence[int] | np.ndarray | None) -> tuple:
        """Fill the caching columns of a forecast's request table ``req`` (rows as
        :func:`duetime.engine.kernel.prepare` made them: running, waiting, then the probe's
        spare row) and its free count; return the pool arguments of the kernel (pool, key
        map, fresh arenas, undo bookkeeping)."""
        if not self.is_current():
            raise ValueError("snapshot: the engine has changed since this snapshot was taken; "
                             "a forecast with prefix caching needs a current one")
        n = req.shape[0]
        k = self.rows.shape[0]
        rows = self.rows
        held = rows[:, C_HELD]
        if not np.array_equal(held, req[:k, kn.HELD]):  # pragma: no cover - a bug
            raise AssertionError("prefix state: held blocks differ from the computed tokens")
        # the blocks each request holds, in fresh slices sized for the forecast's stops
        tokens = req[:, kn.PROMPT] + np.maximum(req[:, kn.STOP], req[:, kn.OUTPUT]) + 1
        caps = blocks_for(np.minimum(tokens, max_len), bs)
        boff = np.zeros(n, dtype=np.int64)
        np.cumsum(caps[:-1], out=boff[1:])
        rb = np.empty(int(caps.sum()), dtype=np.int64)
        copy_slices(self.rb, rows[:, C_BOFF], held, rb, boff)
        # the known keys of each request (read only: the engine's own array, unless the
        # probe's keys must join them)
        nkey = rows[:, C_NKEY]
        if probe_hashes is None:
            rk, koff, total = self.rk, np.zeros(n, dtype=np.int64), 0
            koff[:k] = rows[:, C_KOFF]
        else:
            probe = np.asarray(probe_hashes, dtype=np.int64)
            total = int(nkey.sum())
            koff = np.full(n, total, dtype=np.int64)
            koff[:k] = np.cumsum(nkey) - nkey
            rk = np.empty(total + len(probe), dtype=np.int64)
            copy_slices(self.rk, rows[:, C_KOFF], nkey, rk, koff)
            rk[total:] = probe
        req[:, kn.BOFF] = boff
        req[:, kn.BCAP] = caps
        req[:k, kn.NCACHED] = rows[:, C_NCACHED]
        req[:k, kn.UID] = rows[:, C_UID]
        req[:, kn.KOFF] = koff
        req[:k, kn.NKEY] = nkey
        req[k:, kn.NKEY] = 0 if probe_hashes is None else len(probe_hashes)
        req[k:, kn.UID] = self.next_uid
        st[kn.FREE] = self.free
        return self.pool, self.kmap, rb, rk, self.undo
