"""Attempts on one instance's live state, through the attempt lifecycle as the relay and the
picker drive it (tests that exercise an :class:`InstanceState` without a network)."""

from __future__ import annotations

from collections.abc import Sequence

from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome

LIFECYCLE = Lifecycle()  # (no pool-wide subscribers: the instance's own parts only)


def dispatch(s: InstanceState, fid: str, prompt_tokens: int, predicted: int, t: float,
             forecast: float | None, hashes: Sequence[int] | None = None, *,
             lifecycle: Lifecycle = LIFECYCLE) -> Attempt:
    f = s.new_flight(fid, prompt_tokens, predicted, t, forecast, hashes)
    return lifecycle.dispatch(Attempt(f, s, 1, t, 1.0, "test", s.source()))


def first_token(a: Attempt, t: float, *, lifecycle: Lifecycle = LIFECYCLE) -> None:
    lifecycle.record_first_token(a, t)


def progress(a: Attempt, tokens: int, *, lifecycle: Lifecycle = LIFECYCLE) -> None:
    lifecycle.record_progress(a, tokens)


def end(a: Attempt, t: float, *, output_tokens: int | None = None,
        outcome: Outcome = Outcome.OK, lifecycle: Lifecycle = LIFECYCLE) -> bool:
    return lifecycle.end(a, t, outcome, output_tokens=output_tokens)
