"""A flight: one upstream attempt as the gateway records it, and the store that keeps each
instance's flights (this process's memory, or Redis shared by the gateway's replicas:
:mod:`duetime.gateway.backends`).

The fields are what another gateway replica needs to replay the attempt in its own shadow
replica (Redis carries them: :mod:`duetime.gateway.backends.redis_flights`); what else the
gateway knows of an attempt is on its :class:`~duetime.gateway.state.lifecycle.Attempt`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class Flight:
    """One upstream attempt, as the gateway observes it."""

    __slots__ = ("cached_tokens", "dispatched", "first_token", "forecast", "hashes", "id",
                 "lora", "predicted", "prompt_tokens", "raw_forecast", "shadowed", "tokens")

    def __init__(self, fid: str, prompt_tokens: int, predicted: int, dispatched: float,
                 forecast: float | None, hashes: Sequence[int] | None = None,
                 lora: int = 0) -> None:
        self.id = fid
        self.lora = lora  # its LoRA adapter (the gateway's id; 0: the base model)
        self.prompt_tokens = prompt_tokens
        self.hashes = hashes  # its prompt's block keys at the instance's block size, if caching
        self.predicted = predicted
        self.dispatched = dispatched
        self.forecast = forecast  # the TTFT the policy forecast (from dispatch), if it did
        self.first_token: float | None = None  # when its first token came (monotonic)
        self.tokens = 0
        self.shadowed = False  # whether it joined the instance's shadow replica
        self.cached_tokens = 0  # prompt tokens the gateway believed cached there at dispatch
        self.raw_forecast: float | None = None  # the forecast before the online correction


class FlightStore(Protocol):
    """Where in-flight attempts are kept, per instance (by name)."""

    def add(self, instance: str, flight: Flight) -> None:
        """A dispatched attempt."""
        ...

    def update(self, instance: str, flight: Flight) -> None:
        """The attempt's first token or token count changed (already set on ``flight``)."""
        ...

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        """The attempt ended at ``t`` (finished, failed or cancelled); None if unknown."""
        ...

    def flights(self, instance: str) -> Mapping[str, Flight]:
        """The instance's attempts in flight, in dispatch order."""
        ...

    def ended(self, instance: str) -> Mapping[str, float]:
        """Attempts that ended in the last seconds: id -> end time, oldest first."""
        ...
