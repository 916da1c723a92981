"""Outlier detection and the ejection budget (duetime.gateway.state.health), on a fake clock."""

from __future__ import annotations

import pytest

from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.health import EjectionBudget, HealthTracker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tracker(name: str = "a", budget: EjectionBudget | None = None, **kw) -> HealthTracker:
    kw.setdefault("clock", Clock())
    return HealthTracker(name, GatewayMetrics(), budget or EjectionBudget(10, 0.5), **kw)


@pytest.mark.parametrize(("size", "fraction", "limit"), [
    (1, 0.5, 0), (1, 1.0, 0), (2, 0.5, 1), (3, 0.5, 1), (3, 1.0, 2), (10, 0.1, 1),
    (10, 0.5, 5), (10, 0.0, 0), (4, 0.75, 3)])
def test_the_budget_never_lets_the_pool_empty(size: int, fraction: float, limit: int) -> None:
    assert EjectionBudget(size, fraction).limit == limit


def test_failures_in_a_row_eject_and_a_passing_probe_readmits() -> None:
    h = tracker(eject_after=3)
    for _ in range(2):
        h.report_failure("status_5xx", "boom")
    h.report_success()  # (breaks the run)
    h.report_failure("status_5xx", "boom")
    assert h.healthy and h.failures == 1
    h.report_failure("status_5xx", "boom")
    h.report_failure("status_5xx", "boom")
    assert not h.healthy and h.budget.ejected == {"a"}
    h.probe(True, "")
    assert h.healthy and h.budget.ejected == set() and h.window() == (0, 0)


def test_a_failure_rate_over_the_window_ejects_without_a_run() -> None:
    """Every other attempt fails (never three in a row): ejected once the window holds
    min_requests attempts at >= failure_rate; not if they are spread beyond the window."""
    clock = Clock()
    h = tracker(eject_after=3, window_s=10.0, failure_rate=0.5, min_requests=6, clock=clock)
    for k in range(6):
        (h.report_failure("status_5xx", "x") if k % 2 else h.report_success())
        clock.t += 1.0
    assert not h.healthy
    clock2 = Clock()
    h2 = tracker(eject_after=3, window_s=10.0, failure_rate=0.5, min_requests=6, clock=clock2)
    for k in range(12):
        (h2.report_failure("status_5xx", "x") if k % 2 else h2.report_success())
        clock2.t += 4.0  # (never more than 3 attempts in a window)
    assert h2.healthy
    assert h2.window()[1] <= 3


def test_a_connect_error_ejects_at_once_but_not_past_the_budget() -> None:
    budget = EjectionBudget(3, 0.5)  # one of three
    a, b, c = (tracker(n, budget) for n in "abc")
    a.report_failure("connect", "refused")
    b.report_failure("connect", "refused")
    c.report_failure("connect", "refused")
    assert [x.healthy for x in (a, b, c)] == [False, True, True]
    a.probe(True, "")
    b.report_failure("connect", "refused")
    assert [x.healthy for x in (a, b, c)] == [True, False, True]


def test_badness_orders_by_failure_rate_then_run_then_ejection_age() -> None:
    clock = Clock()
    budget = EjectionBudget(10, 1.0)
    x, y = tracker("x", budget, clock=clock), tracker("y", budget, clock=clock)
    for _ in range(3):
        x.report_failure("status_5xx", "")
    y.report_failure("status_5xx", "")
    y.report_success()
    assert y.badness() < x.badness()


def test_a_failed_probe_is_remembered_for_the_gateways_health() -> None:
    h = tracker()
    assert h.probe_ok
    h.probe(False, "/health answered 503")
    assert not h.probe_ok
    h.probe(True, "")
    assert h.probe_ok


def test_a_peer_replicas_ejection_waits_for_that_replica_and_is_not_told_back() -> None:
    told: list[bool] = []
    h = tracker()
    h.on_change = told.append
    h.eject("ejected by gateway replica r2", peer="r2")
    assert not h.healthy and h.peer_ejected == "r2" and told == []
    h.probe(True, "")  # (this replica's probe passes: the ejecting replica decides)
    assert not h.healthy
    h.readmit()  # (the store: r2 readmitted it)
    assert h.healthy and h.peer_ejected is None and told == []
    h.report_failure("connect", "refused")  # this replica's own ejection goes to the store
    assert not h.healthy and told == [True]
    h.probe(True, "")
    assert h.healthy and told == [True, False]
