"""Multi-turn KV lookups: conversations over a growing JSON document, each turn a retryable query.

A conversation is several turns. Turn 1's prompt is a chunk of JSON data and a question for one
of its keys; turn k's prompt is the conversation so far (every earlier prompt part and the
answer the conversation kept for it) followed by a further chunk of data and a new question, so
its context grows along a ladder of the pool's context lengths (one rung a turn) and every later
turn starts with the earlier turns' tokens: the KV blocks a prefix cache can reuse.

Correctness is the single-turn workload's (:mod:`duetime.workload.kvlookup`): decoding is
deterministic, so the outcome of a (turn, model) pair is fixed, drawn once with the pool's
success probability for the model, the conversation's language and the turn's context length;
retrying a model that failed fails again. A model's answer to a turn is its own content (one
answer segment per (turn, model)): the next turn shares the answer's blocks only with the
instance that produced the answer the conversation kept.

Prompts are token counts described by segments (:mod:`duetime.workload.segments`), not text:
the simulator needs only lengths and which tokens equal which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from duetime.workload.kvlookup import Pool
from duetime.workload.segments import SegmentIds, Segments

# This generator's segment-id tag (segments.py numbers the other sources 1..5); its content
# never collides with theirs.
TAG_KV_CONVERSATION = 6
QUESTION_TOKENS = 40  # the question frame and a UUID key


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation's turns: what each adds, how long its prompt is, who answers it right.

    ``added[k]``: the segments turn k appends after the previous turn's answer (its data chunk
    and question); ``answer_ids[k, m]``: the segment of model m's answer to turn k;
    ``context_index[k]``: the pool's context-length bucket of turn k (its success rates);
    ``correct[k, m]``: the ground truth; ``success[k, m]``: the router's predicted
    probabilities."""

    id: int
    language: str
    added: tuple[Segments, ...]
    answer_ids: np.ndarray
    answer_tokens: int
    context_index: tuple[int, ...]
    correct: np.ndarray
    success: np.ndarray

    @property
    def turns(self) -> int:
        return len(self.added)

    def prompt(self, turn: int, kept: Sequence[int]) -> Segments:
        """Turn ``turn``'s prompt when the conversation kept model ``kept[j]``'s answer to each
        earlier turn j."""
        segs: list[tuple[int, int]] = []
        for j in range(turn):
            segs += self.added[j]
            segs.append((int(self.answer_ids[j, kept[j]]), self.answer_tokens))
        return (*segs, *self.added[turn])


def fitted_success(pool: Pool, names: Sequence[str], n_fit: int,
                   rng: np.random.Generator) -> dict[tuple[str, int], np.ndarray]:
    """The router's success model, as the single-turn ``ttca`` experiment fits it: per
    (language, context index), each model's Laplace-smoothed success rate on ``n_fit`` queries
    drawn from the pool's probabilities."""
    out = {}
    for lang in pool.languages:
        for ci in range(len(pool.contexts)):
            p = np.array([pool.models[m].p_success(lang, ci) for m in names])
            fit = rng.random((n_fit, len(names))) < p
            out[(lang, ci)] = (fit.sum(0) + 1) / (n_fit + 2)
    return out


def conversations(pool: Pool, n: int, language: str, first_context: int, turns: int,
                  seed: int, *, grow: bool = True, n_fit: int = 50,
                  names: Sequence[str] | None = None,
                  ids: SegmentIds | None = None) -> list[Conversation]:
    """``n`` conversations in ``language`` whose turn k has the pool's context length
    ``contexts[first_context + k]`` (``turns`` rungs, within the pool's ladder); with ``grow``
    False, follow-up questions on one document: turn 1 brings the whole document
    (``contexts[first_context]``), later turns only a question, every turn in that bucket.

    Seeded: the same arguments give the same conversations; the success model is fitted on
    queries of its own (``n_fit`` per setting), not on the evaluated turns. ``ids``: a segment
    counter to draw from, so that conversations of several calls never share content."""
    names = list(pool.models) if names is None else list(names)
    if language not in pool.languages:
        raise ValueError(f"language: one of {', '.join(pool.languages)}, got {language!r}")
    rungs = turns if grow else 1
    if turns < 1 or first_context < 0 or first_context + rungs > len(pool.contexts):
        raise ValueError(f"turns {turns} from context index {first_context}: the pool has "
                         f"{len(pool.contexts)} context lengths")
    rng = np.random.default_rng([seed, first_context, turns, pool.languages.index(language),
                                 int(grow)])
    pred = fitted_success(pool, names, n_fit, rng)
    ids = SegmentIds(TAG_KV_CONVERSATION) if ids is None else ids
    out_tok = pool.output_tokens
    ladder = [first_context + k if grow else first_context for k in range(turns)]
    p_true = np.array([[pool.models[m].p_success(language, ci) for m in names]
                       for ci in ladder])
    convs = []
    for c in range(n):
        added: list[Segments] = []
        length = 0
        for k, ci in enumerate(ladder):
            # the data chunk brings the prompt to the rung's length (the question included);
            # a follow-up on the same document brings none
            data = pool.contexts[ci] - length - QUESTION_TOKENS if grow or k == 0 else 0
            data_id, q_id = (int(x) for x in ids.take(2))
            chunk = ((data_id, data),) if data > 0 else ()
            added.append((*chunk, (q_id, QUESTION_TOKENS)))
            length += data + QUESTION_TOKENS + out_tok
        answers = ids.take(turns * len(names)).reshape(turns, len(names))
        correct = rng.random((turns, len(names))) < p_true
        success = np.stack([pred[(language, ci)] for ci in ladder])
        convs.append(Conversation(c, language, tuple(added), answers, out_tok, tuple(ladder),
                                  correct, success))
    return convs
