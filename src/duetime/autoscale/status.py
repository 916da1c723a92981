"""What an autoscaler sees at a tick, and what it is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Recent:
    """A model's requests routed in the last ``lookback`` seconds, as known at the tick (NaN
    where a request has no first token or no finish yet): arrays aligned by request."""

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    target: np.ndarray          # TTFT target, s
    output_tokens: np.ndarray
    prompt: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def empty(cls) -> Recent:
        z = np.zeros(0)
        return cls(z, z, z, z, z, z)

    def first_tokens_since(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(TTFT, target) of the requests whose first token came after ``t``."""
        ok = self.first_token > t  # (NaN compares False)
        return self.first_token[ok] - self.arrival[ok], self.target[ok]

    def forecast_ratio(self, ttft: Callable[[int], float]) -> float | None:
        """A typical request's forecast TTFT over its target: ``ttft(prompt tokens)`` (the
        least over the model's serving replicas) of the median prompt, over the median
        target; None without requests. Above 1, the next such request is late wherever it
        goes (:attr:`PoolStatus.forecast_ratio`)."""
        target = float(np.median(self.target)) if self.target.size else 0.0
        if not target > 0:
            return None
        prompt = max(1, int(np.median(self.prompt))) if self.prompt.size else 1
        return ttft(prompt) / target

    def tpot_since(self, t: float) -> np.ndarray:
        """Time per output token (after the first) of the requests that finished after ``t``
        with more than one token."""
        ok = (self.finish > t) & (self.output_tokens > 1)
        return ((self.finish[ok] - self.first_token[ok]) / (self.output_tokens[ok] - 1))


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """What an autoscaler sees at a tick: per model, its replicas by state, the requests routed
    to it since the last tick, those queued or running at its serving replicas now, and its
    recent requests' first tokens and finishes (:class:`Recent`)."""

    t: float
    interval_s: float
    ready: Mapping[str, int]
    starting: Mapping[str, int]
    draining: Mapping[str, int]
    routed: Mapping[str, int]
    waiting: Mapping[str, int]
    running: Mapping[str, int]
    recent: Mapping[str, Recent] = field(default_factory=dict)
    models: tuple[str, ...] = ()
    # per model: the engines' forecast of a typical request's TTFT (the recent median prompt)
    # over its target (the recent median), at the best of the model's serving replicas: > 1
    # means the next such request is late wherever it goes; absent without recent requests
    forecast_ratio: Mapping[str, float] = field(default_factory=dict)
    scale_up_delay_s: float = 0.0

    def provisioned(self, model: str) -> int:
        """Replicas serving or starting (what a scale-up adds to)."""
        return self.ready.get(model, 0) + self.starting.get(model, 0)

    def recent_of(self, model: str) -> Recent:
        return self.recent.get(model) or Recent.empty()


class Autoscaler(Protocol):
    """Decides, at each tick, how many replicas of each model the pool should have (models it
    leaves out keep what they have). Stateful: it may remember earlier ticks."""

    name: ClassVar[str]

    def desired(self, status: PoolStatus) -> Mapping[str, int]: ...
