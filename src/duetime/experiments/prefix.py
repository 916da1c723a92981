"""The ``prefix`` experiment's request streams: shared-prefix workloads sized against the pool's
KV capacity, and their working sets.

Two workloads (generators of :mod:`duetime.workload.prefix`), both at a given *request* rate so
that they sweep the same load grid as ``load-sweep``:

- ``multi-turn``: chat sessions (:func:`~duetime.workload.prefix.multi_turn`), each turn's prompt
  the conversation so far. Sessions start at rate / (mean turns); the stream is a window of
  ``n`` turns taken after a warm-up (:data:`MULTI_TURN` ``warmup_s``), so that the window opens
  on sessions in progress at the steady-state rate (their first turn in the window finds a cold
  cache, as after a restart).
- ``system-prompts``: tenants (:func:`~duetime.workload.prefix.tenants`), each with its own
  system prompt, Zipf popularity; a request = its tenant's system prompt + a question of the
  profile's prompt length for its task.

Working set (distinct prefix tokens in play), compared with the pool's KV capacity (Σ usable
blocks x block size of the instances; the paper pool's 38,000 / 24,000 / 19,000 blocks of 16
tokens, 1,295,952 tokens):

- ``multi-turn``: the time average over the window of Σ over live sessions of their context
  (prompt + answer of their latest turn: what the next turn reuses); a session is live from its
  first turn to its last, on the whole generated stream (warm-up and the turns after the window
  included), so the window's edges do not cut it;
- ``system-prompts``: the system-prompt tokens of the tenants the window's requests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.workload import Geometric, RequestSet, WorkloadProfile, multi_turn, tenants
from duetime.workload.profile import LogNormal

WORKLOADS = ("multi-turn", "system-prompts")

# multi-turn: ~6 turns per session (at most 20), a minute of thinking between turns; questions
# ~275 and answers ~450 tokens on average, so a conversation grows by ~730 tokens a turn.
MULTI_TURN: dict[str, Any] = {
    "mean_turns": 6.0, "max_turns": 20, "think_time_s": 60.0,
    "question_tokens": {"median": 200, "sigma": 0.8, "min": 8, "max": 4000},
    "answer_tokens": {"median": 400, "sigma": 0.5, "min": 20, "max": 2000},
    "warmup_s": 1800.0}
# system-prompts: 1000 tenants x 2000-token system prompts (2.0M tokens, 1.5x the pool's KV);
# Zipf(1) popularity; the question is the profile's prompt for the request's task.
SYSTEM_PROMPTS: dict[str, Any] = {"tenants": 1000, "system_tokens": 2000, "zipf_s": 1.0}
_TAG = {"multi-turn": 1, "system-prompts": 2}  # seeds the two workloads' streams apart


@dataclass(slots=True)
class Stream:
    """A workload's requests at one rate and their working set (tokens)."""

    workload: str
    rate: float
    requests: RequestSet
    working_set_tokens: float

    @property
    def arrival_rps(self) -> float:
        """The stream's realised request rate (requests / arrival span)."""
        a = self.requests.arrival
        return float((len(a) - 1) / (a[-1] - a[0])) if len(a) > 1 and a[-1] > a[0] else 0.0


def kv_capacity_tokens(profile: WorkloadProfile) -> dict[str, int]:
    """Tokens the KV cache of one instance of each model holds (usable blocks x block size)."""
    return {m: spec.config.kv_capacity_tokens for m, spec in profile.models.items()}


def mean_turns(mean: float, hi: int) -> float:
    """E[min(T, hi)] for T geometric on 1, 2, ... with the given mean."""
    q = 1.0 - 1.0 / mean
    return (1.0 - q ** hi) * mean


def _lognormal(d: dict[str, float]) -> LogNormal:
    return LogNormal(d["median"], d["sigma"], int(d["min"]), int(d["max"]))


def _window(rs: RequestSet, start: int, n: int, shift: float) -> RequestSet:
    """Requests ``start .. start + n - 1``, arrivals moved ``shift`` s earlier."""
    sl = slice(start, start + n)

    def cut(a):
        return None if a is None else a[sl]
    return RequestSet(rs.arrival[sl] - shift, rs.task[sl], rs.prompt[sl], rs.output[sl],
                      rs.quality[sl], rs.target[sl], rs.tasks, rs.models, cut(rs.segments),
                      cut(rs.session), cut(rs.answer_segment))


def live_context_tokens(rs: RequestSet, t0: float, t1: float) -> float:
    """The time average over [t0, t1] of Σ over live sessions of their context: turn j's prompt
    + answer counts from its arrival until its session's next turn arrives (a session's last
    turn counts for nothing: nothing reuses it)."""
    if t1 <= t0 or rs.session is None:
        return 0.0
    order = np.lexsort((rs.arrival, rs.session))
    ses, arr = rs.session[order], rs.arrival[order]
    ctx = (rs.prompt + rs.output[:, 0])[order]
    has_next = ses[:-1] == ses[1:]
    start, end, tok = arr[:-1][has_next], arr[1:][has_next], ctx[:-1][has_next]
    overlap = np.clip(np.minimum(end, t1) - np.maximum(start, t0), 0.0, None)
    return float(np.sum(tok * overlap) / (t1 - t0))


def multi_turn_stream(profile: WorkloadProfile, rate: float, n: int,
                      rng: np.random.Generator) -> Stream:
    """``n`` consecutive turns at ``rate`` turns/s after the warm-up (see the module)."""
    p = MULTI_TURN
    turns = mean_turns(p["mean_turns"], p["max_turns"])
    warm = float(p["warmup_s"])
    horizon = warm + 1.2 * n / rate + 60.0
    while True:
        rs = multi_turn(profile, rate / turns, rng, duration=horizon,
                        turns=Geometric(p["mean_turns"], p["max_turns"]),
                        question_len=_lognormal(p["question_tokens"]),
                        answer_len=_lognormal(p["answer_tokens"]),
                        think_time_s=p["think_time_s"])
        start = int(np.searchsorted(rs.arrival, warm))
        if len(rs) - start >= n:
            break
        horizon *= 1.5
    win = _window(rs, start, n, warm)
    ws = live_context_tokens(rs, float(rs.arrival[start]), float(rs.arrival[start + n - 1]))
    return Stream("multi-turn", rate, win, ws)


def system_prompts_stream(profile: WorkloadProfile, rate: float, n: int,
                          rng: np.random.Generator) -> Stream:
    """``n`` requests at ``rate`` from the tenants (see the module)."""
    p = SYSTEM_PROMPTS
    rs = tenants(profile, rate, n, rng, n_tenants=p["tenants"], system_len=p["system_tokens"],
                 zipf_s=p["zipf_s"])
    used = np.unique(rs.session)
    return Stream("system-prompts", rate, rs, float(len(used) * p["system_tokens"]))


def make_stream(workload: str, profile: WorkloadProfile, rate: float, n: int,
                seed: int) -> Stream:
    """The workload's stream at ``rate`` (requests/s), ``n`` requests, seeded by (seed, rate,
    n, workload): every policy and cache view of a point sees the same requests."""
    if workload not in WORKLOADS:
        raise KeyError(f"unknown prefix workload {workload!r}; one of {', '.join(WORKLOADS)}")
    rng = np.random.default_rng([seed, int(rate * 1000), n, _TAG[workload]])
    if workload == "multi-turn":
        return multi_turn_stream(profile, rate, n, rng)
    return system_prompts_stream(profile, rate, n, rng)
