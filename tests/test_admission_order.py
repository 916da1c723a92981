"""The admission order shared by the gateway's queue and the simulator's
(duetime.policy.admission_order): priority bands, then least attained service across keys, then
the earliest deadline within a key."""

from __future__ import annotations

import math

import pytest

from duetime.policy.admission_order import AdmissionOrder, AttainedService, band_of


def drain(order: AdmissionOrder[str]) -> list[str]:
    out = []
    while (e := order.pop()) is not None:
        out.append(e.payload)
    return out


def test_within_a_key_the_earliest_deadline_goes_first_arrival_breaking_ties() -> None:
    o: AdmissionOrder[str] = AdmissionOrder()
    for name, deadline in [("late", 9.0), ("soon", 2.0), ("tie1", 5.0), ("tie2", 5.0),
                           ("sooner", 1.0)]:
        o.push("a", 0, deadline, name)
    assert len(o) == 5
    assert drain(o) == ["sooner", "soon", "tie1", "tie2", "late"]
    assert len(o) == 0 and o.pop() is None


def test_a_higher_band_goes_first_whatever_its_key_has_been_served() -> None:
    o: AdmissionOrder[str] = AdmissionOrder()
    o.served("heavy", 1e6, now=0.0)
    o.push("light", 1, 0.5, "light-standard")
    o.push("heavy", 0, 100.0, "heavy-critical")
    assert drain(o) == ["heavy-critical", "light-standard"]


def test_the_least_served_key_goes_first_even_behind_earlier_deadlines() -> None:
    """A heavy key's waiters, earlier in deadline and arrival, go after a light key's."""
    o: AdmissionOrder[str] = AdmissionOrder()
    o.served("heavy", 10_000, now=0.0)
    o.served("light", 1_000, now=0.0)
    for k in range(3):
        o.push("heavy", 0, 1.0 + k, f"h{k}")
    o.push("light", 0, 50.0, "l0")
    o.push("light", 0, 40.0, "l1")
    assert drain(o) == ["l1", "l0", "h0", "h1", "h2"]


def test_service_fed_while_waiting_changes_who_goes_next() -> None:
    o: AdmissionOrder[str] = AdmissionOrder()
    o.push("a", 0, 1.0, "a1")
    o.push("a", 0, 2.0, "a2")
    o.push("b", 0, 3.0, "b1")
    assert o.pop().payload == "a1"  # (a tie at 0: the earliest deadline)
    o.served("a", 500, now=1.0)  # a1 was served
    assert o.pop().payload == "b1"
    o.served("b", 5_000, now=2.0)
    assert o.pop().payload == "a2"


def test_keys_that_tie_take_turns() -> None:
    """No service known (none fed): the keys go in turn, each in its own deadline order —
    a key with many waiters does not take every turn."""
    o: AdmissionOrder[str] = AdmissionOrder()
    for tag in ("a1", "a2", "a3"):
        o.push("a", 0, 1.0, tag)
    o.push("b", 0, 2.0, "b1")
    o.push("c", 0, 3.0, "c1")
    assert drain(o) == ["a1", "b1", "c1", "a2", "a3"]


def test_attained_service_decays_with_its_half_life() -> None:
    s = AttainedService(half_life_s=10.0)
    assert s.value("never", 0.0) == 0.0
    s.add("a", 1000, now=0.0)
    assert s.value("a", 0.0) == pytest.approx(1000)
    assert s.value("a", 10.0) == pytest.approx(500)
    assert s.value("a", 30.0) == pytest.approx(125)
    s.add("b", 400, now=30.0)  # (past a half-life: the reference moves)
    assert s.value("a", 30.0) == pytest.approx(125) and s.value("b", 30.0) == pytest.approx(400)
    assert s.values(40.0) == pytest.approx({"a": 62.5, "b": 200})
    assert s.level("a") < s.level("b")
    s.add("c", 1, now=1000.0)  # (a and b decayed to nothing: forgotten)
    assert set(s.values(1000.0)) == {"c"}
    assert AttainedService(math.inf).value("x", 1e9) == 0.0
    with pytest.raises(ValueError):
        AttainedService(0.0)


def test_a_key_heavy_long_ago_is_not_punished_now() -> None:
    """Decay is what "recently" means: 10x the tokens five half-lives ago weigh less than a
    third of them now."""
    o: AdmissionOrder[str] = AdmissionOrder(half_life_s=60.0)
    o.served("once-heavy", 10_000, now=0.0)
    o.served("steady", 3_500, now=300.0)
    o.push("steady", 0, 301.0, "steady")
    o.push("once-heavy", 0, 302.0, "once-heavy")
    assert drain(o) == ["once-heavy", "steady"]
    no_decay: AdmissionOrder[str] = AdmissionOrder(half_life_s=math.inf)
    no_decay.served("once-heavy", 10_000, now=0.0)
    no_decay.served("steady", 3_500, now=300.0)
    no_decay.push("steady", 0, 301.0, "steady")
    no_decay.push("once-heavy", 0, 302.0, "once-heavy")
    assert drain(no_decay) == ["steady", "once-heavy"]


def test_removed_entries_never_come_out_and_the_order_holds() -> None:
    o: AdmissionOrder[int] = AdmissionOrder()
    entries = [o.push("a" if k % 2 else "b", 0, float(k % 7), k) for k in range(100)]
    for e in entries[::3]:
        assert o.remove(e)
        assert not o.remove(e)  # (once)
    left = {e.payload for e in entries} - {e.payload for e in entries[::3]}
    assert len(o) == len(left)
    assert {e.payload for e in o} == left
    out = drain(o)
    assert sorted(out) == sorted(left)
    for key in (0, 1):  # each key's own order: by deadline, then arrival
        mine = [k for k in out if k % 2 == key]
        assert mine == sorted(mine, key=lambda k: (k % 7, k))
    # a key whose only waiter is removed leaves no trace in the band
    e = o.push("z", 0, 1.0, -1)
    o.remove(e)
    assert o.peek() is None and len(o) == 0


def test_a_full_queue_displaces_the_most_served_keys_latest_waiter() -> None:
    o: AdmissionOrder[str] = AdmissionOrder()
    o.served("heavy", 9_000, now=0.0)
    o.served("mid", 3_000, now=0.0)
    for k in range(3):
        o.push("heavy", 0, 10.0 - k, f"h{k}")  # h0 has the latest deadline
    o.push("mid", 0, 1.0, "m0")
    o.push("low-band", 1, 1.0, "s0")
    # a lower band is displaced first, whoever its key
    assert o.victim("light", 0).payload == "s0"
    o.remove(o.victim("light", 0))
    # then the most served key's latest deadline
    assert o.victim("light", 0).payload == "h0"
    assert o.victim("mid", 0).payload == "h0"
    # the most served key itself, or a key served as much, displaces nobody
    assert o.victim("heavy", 0) is None
    o.served("light", 9_000, now=0.0)
    assert o.victim("light", 0) is None
    # nor does a newcomer of a lower band than everyone waiting
    assert o.victim("anyone", 1) is None
    assert AdmissionOrder().victim("a", 0) is None


def test_bands_by_priority_name() -> None:
    bands = ("critical", "standard", "sheddable")
    assert [band_of(p, bands) for p in (*bands, "other")] == [0, 1, 2, 3]
