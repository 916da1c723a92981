"""Shared-prefix workloads for prefix-caching experiments: which tokens each prompt holds.

Prompts are described by segments (:mod:`duetime.workload.segments`; hashed into KV blocks by
:func:`block_hashes`, re-exported here). Each generator has its own segment-id tag, so two
generators' content never collides; two runs of the *same* generator reuse the same ids (a
counter from 1): do not merge them into one workload without shifting one's ids.

Generators (seeded; they return :class:`RequestSet` with arrivals, ``segments``, ``session``
and ``answer_segment``; task, quality and the TTFT target per request come from
:func:`sample_requests`, the target redrawn by the profile's rule for the real prompt lengths,
so policies see the same columns as in every other workload):

- :func:`multi_turn`: chat sessions whose every prompt is the conversation so far;
- :func:`tenants`: tenants with their own system prompt, each request a unique question;
- :func:`shared_prefix`: inference-perf's ``shared_prefix`` data shape (groups x prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from duetime.workload.arrivals import MMPP2, Deterministic, Poisson
from duetime.workload.profile import WorkloadProfile
from duetime.workload.requests import RequestSet, sample_requests
from duetime.workload.segments import (
    TAG_MULTI_TURN,
    TAG_SHARED_PREFIX,
    TAG_TENANTS,
    SegmentIds,
    Segments,
    block_hashes,
    prompt_hashes,
    sequence_hashes,
)

__all__ = ["Geometric", "block_hashes", "multi_turn", "prompt_hashes", "sequence_hashes",
           "shared_prefix", "tenants"]

# -- lengths and counts -------------------------------------------------------------------------


class Sampler(Protocol):
    """Anything that draws n integers (e.g. :class:`~duetime.workload.profile.LogNormal`)."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...


Length = int | Sampler


@dataclass(frozen=True, slots=True)
class Geometric:
    """Geometric on 1, 2, ... with the given mean (a session's number of turns), capped at hi."""

    mean: float
    hi: int | None = None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.mean < 1:
            raise ValueError(f"Geometric.mean: must be >= 1, got {self.mean}")
        x = rng.geometric(1.0 / self.mean, n).astype(np.int64)
        return np.minimum(x, self.hi) if self.hi is not None else x


def _draw(spec: Length, rng: np.random.Generator, n: int, name: str, lo: int = 1) -> np.ndarray:
    x = (np.full(n, spec, dtype=np.int64) if isinstance(spec, int | np.integer)
         else np.asarray(spec.sample(rng, n), dtype=np.int64))
    if x.size and x.min() < lo:
        raise ValueError(f"{name}: lengths must be >= {lo}, got {int(x.min())}")
    return x


Arrivals = Poisson | Deterministic | MMPP2


def _process(rate: float | Arrivals) -> Arrivals:
    if isinstance(rate, Poisson | Deterministic | MMPP2):
        return rate
    if rate <= 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    return Poisson(float(rate))


def assemble(profile: WorkloadProfile, rng: np.random.Generator, arrival: np.ndarray,
             segments: list[Segments], answer: np.ndarray, session: np.ndarray,
             output: np.ndarray | None, base: RequestSet | None = None) -> RequestSet:
    """The request set, in arrival order (for this package's generators and loaders): task and
    quality per request from the profile (``base``, else :func:`sample_requests`), prompt
    lengths from the segments, TTFT targets by the profile's rule for those lengths, ``output``
    (the same for every model) if given, else the profile's per-model lengths."""
    order = np.argsort(arrival, kind="stable")
    arrival = np.asarray(arrival, dtype=float)[order]
    if base is None:
        base = sample_requests(profile, arrival, rng)
    else:
        base = RequestSet(arrival, base.task[order], base.prompt[order], base.output[order],
                          base.quality[order], base.target[order], base.tasks, base.models)
    segs = [segments[i] for i in order]
    base.prompt = np.array([sum(length for _, length in s) for s in segs], dtype=np.int64)
    if output is not None:
        base.output[:] = np.asarray(output, dtype=np.int64)[order, None]
    base.target = profile.target.sample(rng, base.prompt)
    base.segments = segs
    base.session = np.asarray(session, dtype=np.int64)[order]
    base.answer_segment = np.asarray(answer, dtype=np.int64)[order]
    return base


