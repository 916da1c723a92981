"""Retries until a correct answer: closed-loop clients over a pool, time-to-correct-answer.

N clients each take the next query; an attempt is routed (the policy sees the models already
tried for the query and their predicted success probabilities), runs end to end on the chosen
instance, and is judged by the ground truth: decoding is deterministic, so the outcome of a
(query, model) pair is fixed and retrying a model that failed fails again. A wrong answer makes
the client retry at once, up to ``retry_cap`` attempts. TTCA = Σ attempt latencies up to and
including the first correct one, right-censored at the cap.
"""

from __future__ import annotations

import heapq
import time as wallclock
from dataclasses import dataclass

import numpy as np

from duetime.engine.spec import InstanceSpec
from duetime.policy.base import Candidate, Policy, RoutingRequest
from duetime.sim.cluster import SimInstance


@dataclass(slots=True)
class RetryResult:
    models: list[str]
    attempts: list[list[tuple[str, float, bool]]]  # per query: (model, latency s, correct)
    wall_s: float = 0.0

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
                output_tokens: np.ndarray, correct: np.ndarray, success_pred: np.ndarray, *,
                clients: int = 8, retry_cap: int = 10, length_error: float = 0.0,
                seed: int = 0) -> RetryResult:
    """Serve queries with retries. ``correct`` and ``success_pred`` are (queries, models) in
    ``models`` order: the ground truth and the router's predicted success probabilities;
    ``output_tokens`` (queries, models) the true answer lengths."""
    t_wall = wallclock.perf_counter()
    names = list(models)
    insts = [SimInstance(m, models[m]) for m in names]
    cands = [Candidate(m, m, 0.0, 0.0, inst) for m, inst in zip(names, insts, strict=True)]
    rng = np.random.default_rng(seed)
    e = length_error
    pred_out = np.maximum(1, np.rint(output_tokens * rng.uniform(1 - e, 1 + e,
                                                                 output_tokens.shape)))
    n = len(prompt_tokens)
    attempts: list[list[tuple[str, float, bool]]] = [[] for _ in range(n)]
    tried: list[set[str]] = [set() for _ in range(n)]
    pending: list[tuple[float, int, int]] = []  # (send time, sequence, query)
    seq = 0
    next_query = 0
    for _ in range(min(clients, n)):
        heapq.heappush(pending, (0.0, seq, next_query))
        seq += 1
        next_query += 1
    inflight: dict[str, tuple[int, int, float]] = {}  # request id -> (query, model, sent)
    while pending or inflight:
        busy = [i for i in insts if not i.engine.idle]
        horizon = min((i.engine.time for i in busy), default=float("inf"))
        if pending and pending[0][0] <= horizon:
            t, _, q = heapq.heappop(pending)
            for inst in insts:
                if inst.engine.idle:
                    inst.engine.advance_clock(t)
                inst.now = t
            req = RoutingRequest(f"{q}.{len(attempts[q])}", int(prompt_tokens[q]),
                                 success_pred[q], pred_out[q], float("inf"), "kv-lookup",
                                 session=str(q), attempted=frozenset(tried[q]))
            d = policy.choose(req, cands, t)
            mi = d.index
            insts[mi].engine.add(req.id, int(prompt_tokens[q]), int(output_tokens[q, mi]),
                                 predicted_output_tokens=int(pred_out[q, mi]), arrival=t)
            inflight[req.id] = (q, mi, t)
            continue
        step = min(busy, key=lambda i: i.engine.time).engine.step()
        for rid in step.finished if step else ():
            q, mi, sent = inflight.pop(rid)
            ok = bool(correct[q, mi])
            attempts[q].append((names[mi], step.end - sent, ok))
            tried[q].add(names[mi])
            if not ok and len(attempts[q]) < retry_cap:
                heapq.heappush(pending, (step.end, seq, q))  # retry at once
            elif next_query < n:  # the client moves on to its next query
                heapq.heappush(pending, (step.end, seq, next_query))
                next_query += 1
            seq += 1
    return RetryResult(names, attempts, wallclock.perf_counter() - t_wall)
