"""The prefix cache in a snapshot's JSON form (version 2), both ways.

What a forecast needs to replay vLLM's cache, and what an exporter can read from vLLM
(``KVCacheManager`` / ``BlockPool``) or from duetime's own engine:

* per resident request, ``block_hashes``: the keys of the full blocks of its sequence (prompt,
  then output), in order. A running request holds ``ceil(computed_tokens / block_size)``
  blocks; those full of known tokens are registered in the cache under these keys;
* ``prefix_cache.cached_free``: the keys of the cached blocks nobody holds, in the order vLLM
  would evict them (the free queue from its head); ``prefix_cache.free_empty``: how many free
  blocks hold nothing. vLLM puts freed blocks without a key at the front of its free queue
  and cached ones at the back, so the queue is exactly those empty blocks, then the cached
  ones (the null block is never in it). Free blocks beyond the listed ones hold nothing.

Keys are opaque: a JSON integer (within int64) is used as it is, a string is hashed to one
(blake2b, 8 bytes); a probe's ``prompt_hashes`` are read the same way, so give them in the
form the requests use. Which blocks running requests share: with ``block_ids`` (per running
request, the ids of the blocks it holds, in order, as vLLM's ``KVCacheBlock.block_id``),
requests that list one id share that block; without them, running requests that list the
same key at the same position are read as sharing it (the way a prefix hit shares it), which
is wrong where vLLM holds duplicates (two requests computed the same block at once): then the
free count is too high by the duplicates, and a forecast that frees them differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from duetime.engine import block_pool_kernel as pk
from duetime.engine.config import SchedulerConfig
from duetime.engine.kv import blocks_for
from duetime.engine.prefix_state import (
    C_BOFF,
    C_HELD,
    C_KOFF,
    C_NCACHED,
    C_NKEY,
    C_UID,
    OwnArenas,
    PrefixState,
)

INT64 = (-(1 << 63), (1 << 63) - 1)


def block_key(value: Any) -> int:
    """One block key from JSON: an int as it is, a string hashed; else ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"a block hash must be a string or an integer, got {value!r}")
    if isinstance(value, int | np.integer):
        v = int(value)
        if not INT64[0] <= v <= INT64[1]:
            raise ValueError(f"integer block hash {v} does not fit 64 bits (use a string)")
        return v
    if isinstance(value, str):
        return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(),
                              "little", signed=True)
    raise ValueError(f"a block hash must be a string or an integer, got {value!r}")


def block_keys(values: Sequence[Any] | np.ndarray | None) -> np.ndarray | None:
    """Block keys from JSON values (see :func:`block_key`); None stays None."""
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == np.int64:
        return values
    if all(type(v) is int for v in values):  # the common form (to_dict writes integers)
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass  # one is too big: block_key names it
    return np.array([block_key(v) for v in values], dtype=np.int64)


