"""What a simulated router knows of an instance's prefix cache, and the hashes it is given.

A :class:`~duetime.sim.instance.SimInstance` whose engine caches prefixes carries a
``prefix_index`` (:class:`~duetime.estimate.prefix_index.PrefixIndex`) of one of two kinds:

* ``precise`` (:class:`~duetime.estimate.prefix_index.EngineCacheIndex`): the engine's own cache, read at the moment of the
  decision -- what a router fed by vLLM's KV events (llm-d's precise prefix-cache scorer) knows;
  ``record`` is a no-op;
* ``estimated``: an :class:`~duetime.estimate.prefix_index.EstimatedPrefixIndex` sized from the
  instance's KV config, which learns only from the policies' ``record`` calls (llm-d's
  approximate prefix-cache producer, SGLang's router).

An instance without caching has none (``None``): cache-aware policies then match nothing there.

:func:`keys_by_block_size` makes a request's ``prompt_hashes`` callable: block size -> the
chained hashes of its prompt's full blocks, memoised per block size.
"""

from __future__ import annotations

import numpy as np

from duetime.engine.engine import Engine
from duetime.estimate.base import KeysByBlockSize
from duetime.estimate.prefix_index import EngineCacheIndex, EstimatedPrefixIndex, PrefixIndex
from duetime.workload.requests import RequestSet
from duetime.workload.segments import Segments, block_hashes, sequence_hashes

CACHE_VIEWS = ("precise", "estimated")


def check_cache_view(view: str) -> str:
    if view not in CACHE_VIEWS:
        raise ValueError(f"cache_view: {' or '.join(repr(v) for v in CACHE_VIEWS)}, "
                         f"got {view!r}")
    return view


def prefix_index_for(engine: Engine, view: str) -> PrefixIndex | None:
    """The router's view of ``engine``'s prefix cache (``None`` when it does not cache)."""
    check_cache_view(view)
    if not engine.caching:
        return None
    if view == "precise":
        return EngineCacheIndex(engine)
    return EstimatedPrefixIndex(engine.config.block_size, engine.config.usable_blocks)


def keys_by_block_size(segments: Segments) -> KeysByBlockSize:
    """A request's ``prompt_hashes`` from its segments (``block_hashes`` per block size)."""
    return KeysByBlockSize(lambda block_size: block_hashes(segments, block_size))


def engine_hashes(requests: RequestSet, i: int, output_tokens: int,
                  block_size: int) -> np.ndarray:
    """What the engine is given for request ``i`` answered with ``output_tokens`` tokens: the
    hashes of its prompt and answer (:func:`~duetime.workload.segments.sequence_hashes`: what
    its cache holds afterwards, which a later turn of its session shares), or of its prompt
    alone when the request set does not say which segment the answer forms."""
    if requests.answer_segment is None:
        return block_hashes(requests.segments[i], block_size)
    return sequence_hashes(requests, i, output_tokens, block_size)
