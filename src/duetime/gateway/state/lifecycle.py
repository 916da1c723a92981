"""One attempt's lifecycle: dispatch, first token, progress, end — each event published once, to
every subscriber, in one documented order.

An *attempt* is one upstream request made for a client's request (a retry is another attempt).
The relay (``duetime serve``) and the endpoint picker (``duetime epp``, where Envoy relays)
publish the same events through a :class:`Lifecycle`; everything that learns from attempts is a
:class:`Subscriber` and learns only from these events (as LiteLLM's routing strategies learn
only through its logging callbacks):

1. the attempt's instance's own parts (:attr:`InstanceState.subscribers`, in this order): its
   in-flight ledger, its KV-event cache view, its shadow replica, its TTFT correction, its
   health;
2. then the pool-wide ones, in the order the gateway lists them (``gateway/app.py``): the
   gateway's own load, the admission queue, key metering, the observatory (the dashboard),
   the desired-replica signal, Prometheus.

What the lifecycle guarantees, so that no subscriber has to check: ``on_dispatch`` first, once;
``on_first_token`` at most once, before the end (the flight's ``first_token`` time and a token
count of at least 1 are set before it is published); ``on_progress`` only between the first
token and the end, and only when the count changed; ``on_end`` last, exactly once, with the
:class:`Outcome` set. A subscriber reads the attempt; it does not change it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from duetime.gateway.keys import ApiKey
from duetime.gateway.state.flight import Flight

if TYPE_CHECKING:  # (annotations only: the instance imports this module)
    from duetime.gateway.state.instance import InstanceState


class Outcome(enum.StrEnum):
    """How an attempt ended."""

    OK = "ok"                # the instance answered (a completion, or a client error relayed)
    FAILED = "failed"        # it failed before the client got anything from it (retriable)
    BROKEN = "broken"        # its stream broke after the client got bytes from it
    CANCELLED = "cancelled"  # the client went away, the server cut it, or Envoy moved it


@dataclass(slots=True, eq=False)
class Attempt:
    """One upstream attempt and what its subscribers read of it."""

    flight: Flight             # what the ledger keeps (and shares): ids, tokens, times
    inst: InstanceState        # where it was sent
    number: int                # 1 for a request's first attempt
    arrival: float             # the client's request arrived (monotonic): TTFT counts from it
    target_s: float            # the request's TTFT target (seconds)
    policy: str                # the policy that chose the instance
    state_source: str          # where the decision read the instance's state from
    tpot_target_s: float | None = None
    failing_open: bool = False  # sent to an instance out of rotation (none was in it)
    explanation: dict[str, Any] | None = None
    key: ApiKey | None = None  # the client's API key, where keys are checked
    client: str = ""           # the client as admission knows it (its key, else its address)
    # set by the lifecycle at the end
    outcome: Outcome | None = None
    ended: float | None = None
    output_tokens: int | None = None  # the instance's count (its usage), where known
    failure: tuple[str, str] | None = None  # (kind, message) of a FAILED attempt


class Subscriber:
    """What learns from attempts: override the events it needs (the others do nothing)."""

    def on_dispatch(self, a: Attempt) -> None:
        """The attempt was sent to ``a.inst`` at ``a.flight.dispatched``."""

    def on_first_token(self, a: Attempt) -> None:
        """Its first token came at ``a.flight.first_token``."""

    def on_progress(self, a: Attempt) -> None:
        """It has streamed ``a.flight.tokens`` tokens so far."""

    def on_end(self, a: Attempt) -> None:
        """It ended at ``a.ended`` with ``a.outcome``."""


EVENTS = ("on_dispatch", "on_first_token", "on_progress", "on_end")


def _handles(s: Subscriber, event: str) -> bool:
    """Whether ``s`` overrides ``event`` (the others' no-ops are not called: a streamed token
    is one event, and most subscribers ignore it)."""
    return getattr(type(s), event, None) is not getattr(Subscriber, event)


Handler = Callable[[Attempt], None]


class Lifecycle:
    """Publishes attempts' events: to the attempt's instance's own subscribers, then to
    ``subscribers`` (the pool-wide ones, fixed here), each in order."""

    def __init__(self, subscribers: Sequence[Subscriber] = ()) -> None:
        self.subscribers = tuple(subscribers)
        # per instance (held, so that its id is not reused while planned): its subscriber
        # list (a new one when its replica is rebuilt) and, per event, the handlers to call
        self._plans: dict[int, tuple[InstanceState, Sequence[Subscriber],
                                     dict[str, list[Handler]]]] = {}

    def forget(self, inst: InstanceState) -> None:
        """The instance left the pool: its plan is dropped."""
        plan = self._plans.get(id(inst))
        if plan is not None and plan[0] is inst:
            del self._plans[id(inst)]

    def _handlers(self, a: Attempt, event: str) -> list[Handler]:
        own = a.inst.subscribers
        plan = self._plans.get(id(a.inst))
        if plan is None or plan[1] is not own:
            everyone = [*own, *self.subscribers]
            plan = (a.inst, own, {e: [getattr(s, e) for s in everyone if _handles(s, e)]
                                  for e in EVENTS})
            self._plans[id(a.inst)] = plan
        return plan[2][event]

    def dispatch(self, a: Attempt) -> Attempt:
        for handle in self._handlers(a, "on_dispatch"):
            handle(a)
        return a

    def record_first_token(self, a: Attempt, t: float, tokens: int = 1) -> None:
        """The attempt's first token came at ``t``, with ``tokens`` streamed by then (ignored
        after the first, or after its end)."""
        f = a.flight
        if f.first_token is not None or a.outcome is not None:
            return
        f.first_token = t
        f.tokens = max(f.tokens, tokens, 1)
        for handle in self._handlers(a, "on_first_token"):
            handle(a)

    def record_progress(self, a: Attempt, tokens: int) -> None:
        """The attempt has streamed ``tokens`` tokens (ignored before its first token, after
        its end, or when unchanged)."""
        f = a.flight
        if a.outcome is not None or f.first_token is None or tokens == f.tokens:
            return
        f.tokens = tokens
        for handle in self._handlers(a, "on_progress"):
            handle(a)

    def end(self, a: Attempt, t: float, outcome: Outcome, *, output_tokens: int | None = None,
            failure: tuple[str, str] | None = None) -> bool:
        """The attempt ended at ``t``; False (nothing published) if it had ended already."""
        if a.outcome is not None:
            return False
        a.outcome, a.ended, a.output_tokens, a.failure = outcome, t, output_tokens, failure
        for handle in self._handlers(a, "on_end"):
            handle(a)
        return True
