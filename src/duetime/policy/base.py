"""The routing-policy interface shared by the simulator and the gateway."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np

from duetime.estimate.base import InstanceView
from duetime.policy.registry import SEED, Param


@dataclass(slots=True)
class Candidate:
    """One instance the request may go to."""

    name: str
    model: str
    price_prompt: float    # USD per million tokens
    price_output: float
    view: InstanceView


@dataclass(slots=True)
class RoutingRequest:
    """What the router knows about a request when it routes it.

    ``quality``, ``success`` and ``output_tokens`` are *predictions*, one per candidate (in
    candidate order), filled when the policy declares it consumes them (``None`` otherwise);
    ``ttft_target`` in seconds; ``attempted``: models already tried for this request.
    ``prompt_hashes``: given an instance's KV block size, the chained hashes of the prompt's
    full blocks (in order; the caller memoises per block size and computes lazily), or ``None``
    when unknown (cache-aware policies then match nothing); the simulator fills it for every
    policy whenever its request set describes prompts by segments. ``session``: the session (a
    conversation, tenant or query being retried) the request belongs to, if known. ``lora``:
    the LoRA adapter it names (vLLM's ``lora_int_id`` on the candidates; 0: the base model).
    ``deadline``: seconds left until its end-to-end deadline; ``tpot_target``: its
    time-per-output-token target (s; both inf: none); ``output_p90``: the 90th percentile of
    its output length per candidate, where the predictor gives one (``output_tokens`` is the
    median then): ``sfs-deadline`` reads them (:mod:`duetime.policy.deadline`).
    """

    id: str
    prompt_tokens: int
    quality: np.ndarray | None
    output_tokens: np.ndarray
    ttft_target: float
    task: str = ""
    session: str | None = None
    attempted: frozenset[str] = field(default_factory=frozenset)
    success: np.ndarray | None = None
    prompt_hashes: Callable[[int], Sequence[int]] | None = None
    lora: int = 0
    deadline: float = math.inf
    tpot_target: float = math.inf
    output_p90: np.ndarray | None = None


@dataclass(slots=True)
class Decision:
    """The chosen candidate (index) and, if the policy made one, its TTFT forecast (s)."""

    index: int
    forecast: float | None = None


@dataclass(slots=True)
class Described:
    """What a policy weighed for each candidate (:meth:`Policy.describe`): named columns of
    per-candidate numbers (``forecast_ttft_s``, ``forecast_e2e_s``, ``utility``, ``score``,
    ...; ``None`` entries where a number was not made), which column it ranks by and whether
    higher or lower wins, and the rule that picked the chosen one, in words."""

    columns: dict[str, Sequence[float | bool | None]]
    score: str | None = None
    better: str = "higher"
    rule: str = ""


class Candidates(tuple):
    """A fixed candidate list (a tuple of :class:`Candidate`) that keeps what a decision
    derives from it and not from the request: the prices as arrays and the views. A caller that
    routes every request over the same pool (the simulator) passes one, so that a decision over
    hundreds of instances does not gather them again; any sequence of candidates also works."""

    @cached_property
    def prices(self) -> np.ndarray:
        """(n, 2): USD per million prompt and output tokens."""
        return np.array([(c.price_prompt, c.price_output) for c in self], dtype=float
                        ).reshape(len(self), 2)

    @cached_property
    def views(self) -> tuple[InstanceView, ...]:
        return tuple(c.view for c in self)


def prices_of(cands: Sequence[Candidate]) -> np.ndarray:
    """(n, 2) prices of the candidates (kept by a :class:`Candidates`)."""
    if isinstance(cands, Candidates):
        return cands.prices
    return Candidates(cands).prices


def views_of(cands: Sequence[Candidate]) -> Sequence[InstanceView]:
    """The candidates' views (the same tuple each time for a :class:`Candidates`)."""
    return cands.views if isinstance(cands, Candidates) else [c.view for c in cands]


def utility(req: RoutingRequest, cands: Sequence[Candidate], lam: float) -> np.ndarray:
    """U = predicted quality - lambda * predicted cost (micro-dollars), per candidate."""
    p = prices_of(cands)
    return req.quality - lam * (p[:, 0] * req.prompt_tokens + p[:, 1] * req.output_tokens)


class Policy(ABC):
    """Chooses a candidate for each request. ``rng`` breaks ties (seeded).

    A concrete policy declares (see :mod:`duetime.policy.registry`) its ``name``, a one-line
    ``summary``, its ``params`` (their ``arg`` names are its constructor's keywords) and what it
    ``consumes``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = (SEED,)
    consumes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    @abstractmethod
    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision: ...

    def preview(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        """The choice :meth:`choose` would make now, leaving every later choice as it would
        have been (a dry run: ``POST /duetime/route``): the tie-break generator is put back,
        and a policy with memory (a cursor, session bindings, a prefix index it records on)
        overrides :meth:`peek` to read it without writing."""
        state = self.rng.bit_generator.state
        try:
            return self.peek(req, cands, now)
        finally:
            self.rng.bit_generator.state = state

    def peek(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        """:meth:`choose` without its writes (a policy without memory: its class's
        :meth:`choose`)."""
        return type(self).choose(self, req, cands, now)

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        """The numbers behind a choice of ``chosen`` among ``cands`` now, for every candidate
        (an explanation: :mod:`duetime.policy.explain`; it reads, never writes). A policy that
        weighs nothing (round-robin) has none."""
        return Described({}, rule=self.summary)

    def _argmax_random(self, scores: np.ndarray) -> int:
        best = np.flatnonzero(scores == scores.max())
        return int(best[0] if len(best) == 1 else self.rng.choice(best))