# -- generators -------------------------------------------------------------------------------

def multi_turn(profile: WorkloadProfile, rate: float | Arrivals, rng: np.random.Generator, *,
               n_sessions: int | None = None, duration: float | None = None,
               turns: Length = Geometric(4.0), question_len: Length = 100,
               answer_len: Length = 200, think_time_s: float = 10.0,
               system_prompt_len: Length = 0, system_prompts: int = 1,
               decode_s_per_token: float = 0.0, max_context: int = 32768) -> RequestSet:
    """Chat sessions: turn t's prompt is the conversation so far -- a system prompt (one of
    ``system_prompts`` shared ones, if ``system_prompt_len`` > 0), q1, a1, ..., q_t.

    Sessions start at ``rate`` sessions/s (Poisson unless an arrival process is given), either
    ``n_sessions`` of them or all that start within ``duration`` s (their later turns may arrive
    after it). Open loop: turn t+1 arrives at turn t's arrival + ``decode_s_per_token`` x its
    answer length (a fixed estimate of its service; 0 by default) + an exponential think time
    of mean ``think_time_s``, however late the simulated answer really ends. A session ends
    after its drawn number of ``turns``, or before the first turn whose prompt + answer would
    exceed ``max_context`` tokens. Simplification: a turn's output length is the same for every
    model (``output[i, :]`` equal), so the next prompt is well defined whichever model
    answered. Each turn's task (and so its quality and target) is drawn independently, as in
    :func:`sample_requests`; ``session`` is the session's index.
    """
    if (n_sessions is None) == (duration is None):
        raise ValueError("give exactly one of n_sessions, duration")
    if think_time_s < 0 or decode_s_per_token < 0 or system_prompts < 1 or max_context < 1:
        raise ValueError("think_time_s, decode_s_per_token >= 0; system_prompts, "
                         "max_context >= 1")
    proc = _process(rate)
    if n_sessions is not None:
        start = proc.times(int(n_sessions), rng)
    else:
        k = int(proc.rate * duration * 1.2) + 16
        while (start := proc.times(k, rng))[-1] <= duration:
            k *= 2
        start = start[start <= duration]
    ns = len(start)
    ids = SegmentIds(TAG_MULTI_TURN)
    n_turns = _draw(turns, rng, ns, "turns")
    total = int(n_turns.sum())
    q_len = _draw(question_len, rng, total, "question_len")
    a_len = _draw(answer_len, rng, total, "answer_len")
    think = rng.exponential(think_time_s, total) if think_time_s > 0 else np.zeros(total)
    sys_id = ids.take(system_prompts)
    sys_len = _draw(system_prompt_len, rng, system_prompts, "system_prompt_len", lo=0)
    sys_pick = rng.integers(system_prompts, size=ns)
    q_id, a_id = ids.take(total), ids.take(total)
    arrival: list[float] = []
    segments: list[Segments] = []
    answer: list[int] = []
    out: list[int] = []
    session: list[int] = []
    j = 0  # index over all drawn turns
    for s in range(ns):
        pick = sys_pick[s]
        ctx: Segments = ((int(sys_id[pick]), int(sys_len[pick])),) if sys_len[pick] else ()
        length, t_arr = int(sys_len[pick]), float(start[s])
        for t in range(n_turns[s]):
            jt = j + t
            if length + q_len[jt] + a_len[jt] > max_context:
                break
            prompt = (*ctx, (int(q_id[jt]), int(q_len[jt])))
            arrival.append(t_arr)
            segments.append(prompt)
            answer.append(int(a_id[jt]))
            out.append(int(a_len[jt]))
            session.append(s)
            ctx = (*prompt, (int(a_id[jt]), int(a_len[jt])))
            length += int(q_len[jt] + a_len[jt])
            t_arr += decode_s_per_token * a_len[jt] + think[jt]
        j += int(n_turns[s])
    return assemble(profile, rng, np.array(arrival), segments, np.array(answer, dtype=np.int64),
                    np.array(session, dtype=np.int64), np.array(out, dtype=np.int64))


