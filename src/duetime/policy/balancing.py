"""Load balancers that ignore quality and cost: round-robin, shortest queue, llm-d load-aware."""

from __future__ import annotations

import numpy as np

from duetime.policy.base import Candidate, Decision, Described, Policy, RoutingRequest
from duetime.policy.registry import LOAD


class RoundRobin(Policy):
    name = "round-robin"
    summary = "a cursor over the candidates"

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self._cursor = 0

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        i = self._cursor % len(cands)
        self._cursor += 1
        return Decision(i)

    def peek(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        return Decision(self._cursor % len(cands))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        return Described({}, rule="the cursor's turn (it weighs nothing)")


class ShortestQueue(Policy):
    """Fewest resident requests (running + waiting); random tie-break."""

    name = "shortest-queue"
    summary = "fewest resident requests (running + waiting); random tie-break"
    consumes = frozenset({LOAD})

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        load = np.array([c.view.num_running + c.view.num_waiting for c in cands])
        return Decision(self._argmax_random(-load))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        load = [c.view.num_running + c.view.num_waiting for c in cands]
        return Described({"score": load}, "load (running + waiting)", "lower",
                         "the fewest resident requests (running + waiting); ties at random")


def load_aware_score(waiting: int) -> float:
    """llm-d's load-aware scorer: 0.5 with an empty queue, falling to 0 at 128 waiting."""
    return 0.5 if waiting == 0 else 0.5 * (1.0 - min(waiting, 128) / 128.0)


class LoadAware(Policy):
    """llm-d load-aware: the highest scorer (vllm:num_requests_waiting), random tie-break."""

    name = "load-aware"
    summary = ("llm-d's load-aware scorer: 0.5 if nothing waits, else 0.5 (1 - min(waiting, "
               "128) / 128); the best score, random tie-break")
    consumes = frozenset({LOAD})

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        scores = np.array([load_aware_score(c.view.num_waiting) for c in cands])
        return Decision(self._argmax_random(scores))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        return Described({"score": [load_aware_score(c.view.num_waiting) for c in cands]},
                         "load-aware score", "higher",
                         "the best load-aware score (0.5 with nothing waiting, falling to 0 "
                         "at 128 waiting); ties at random")
