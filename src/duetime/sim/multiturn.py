"""Conversations with retries: closed-loop clients, per-turn TTCA and time-to-goal.

Each of N clients runs one conversation at a time (:mod:`duetime.workload.kvlookup.conversations`):
it sends turn 1; a wrong answer is retried at once (the same prompt, so the instances already
tried have it cached) up to ``retry_cap`` attempts; when a turn is answered correctly, or its
cap is reached, the next turn is sent at once with the conversation so far, which holds the
answer of the turn's last attempt. The engine of the instance that answered is given the hashes
of the prompt *and* its answer (what its KV cache holds afterwards), so the next turn can hit
that instance's cache up to the end of the answer and the other instances' up to the prompts
they saw. Every instance caches prefixes.

The policy sees ``session`` = the conversation, ``attempted`` = the models tried for this turn,
``success`` = the predicted probabilities for the turn, ``prompt_hashes`` = the turn's prompt.
A turn's TTCA is its attempts' latencies up to the first correct one (censored at the cap); a
conversation's time-to-goal is the sum over its turns (no think time), its goal reached when
every turn was answered correctly.
"""

from __future__ import annotations

import time as wallclock
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from duetime.engine.spec import InstanceSpec
from duetime.estimate.base import KeysByBlockSize
from duetime.policy.base import Candidate, Policy, RoutingRequest
from duetime.sim.cache_view import check_cache_view, keys_by_block_size
from duetime.sim.instance import SimInstance
from duetime.sim.loop import run_clients
from duetime.sim.retry import RetryResult
from duetime.workload.kvlookup.conversations import Conversation
from duetime.workload.segments import Segments, block_hashes


@dataclass(slots=True)
class MultiTurnResult:
    """Every turn's attempts as a :class:`RetryResult` (one "query" per turn), with the
    conversation and turn index of each."""

    turns: RetryResult
    conversation: np.ndarray
    turn: np.ndarray
    n_conversations: int

    @property
    def ttca(self) -> np.ndarray:
        """Per turn (in ``conversation``, ``turn`` order)."""
        return self.turns.ttca

    @property
    def time_to_goal(self) -> np.ndarray:
        """Per conversation: the sum of its turns' TTCAs (censored where a turn hit the cap)."""
        return np.bincount(self.conversation, weights=self.ttca, minlength=self.n_conversations)

    @property
    def goal(self) -> np.ndarray:
        """Per conversation: every turn answered correctly."""
        failed = np.bincount(self.conversation, weights=~self.turns.solved,
                             minlength=self.n_conversations)
        return failed == 0

    def ttca_by_turn(self) -> np.ndarray:
        """Mean TTCA of the k-th turns, k = 1.. (over the conversations that have one)."""
        return np.array([float(self.ttca[self.turn == k].mean())
                         for k in range(int(self.turn.max()) + 1)])

    @property
    def cache_hit_rate(self) -> float | None:
        return self.turns.cache_hit_rate


def run_conversations(models: dict[str, InstanceSpec], policy: Policy,
                      convs: Sequence[Conversation], *, clients: int = 8, retry_cap: int = 10,
                      replicas: int = 1, task: str = "kv-lookup",
                      cache_view: str = "precise") -> MultiTurnResult:
    """Serve ``convs`` on ``replicas`` instances per model (``models``, in the conversations'
    model order; the LAAR pool has one) with prefix caching on, ``clients`` conversations at
    a time. Replicas of a model answer alike (the same answer segment): their difference is
    their load and what they have cached."""
    check_cache_view(cache_view)
    t_wall = wallclock.perf_counter()
    names = list(models)
    models = {m: replace(s, config=replace(s.config, enable_prefix_caching=True))
              for m, s in models.items()}
    model_of = [mi for mi in range(len(names)) for _ in range(replicas)]
    insts = [SimInstance(names[mi] if replicas == 1 else f"{names[mi]}/{r % replicas}",
                         models[names[mi]], cache_view=cache_view)
             for r, mi in enumerate(model_of)]
    cands = [Candidate(inst.name, names[mi], 0.0, 0.0, inst)
             for mi, inst in zip(model_of, insts, strict=True)]
    n = len(convs)
    base = np.concatenate([[0], np.cumsum([c.turns for c in convs])]).astype(int)
    attempts: list[list[tuple[str, float, bool]]] = [[] for _ in range(int(base[-1]))]
    turn = [0] * n
    kept: list[list[int]] = [[] for _ in range(n)]  # per conversation: the answers it kept
    tried: list[set[str]] = [set() for _ in range(n)]
    prompt: dict[int, tuple[Segments, KeysByBlockSize]] = {}  # per conversation, this turn's
    inflight: dict[str, tuple[int, int, float]] = {}  # request id -> (conversation, model, sent)
    next_conv = min(clients, n)

    def dispatch(t: float, c: int) -> None:
        conv, k = convs[c], turn[c]
        if c not in prompt:
            segs = conv.prompt(k, kept[c])
            prompt[c] = (segs, keys_by_block_size(segs))
        segs, ph = prompt[c]
        tokens = sum(length for _, length in segs)
        out = np.full(len(insts), conv.answer_tokens)
        req = RoutingRequest(f"{c}.{k}.{len(attempts[base[c] + k])}", tokens, None, out,
                             float("inf"), task, session=str(conv.id),
                             attempted=frozenset(tried[c]),
                             success=conv.success[k][model_of], prompt_hashes=ph)
        i = policy.choose(req, cands, t).index
        inst, mi = insts[i], model_of[i]
        # what the instance's cache holds once it answers: the prompt and its own answer
        full = (*segs, (int(conv.answer_ids[k, mi]), conv.answer_tokens))
        hashes = block_hashes(full, inst.engine.config.block_size) if inst.engine.caching else ()
        inst.submit(req.id, tokens, conv.answer_tokens, conv.answer_tokens, t, hashes)
        inflight[req.id] = (c, mi, t)

    def finished(rid: str, t: float) -> list[int]:
        """A wrong answer is retried at once (up to the cap); else the next turn, or the
        client's next conversation."""
        nonlocal next_conv
        c, mi, sent = inflight.pop(rid)
        conv, k = convs[c], turn[c]
        ok = bool(conv.correct[k, mi])
        a = attempts[base[c] + k]
        a.append((names[mi], t - sent, ok))
        tried[c].add(names[mi])
        if not ok and len(a) < retry_cap:
            return [c]
        kept[c].append(mi)
        tried[c] = set()
        del prompt[c]
        turn[c] += 1
        if turn[c] < conv.turns:
            return [c]
        if next_conv < n:
            next_conv += 1
            return [next_conv - 1]
        return []

    run_clients(insts, [(0.0, c) for c in range(min(clients, n))], dispatch, finished)
    queries = np.array([x.engine.prefix_queries for x in insts], dtype=np.int64)
    hits = np.array([x.engine.prefix_hits for x in insts], dtype=np.int64)
    res = RetryResult(names, attempts, wallclock.perf_counter() - t_wall, queries, hits)
    conv_of = np.repeat(np.arange(n), [c.turns for c in convs])
    turn_of = np.concatenate([np.arange(c.turns) for c in convs]) if n else np.array([], int)
    return MultiTurnResult(res, conv_of, turn_of, n)
