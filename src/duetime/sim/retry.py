"""Retries until a correct answer: closed-loop clients over a pool, time-to-correct-answer.

N clients each take the next query; an attempt is routed (the policy sees the models already
tried for the query and their predicted success probabilities), runs end to end on the chosen
instance, and is judged by the ground truth: decoding is deterministic, so the outcome of a
(query, model) pair is fixed and retrying a model that failed fails again. A wrong answer makes
the client retry at once, up to ``retry_cap`` attempts. TTCA = Σ attempt latencies up to and
including the first correct one, right-censored at the cap.
"""

from __future__ import annotations

import time as wallclock
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from duetime.engine.spec import InstanceSpec
from duetime.estimate.base import KeysByBlockSize
from duetime.policy.base import Candidate, Policy, RoutingRequest
from duetime.predict.quality_source import QualitySource, QueryTable
from duetime.sim.cache_view import check_cache_view, keys_by_block_size
from duetime.sim.instance import SimInstance
from duetime.sim.loop import run_clients
from duetime.workload.segments import Segments


@dataclass(slots=True)
class RetryResult:
    models: list[str]
    attempts: list[list[tuple[str, float, bool]]]  # per query: (model, latency s, correct)
    wall_s: float = 0.0
    # prefix caching, per model's instance (None when none caches): prompt tokens looked up
    # in the cache, and found there
    prefix_queries: np.ndarray | None = None
    prefix_hits: np.ndarray | None = None

    @property
    def cache_hit_rate(self) -> float | None:
        """Σ hits / Σ queries over the instances (0 with no lookup); None without caching."""
        if self.prefix_queries is None or self.prefix_hits is None:
            return None
        q = int(self.prefix_queries.sum())
        return float(self.prefix_hits.sum()) / q if q else 0.0

    @property
    def ttca(self) -> np.ndarray:
        """Σ latencies up to the first correct attempt (all attempts if none: censored)."""
        return np.array([sum(lat for _, lat, _ in a) for a in self.attempts])

    @property
    def solved(self) -> np.ndarray:
        return np.array([bool(a) and a[-1][2] for a in self.attempts])

    def success_by_attempt(self, cap: int) -> np.ndarray:
        """Fraction of queries solved within k attempts, k = 1..cap."""
        n_ok = np.array([len(a) if a and a[-1][2] else cap + 1 for a in self.attempts])
        return np.array([(n_ok <= k).mean() for k in range(1, cap + 1)])

    def ttca_by_attempt(self, cap: int) -> np.ndarray:
        """Mean time spent after at most k attempts (the paper's TTCA vs retries curve)."""
        out = []
        for k in range(1, cap + 1):
            out.append(float(np.mean([sum(lat for _, lat, _ in a[:k]) for a in self.attempts])))
        return np.array(out)


def run_retries(models: dict[str, InstanceSpec], policy: Policy, prompt_tokens: np.ndarray,
                output_tokens: np.ndarray, correct: np.ndarray,
                success: np.ndarray | QualitySource, *, clients: int = 8, retry_cap: int = 10,
                length_error: float = 0.0, seed: int = 0,
                task: str = "kv-lookup", segments: Sequence[Segments] | None = None,
                prefix_caching: bool | None = None,
                cache_view: str = "precise") -> RetryResult:
    """Serve queries with retries. ``correct`` is (queries, models) in ``models`` order: the
    ground truth; ``success`` the router's predicted success probabilities: a
    :class:`~duetime.predict.QualitySource` (asked with ``task`` and the query's index as id) or
    a (queries, models) array; ``output_tokens`` (queries, models) the true answer lengths. The
    event loop is the simulator's one (:func:`~duetime.sim.loop.run_clients`); a wrong answer's
    retry is its ``finished`` hook.

    Prefix caching (as in :class:`~duetime.sim.cluster.ClusterSim`): ``prefix_caching``
    True / False overrides the models' configs; ``segments`` (per query, its prompt's
    segments) gives every attempt of a query the same prompt block hashes (a retry re-sends
    the same prompt), on the instance and to the router; ``cache_view`` ``precise`` or
    ``estimated``. An answer's blocks are not hashed: no later attempt shares them."""
    check_cache_view(cache_view)
    t_wall = wallclock.perf_counter()
    names = list(models)
    n = len(prompt_tokens)
    if segments is not None and len(segments) != n:
        raise ValueError(f"segments: one per query ({n}), got {len(segments)}")
    if prefix_caching is not None:
        models = {m: replace(s, config=replace(s.config, enable_prefix_caching=prefix_caching))
                  for m, s in models.items()}
    success_pred = (success.quality_table(QueryTable([task] * n, [str(q) for q in range(n)]),
                                          names, success=True)
                    if isinstance(success, QualitySource) else np.asarray(success, dtype=float))
    insts = [SimInstance(m, models[m], cache_view=cache_view) for m in names]
    cands = [Candidate(m, m, 0.0, 0.0, inst) for m, inst in zip(names, insts, strict=True)]
    rng = np.random.default_rng(seed)
    e = length_error
    pred_out = np.maximum(1, np.rint(output_tokens * rng.uniform(1 - e, 1 + e,
                                                                 output_tokens.shape)))
    attempts: list[list[tuple[str, float, bool]]] = [[] for _ in range(n)]
    tried: list[set[str]] = [set() for _ in range(n)]
    inflight: dict[str, tuple[int, int, float]] = {}  # request id -> (query, model, sent)
    next_query = min(clients, n)
    hashes: dict[int, KeysByBlockSize] = {}  # per query, its prompt's hashes by block size

    def dispatch(t: float, q: int) -> None:
        ph = None
        if segments is not None:
            ph = hashes.get(q)
            if ph is None:
                ph = hashes[q] = keys_by_block_size(segments[q])
        req = RoutingRequest(f"{q}.{len(attempts[q])}", int(prompt_tokens[q]), None,
                             pred_out[q], float("inf"), task, session=str(q),
                             attempted=frozenset(tried[q]), success=success_pred[q],
                             prompt_hashes=ph)
        mi = policy.choose(req, cands, t).index
        inst = insts[mi]
        engine = inst.engine
        inst.submit(req.id, int(prompt_tokens[q]), int(output_tokens[q, mi]),
                    int(pred_out[q, mi]), t,
                    ph(engine.config.block_size) if ph is not None and engine.caching else ())
        inflight[req.id] = (q, mi, t)

    def finished(rid: str, t: float) -> list[int]:
        """A wrong answer is retried at once (up to the cap); else the client moves on."""
        nonlocal next_query
        q, mi, sent = inflight.pop(rid)
        ok = bool(correct[q, mi])
        attempts[q].append((names[mi], t - sent, ok))
        tried[q].add(names[mi])
        if not ok and len(attempts[q]) < retry_cap:
            return [q]
        hashes.pop(q, None)
        if next_query < n:
            next_query += 1
            return [next_query - 1]
        return []

    run_clients(insts, [(0.0, q) for q in range(min(clients, n))], dispatch, finished)
    queries = hits = None
    if any(inst.engine.caching for inst in insts):
        queries = np.array([inst.engine.prefix_queries for inst in insts], dtype=np.int64)
        hits = np.array([inst.engine.prefix_hits for inst in insts], dtype=np.int64)
    return RetryResult(names, attempts, wallclock.perf_counter() - t_wall, queries, hits)