def tenants(profile: WorkloadProfile, rate: float | Arrivals, n: int, rng: np.random.Generator,
            *, n_tenants: int = 16, system_len: Length = 1000, question_len: Length | None = None,
            popularity: str | Sequence[float] = "zipf", zipf_s: float = 1.0) -> RequestSet:
    """``n`` requests from ``n_tenants`` tenants, each with its own system prompt (length drawn
    once per tenant); a request = its tenant's system prompt + a unique question.

    The tenant of a request is drawn by ``popularity``: ``zipf`` (tenant k, from 1, with weight
    k^-zipf_s), ``uniform``, or explicit weights. ``question_len`` None = the profile's prompt
    length for the request's task; output lengths are the profile's (per model).
    ``session`` is the tenant.
    """
    if n_tenants < 1:
        raise ValueError(f"n_tenants: must be >= 1, got {n_tenants}")
    if isinstance(popularity, str):
        if popularity == "zipf":
            w = np.arange(1, n_tenants + 1, dtype=float) ** -float(zipf_s)
        elif popularity == "uniform":
            w = np.ones(n_tenants)
        else:
            raise ValueError(f"popularity: 'zipf', 'uniform' or weights, got {popularity!r}")
    else:
        w = np.asarray(popularity, dtype=float)
        if w.shape != (n_tenants,) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"popularity: {n_tenants} non-negative weights, not all 0")
    arrival = _process(rate).times(int(n), rng)
    base = sample_requests(profile, arrival, rng)
    ids = SegmentIds(TAG_TENANTS)
    sys_id = ids.take(n_tenants)
    sys_len = _draw(system_len, rng, n_tenants, "system_len", lo=0)
    tenant = rng.choice(n_tenants, size=int(n), p=w / w.sum())
    q_len = (base.prompt.copy() if question_len is None
             else _draw(question_len, rng, int(n), "question_len"))
    q_id, a_id = ids.take(int(n)), ids.take(int(n))
    segments = [((int(sys_id[t]), int(sys_len[t])), (int(q), int(ql))) if sys_len[t]
                else ((int(q), int(ql)),) for t, q, ql in zip(tenant, q_id, q_len, strict=True)]
    return assemble(profile, rng, arrival, segments, a_id, tenant, None, base=base)


def shared_prefix(profile: WorkloadProfile, rate: float | Arrivals, n: int,
                  rng: np.random.Generator, *, num_groups: int = 10,
                  num_prompts_per_group: int = 10, system_prompt_len: Length = 100,
                  question_len: Length = 50, output_len: Length = 50,
                  order: str = "uniform") -> RequestSet:
    """inference-perf's ``shared_prefix`` data (same parameter names and defaults): a fixed set
    of ``num_groups`` x ``num_prompts_per_group`` prompts, each its group's system prompt + its
    own question (lengths drawn once per group / per prompt). Requests draw a prompt -- group
    and prompt uniformly (``order="uniform"``) or, as inference-perf sends them, cycling through
    the prompts in one shuffled order (``"cycle"``); a repeated prompt is identical.
    ``output_len`` is drawn per request, the same for every model (as with ``max_tokens`` and
    ``ignore_eos``). ``session`` is the group.
    """
    if num_groups < 1 or num_prompts_per_group < 1:
        raise ValueError("num_groups, num_prompts_per_group: must be >= 1")
    n, npg = int(n), int(num_prompts_per_group)
    arrival = _process(rate).times(n, rng)
    ids = SegmentIds(TAG_SHARED_PREFIX)
    sys_id, sys_len = ids.take(num_groups), _draw(system_prompt_len, rng, num_groups,
                                                  "system_prompt_len", lo=0)
    q_id, q_len = ids.take(num_groups * npg), _draw(question_len, rng, num_groups * npg,
                                                    "question_len")
    if order == "uniform":
        prompt = rng.integers(num_groups, size=n) * npg + rng.integers(npg, size=n)
    elif order == "cycle":
        prompt = rng.permutation(num_groups * npg)[np.arange(n) % (num_groups * npg)]
    else:
        raise ValueError(f"order: 'uniform' or 'cycle', got {order!r}")
    group = prompt // npg
    out = _draw(output_len, rng, n, "output_len")
    segments = [((int(sys_id[g]), int(sys_len[g])), (int(q_id[p]), int(q_len[p]))) if sys_len[g]
                else ((int(q_id[p]), int(q_len[p])),) for g, p in zip(group, prompt, strict=True)]
    return assemble(profile, rng, arrival, segments, ids.take(n), group, out)
