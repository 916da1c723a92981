"""The attempt lifecycle (duetime.gateway.state.lifecycle): each event published once, in
order — the instance's own subscribers, then the pool-wide ones — with the guarantees that
spare subscribers their checks."""

from __future__ import annotations

from types import SimpleNamespace

from duetime.gateway.state.flight import Flight
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome, Subscriber


class Log(Subscriber):
    """Writes down every event it gets, with what the flight said then."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def on_dispatch(self, a: Attempt) -> None:
        self.seen.append((self.name, "dispatch", a.flight.first_token, a.flight.tokens))

    def on_first_token(self, a: Attempt) -> None:
        self.seen.append((self.name, "first", a.flight.first_token, a.flight.tokens))

    def on_progress(self, a: Attempt) -> None:
        self.seen.append((self.name, "progress", a.flight.first_token, a.flight.tokens))

    def on_end(self, a: Attempt) -> None:
        self.seen.append((self.name, "end", a.outcome, a.output_tokens))


class OnlyEnds(Subscriber):
    def __init__(self, seen: list) -> None:
        self.seen = seen

    def on_end(self, a: Attempt) -> None:
        self.seen.append(("ends", "end", a.outcome, a.failure))


def _attempt(inst) -> Attempt:
    return Attempt(Flight("r-1", 10, 4, 0.0, None), inst, 1, 0.0, 1.0, "sfs", "shadow")


def test_events_go_once_in_order_instance_first():
    seen: list = []
    inst = SimpleNamespace(subscribers=[Log("ledger", seen), Log("shadow", seen)])
    life = Lifecycle([Log("pool", seen)])
    a = life.dispatch(_attempt(inst))
    life.record_progress(a, 3)  # (before the first token: ignored)
    life.record_first_token(a, 0.5, 2)
    life.record_first_token(a, 0.7)  # (once)
    life.record_progress(a, 2)  # (unchanged: ignored)
    life.record_progress(a, 5)
    assert life.end(a, 1.0, Outcome.OK, output_tokens=5)
    assert not life.end(a, 1.1, Outcome.CANCELLED)  # (once)
    life.record_progress(a, 9)  # (after the end: ignored)
    life.record_first_token(a, 2.0)
    order = ["ledger", "shadow", "pool"]
    assert seen == [
        *[(n, "dispatch", None, 0) for n in order],
        *[(n, "first", 0.5, 2) for n in order],  # (the time and count set before)
        *[(n, "progress", 0.5, 5) for n in order],
        *[(n, "end", Outcome.OK, 5) for n in order]]
    assert (a.outcome, a.ended, a.flight.tokens) == (Outcome.OK, 1.0, 5)


def test_a_subscriber_gets_only_what_it_handles_and_a_rebuilt_instance_is_seen():
    seen: list = []
    inst = SimpleNamespace(subscribers=[OnlyEnds(seen)])
    life = Lifecycle()
    a = life.dispatch(_attempt(inst))
    life.record_first_token(a, 0.1)
    life.end(a, 0.2, Outcome.FAILED, failure=("status_5xx", "upstream answered 503"))
    assert seen == [("ends", "end", Outcome.FAILED, ("status_5xx", "upstream answered 503"))]
    inst.subscribers = [Log("new", seen)]  # (a rebuilt replica: a new list of its parts)
    b = life.dispatch(_attempt(inst))
    assert seen[-1] == ("new", "dispatch", None, 0)
    assert b.outcome is None
