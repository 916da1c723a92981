"""llm-d's LoRA-affinity baseline: where a request's adapter already has requests, else where
another adapter fits (``lora-affinity``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from duetime.policy import cache_aware
from duetime.policy.base import Candidate, Decision, Described, Policy, RoutingRequest
from duetime.policy.cache_aware import load_scorers
from duetime.policy.registry import LOAD, LORA, SEED, Param


def lora_affinity_score(lora: int, live: frozenset[int], max_loras: int) -> float:
    """llm-d's lora-affinity scorer (github.com/llm-d/llm-d-router,
    ``pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go``) from an
    instance's ``vllm:lora_requests_info``: 1.0 if the adapter is active there, else 0.8 if
    the adapters listed (running and waiting, counted once) are fewer than ``max_lora``, else
    0.6 if it is waiting there, else 0. vLLM 0.32 puts one list in both labels (the adapters
    of the requests scheduled and not finished), so "waiting" implies "active" and the 0.6
    tier is never reached (as llm-d's code says). The base model (``lora`` 0) scores 1.0
    everywhere."""
    if lora <= 0 or lora in live:
        return 1.0
    return 0.8 if len(live) < max_loras else 0.0


LORA_WEIGHT = Param("lora-weight", "lora_weight", float, 1.0,
                    "weight of the lora-affinity scorer", min=0.0)
# prefix-load's load-scorer weights, at 1 each here (see LoraAffinity)
QUEUE_WEIGHT = replace(cache_aware.QUEUE_WEIGHT, default=1.0)
KV_WEIGHT = replace(cache_aware.KV_WEIGHT, default=1.0)
LOAD_WEIGHT = cache_aware.LOAD_WEIGHT


class LoraAffinity(Policy):
    """``lora-affinity``: a weighted sum of llm-d scorers in [0, 1] — lora-affinity
    (:func:`lora_affinity_score`) and the load scorers
    (:func:`~duetime.policy.cache_aware.load_scorers`: queue, kv-cache-utilization and, at
    weight 0 by default, load-aware) — the highest
    total wins, random tie-break (llm-d's ``max-score-picker``). llm-d ships no default LoRA
    profile; the default weights, 1 each for the first three, give the adapter scorer as much
    say as each load scorer (its ``schedulingProfiles`` take any weights: set them here)."""

    name = "lora-affinity"
    summary = ("llm-d's lora-affinity scorer (1 where the adapter has requests, 0.8 where "
               "another fits under max_loras, else 0) plus its queue and kv-cache-utilization "
               "scorers, weights 1:1:1; the best total, random tie-break")
    params = (SEED, LORA_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT, LOAD_WEIGHT)
    consumes = frozenset({LOAD, LORA})

    def __init__(self, *, seed: int = 0, lora_weight: float = LORA_WEIGHT.default,
                 queue_weight: float = QUEUE_WEIGHT.default, kv_weight: float = KV_WEIGHT.default,
                 load_weight: float = LOAD_WEIGHT.default) -> None:
        super().__init__(seed=seed)
        self.lora_weight = lora_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.load_weight = load_weight

    def scorers(self, req: RoutingRequest, cands: list[Candidate]) -> dict[str, np.ndarray]:
        """Each weighted scorer's weighted scores per candidate (those of weight 0 left
        out), and their ``score``, the total."""
        parts: dict[str, np.ndarray] = {}
        if self.lora_weight:
            parts["lora"] = self.lora_weight * np.array(
                [lora_affinity_score(req.lora, *c.view.lora_adapters) for c in cands])
        parts.update(load_scorers(cands, self.queue_weight, self.kv_weight, self.load_weight))
        parts["score"] = sum(parts.values(), np.zeros(len(cands)))
        return parts

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        return Decision(self._argmax_random(self.scorers(req, cands)["score"]))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        parts = self.scorers(req, cands)
        return Described({k: v.tolist() for k, v in parts.items()}, "weighted score",
                         "higher", "the best weighted sum of the scorers (" + ", ".join(
                             k for k in parts if k != "score") + "); ties at random")