def build_state(config: SchedulerConfig, prompt: np.ndarray, output: np.ndarray,
                computed: np.ndarray, n_running: int, hashes: list[np.ndarray],
                cached_free: np.ndarray, free_empty: int,
                block_ids: list[list[int]] | None = None) -> PrefixState:
    """A cache of its own for a snapshot read from JSON (see the module doc). Rows: running,
    then waiting requests; ``hashes`` their keys; ``block_ids`` the running requests' block
    ids, if known. Raises ValueError naming the field."""
    bs, usable = config.block_size, config.usable_blocks
    n = len(prompt)
    pool = pk.new_pool(config.num_gpu_blocks)
    kmap = pk.new_key_map(config.num_gpu_blocks)
    rows = np.zeros((n, 6), dtype=np.int64)
    rb: list[int] = []
    # a block held by a running request: by its id, else by (position, key)
    shared: dict[Any, int] = {}
    next_block = 1
    for i in range(n):
        keys = hashes[i]
        held = blocks_for(int(computed[i]), bs) if i < n_running else 0
        registered = min(min(int(computed[i]), int(prompt[i] + output[i])) // bs, len(keys),
                         held)
        ids = block_ids[i] if block_ids is not None and i < n_running else None
        if ids is not None and len(ids) != held:
            raise ValueError(f"running[{i}].block_ids: {len(ids)} ids, but the request holds "
                             f"{held} blocks (ceil(computed_tokens / block_size))")
        rows[i, C_BOFF] = len(rb)
        rows[i, C_HELD] = held
        rows[i, C_NCACHED] = registered
        rows[i, C_UID] = i + 1
        for j in range(held):
            name = ids[j] if ids is not None else (j, int(keys[j])) if j < registered else None
            b = shared.get(name) if name is not None else None
            if b is None:
                b = next_block
                next_block += 1
                if next_block - 1 > usable:
                    raise ValueError(f"running: the running requests hold more than the "
                                     f"instance's {usable} usable KV blocks")
                if name is not None:
                    shared[name] = b
            if j < registered:
                if not pool[b, pk.P_HAS]:
                    pk.pool_cache(pool, kmap, b, keys[j], None)
                elif pool[b, pk.P_KEY] != keys[j]:
                    raise ValueError(f"running[{i}].block_ids: block {ids[j]} is listed "
                                     "under two different hashes")
            pool[b, pk.P_REF] += 1
            rb.append(b)
    n_held = next_block - 1
    n_free = usable - n_held
    if free_empty + len(cached_free) > n_free:
        raise ValueError(f"prefix_cache: free_empty ({free_empty}) + cached_free "
                         f"({len(cached_free)}) exceed the {n_free} blocks the running "
                         "requests leave free")
    # the free queue: blocks holding nothing, then the cached ones in eviction order
    empty = np.arange(next_block, next_block + n_free - len(cached_free), dtype=np.int64)
    cached = np.arange(next_block + len(empty), next_block + n_free, dtype=np.int64)
    head, tail = config.num_gpu_blocks, config.num_gpu_blocks + 1
    chain = np.concatenate(([head], empty, cached, [tail])).astype(np.int64)
    pool[:, pk.P_NXT] = 0
    pool[:, pk.P_PRV] = 0
    pool[chain[:-1], pk.P_NXT] = chain[1:]
    pool[chain[1:], pk.P_PRV] = chain[:-1]
    pk.cache_many(pool, kmap, cached, cached_free)
    rk = np.concatenate(hashes) if n else np.zeros(0, dtype=np.int64)
    rows[:, C_NKEY] = [len(h) for h in hashes]
    rows[:, C_KOFF] = np.cumsum(rows[:, C_NKEY]) - rows[:, C_NKEY]
    rb_arr, rk_arr = np.array(rb, dtype=np.int64), rk.astype(np.int64)
    return PrefixState(pool, kmap, rb_arr, rk_arr, rows, n_free, n + 1,
                       pk.new_undo(pool, kmap), lambda: True, OwnArenas(rb_arr, rk_arr))


def export_state(state: PrefixState, n_running: int
                 ) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """Per resident request its block keys, per running request its block ids, and the
    ``prefix_cache`` object, of a snapshot's cache (see the module doc)."""
    if not state.is_current():
        raise ValueError("snapshot: the engine has changed since this snapshot was taken")
    rows, rk = state.rows, state.rk
    keys = []
    for r in rows:  # its known keys, and its own keys of the blocks it registered past them
        known = rk[int(r[C_KOFF]):int(r[C_KOFF] + r[C_NKEY])].tolist()
        known += [pk.own_key(int(r[C_UID]), i) for i in range(len(known), int(r[C_NCACHED]))]
        keys.append(known)
    ids = [state.rb[int(r[C_BOFF]):int(r[C_BOFF] + r[C_HELD])].tolist()
           for r in rows[:n_running]]
    out = np.empty(state.free, dtype=np.int64)
    pk.reclaim(state.pool, state.kmap, state.undo)  # (what a forecaster kept of its replay)
    n, empty = pk.free_queue_keys(state.pool, out)
    return keys, ids, {"cached_free": out[:n].tolist(), "free_empty": int(empty)}
