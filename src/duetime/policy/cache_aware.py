"""Cache-aware baselines: llm-d's default scorer profile and SGLang's router cache-aware policy.

Both read each candidate's prefix-cache index (:func:`~duetime.estimate.prefix_index_of`:
precise, or an :class:`~duetime.estimate.EstimatedPrefixIndex` learnt from routing) and the
request's ``prompt_hashes`` (the chained hashes of its prompt's full blocks for a block size),
and :meth:`~duetime.estimate.PrefixIndex.record` the prompt on the instance they choose (an
estimated index learns from the router's own decisions; a precise one ignores it). With no
hashes or no index an instance matches 0 blocks, and both policies fall back to their load
rule: ``prefix-load`` to its load scorers, ``cache-aware`` to the least loaded instance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from duetime.estimate.prefix_index import PrefixIndex, prefix_index_of
from duetime.policy.balancing import load_aware_score
from duetime.policy.base import Candidate, Decision, Described, Policy, RoutingRequest
from duetime.policy.registry import LOAD, PREFIX, SEED, Param


class _Hashes:
    """A request's prompt hashes per block size, computed once per decision (and cut to
    ``limit`` blocks when ``limit`` > 0)."""

    __slots__ = ("_by_size", "_fn", "_limit")

    def __init__(self, req: RoutingRequest, limit: int = 0) -> None:
        self._fn = req.prompt_hashes
        self._limit = limit
        self._by_size: dict[int, Sequence[int]] = {}

    def __call__(self, block_size: int) -> Sequence[int]:
        if self._fn is None:
            return ()
        got = self._by_size.get(block_size)
        if got is None:
            got = self._fn(block_size)
            if self._limit > 0:
                got = got[:self._limit]
            self._by_size[block_size] = got
        return got


def _indexes(cands: list[Candidate]) -> list[PrefixIndex | None]:
    return [prefix_index_of(c.view) for c in cands]


def _record(index: PrefixIndex | None, hashes: _Hashes) -> None:
    if index is not None:
        h = hashes(index.block_size)
        if len(h):
            index.record(h)


def queue_score(waiting: np.ndarray) -> np.ndarray:
    """llm-d's queue scorer: waiting requests min-max normalised over the candidates, 1 for
    the shortest queue and 0 for the longest; 1 for all when every queue is equally long
    (``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go``)."""
    lo, hi = waiting.min(), waiting.max()
    if hi == lo:
        return np.ones(len(waiting))
    return (hi - waiting) / (hi - lo)


def load_scorers(cands: list[Candidate], queue_weight: float, kv_weight: float,
                 load_weight: float) -> dict[str, np.ndarray]:
    """llm-d's load scorers, weighted, per candidate (those of weight 0 left out): ``queue``
    (:func:`queue_score`), ``kv`` (kv-cache-utilization: 1 - KV use) and ``load`` (load-aware:
    :func:`~duetime.policy.balancing.load_aware_score`)."""
    waiting = np.array([c.view.num_waiting for c in cands], dtype=float)
    parts: dict[str, np.ndarray] = {}
    if queue_weight:
        parts["queue"] = queue_weight * queue_score(waiting)
    if kv_weight:
        parts["kv"] = kv_weight * (1.0 - np.array([c.view.kv_usage for c in cands]))
    if load_weight:
        parts["load"] = load_weight * np.array([load_aware_score(int(w)) for w in waiting])
    return parts


PREFIX_WEIGHT = Param("prefix-weight", "prefix_weight", float, 3.0,
                      "weight of the prefix-cache scorer (matched / prompt blocks)", min=0.0)
QUEUE_WEIGHT = Param("queue-weight", "queue_weight", float, 2.0,
                     "weight of the queue scorer (waiting requests, min-max normalised)",
                     min=0.0)
KV_WEIGHT = Param("kv-weight", "kv_weight", float, 2.0,
                  "weight of the kv-cache-utilization scorer (1 - KV use)", min=0.0)
LOAD_WEIGHT = Param("load-weight", "load_weight", float, 0.0,
                    "weight of the load-aware scorer (0.5 (1 - min(waiting, 128) / 128))",
                    min=0.0)
MAX_PREFIX_BLOCKS = Param("max-prefix-blocks", "max_prefix_blocks", int, 256,
                          "prompt blocks matched and recorded at most (0: all)", min=0)


class PrefixLoad(Policy):
    """``prefix-load``: llm-d's default scheduling profile, a weighted sum of scorers in [0, 1],
    the highest total wins (random tie-break, as llm-d's ``max-score-picker``:
    ``picker/maxscore/picker.go`` shuffles before sorting), then the
    prompt's hashes are recorded on the chosen instance's index.

    Scorers (github.com/llm-d/llm-d-inference-scheduler, ``pkg/epp/framework/plugins/
    scheduling/scorer/``):

    * prefix-cache (``prefix/plugin.go``): matched blocks / prompt blocks, the prompt cut to
      its first ``max-prefix-blocks`` blocks (``defaultMaxPrefixBlocks = 256`` in
      ``requestcontrol/dataproducer/approximateprefix/types.go``); 0 with no blocks;
    * queue (``queuedepth/queue.go``): :func:`queue_score`;
    * kv-cache-utilization (``kvcacheutilization/kvcache_utilization.go``): 1 - KV use;
    * load-aware (``loadaware/load_aware.go``): :func:`~duetime.policy.balancing.
      load_aware_score`.

    Default weights: llm-d's built-in default profile, queue-scorer 2, kv-cache-utilization-
    scorer 2, prefix-cache-scorer 3 (``loadDefaultConfig`` in
    ``pkg/epp/config/loader/defaults.go``; the same weights in github.com/llm-d/llm-d
    ``guides/inference-scheduling/scheduler/inference-scheduling.values.yaml``). That profile
    has no load-aware scorer, so ``load-weight`` defaults to 0; llm-d's estimated-prefix sample
    (``deploy/config/epp-estimate-prefix-cache-config.yaml``: prefix-cache-scorer 1,
    load-aware-scorer 1) is ``prefix-weight=1, load-weight=1, queue-weight=0, kv-weight=0``.

    Differences: llm-d hashes the request text (4 characters a token) and its default index is
    the estimated one; here the hashes are the instance's token blocks and the index is whatever
    the view carries (see :class:`~duetime.estimate.EstimatedPrefixIndex`).
    """

    name = "prefix-load"
    summary = ("llm-d's default scorer profile: the best weighted sum of prefix-cache "
               "(matched / prompt blocks), queue, kv-cache-utilization and load-aware scores; "
               "random tie-break; records the prompt on the chosen instance's prefix index")
    params = (SEED, PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT, LOAD_WEIGHT, MAX_PREFIX_BLOCKS)
    consumes = frozenset({LOAD, PREFIX})

    def __init__(self, *, seed: int = 0, prefix_weight: float = PREFIX_WEIGHT.default,
                 queue_weight: float = QUEUE_WEIGHT.default,
                 kv_weight: float = KV_WEIGHT.default, load_weight: float = LOAD_WEIGHT.default,
                 max_prefix_blocks: int = MAX_PREFIX_BLOCKS.default) -> None:
        super().__init__(seed=seed)
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.load_weight = load_weight
        self.max_prefix_blocks = max_prefix_blocks

    def prefix_scores(self, indexes: list[PrefixIndex | None],
                      hashes: Callable[[int], Sequence[int]]) -> np.ndarray:
        """The prefix-cache scorer per instance: matched / prompt blocks (0 with none)."""
        out = np.zeros(len(indexes))
        for i, index in enumerate(indexes):
            if index is not None:
                h = hashes(index.block_size)
                if len(h):
                    out[i] = index.match(h) / len(h)
        return out

    def scorers(self, req: RoutingRequest, cands: list[Candidate],
                hashes: _Hashes) -> dict[str, np.ndarray]:
        """Each weighted scorer's weighted scores per candidate (those of weight 0 left
        out), and their ``score``, the total."""
        parts: dict[str, np.ndarray] = {}
        if self.prefix_weight:
            parts["prefix"] = self.prefix_weight * self.prefix_scores(_indexes(cands), hashes)
        parts.update(load_scorers(cands, self.queue_weight, self.kv_weight, self.load_weight))
        parts["score"] = sum(parts.values(), np.zeros(len(cands)))
        return parts

    def peek(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        hashes = _Hashes(req, self.max_prefix_blocks)
        return Decision(self._argmax_random(self.scorers(req, cands, hashes)["score"]))

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        hashes = _Hashes(req, self.max_prefix_blocks)
        i = self._argmax_random(self.scorers(req, cands, hashes)["score"])
        _record(prefix_index_of(cands[i].view), hashes)
        return Decision(i)

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        parts = self.scorers(req, cands, _Hashes(req, self.max_prefix_blocks))
        return Described({k: v.tolist() for k, v in parts.items()}, "weighted score",
                         "higher", "the best weighted sum of the scorers (" + ", ".join(
                             k for k in parts if k != "score") + "); ties at random")


CACHE_THRESHOLD = Param("cache-threshold", "cache_threshold", float, 0.3,
                        "the best prefix match rate (matched / prompt tokens) above which the "
                        "best match wins", min=0.0)
BALANCE_ABS = Param("balance-abs-threshold", "balance_abs_threshold", int, 64,
                    "imbalanced when max - min load exceeds this (and the relative test holds)",
                    min=0)
BALANCE_REL = Param("balance-rel-threshold", "balance_rel_threshold", float, 1.5,
                    "imbalanced when max load exceeds this x min load (and the absolute test "
                    "holds)", min=0.0)


class CacheAware(Policy):
    """``cache-aware``: SGLang's router cache-aware policy (github.com/sgl-project/sglang,
    ``sgl-router/src/policies/cache_aware.rs``, now ``sgl-model-gateway/src/policies/
    cache_aware.rs``), load = running + waiting:

    1. imbalanced (max - min > ``balance-abs-threshold`` and max > ``balance-rel-threshold`` x
       min): the least loaded instance;
    2. else, if the best match rate (matched tokens / prompt tokens) > ``cache-threshold``: the
       instance with the best match;
    3. else the instance with the smallest cache (:meth:`~duetime.estimate.PrefixIndex.
       cached_blocks`; SGLang's ``get_smallest_tenant``);

    and in every case the prompt is recorded on the chosen instance (SGLang inserts the text
    into the chosen worker's tree in the imbalanced branch too). Ties are broken at random
    (SGLang's ``min_by_key`` takes the first); on step 3, among equally small caches by the
    lower load, then at random (so with no index anywhere the policy is shortest-queue).

    Defaults: the router's command-line defaults, ``cache_threshold = 0.3``,
    ``balance_abs_threshold = 64``, ``balance_rel_threshold = 1.5`` (``sgl-model-gateway/src/
    main.rs`` and ``sgl-model-gateway/bindings/python/src/sglang_router/router_args.py``); the
    Rust library's ``CacheAwareConfig::default()`` (``sgl-model-gateway/src/policies/mod.rs``)
    is 0.5 / 32 / 1.1, used only when the router is built from code.

    Differences: SGLang matches on an approximate radix tree of request *characters* per worker
    (the match rate counts characters), evicted by size (``max_tree_size``) in the background;
    here matching is on the instance's KV blocks (whole blocks of ``block_size`` tokens, so a
    trailing partial block never matches) through the view's prefix index. SGLang's load is
    the router's count of its in-flight requests per worker; here the instance's running +
    waiting. Newer sgl-model-gateway versions send step 3 to the least loaded worker instead of
    the smallest tree (the header comment still says smallest tree); this follows the
    documented rule (``sgl-router``) and breaks its ties by load.
    """

    name = "cache-aware"
    summary = ("SGLang router's cache-aware policy: the least loaded when loads are "
               "imbalanced, else the best prefix match if its rate > cache-threshold, else the "
               "smallest cache; records the prompt on the chosen instance's prefix index")
    params = (SEED, CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL)
    consumes = frozenset({LOAD, PREFIX})

    def __init__(self, *, seed: int = 0, cache_threshold: float = CACHE_THRESHOLD.default,
                 balance_abs_threshold: int = BALANCE_ABS.default,
                 balance_rel_threshold: float = BALANCE_REL.default) -> None:
        super().__init__(seed=seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def _inputs(self, req: RoutingRequest, cands: list[Candidate],
                hashes: _Hashes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate: load (running + waiting), match rate, cached blocks."""
        indexes = _indexes(cands)
        load = np.array([c.view.num_running + c.view.num_waiting for c in cands], dtype=float)
        rate = np.zeros(len(cands))
        if req.prompt_tokens > 0:
            for k, index in enumerate(indexes):
                if index is not None:
                    h = hashes(index.block_size)
                    if len(h):
                        rate[k] = index.match(h) * index.block_size / req.prompt_tokens
        size = np.array([0 if x is None else x.cached_blocks() for x in indexes], dtype=float)
        return load, rate, size

    def _branch(self, load: np.ndarray, rate: np.ndarray) -> str:
        lo, hi = load.min(), load.max()
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return "imbalanced"
        return "match" if rate.max() > self.cache_threshold else "smallest"

    def peek(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        return self._pick(req, cands, _Hashes(req))

    def _pick(self, req: RoutingRequest, cands: list[Candidate], hashes: _Hashes) -> Decision:
        load, rate, size = self._inputs(req, cands, hashes)
        branch = self._branch(load, rate)
        if branch == "imbalanced":
            return Decision(self._argmax_random(-load))
        if branch == "match":
            return Decision(self._argmax_random(rate))
        return Decision(self._argmax_random(np.where(size == size.min(), -load, -np.inf)))

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        hashes = _Hashes(req)
        d = self._pick(req, cands, hashes)
        _record(prefix_index_of(cands[d.index].view), hashes)
        return d

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        load, rate, size = self._inputs(req, cands, _Hashes(req))
        rule = {"imbalanced": "loads imbalanced: the least loaded",
                "match": f"the best prefix match (its rate > {self.cache_threshold:g})",
                "smallest": "no match above the threshold: the smallest cache (then the "
                            "least load)"}[self._branch(load, rate)]
        return Described({"load": load.tolist(), "match_rate": rate.tolist(),
                          "cached_blocks": size.tolist()}, None, "higher", rule)
