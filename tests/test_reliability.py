"""The reliability suite: real processes on loopback (three `duetime emulate`, `duetime serve`
over them), the scenarios of `benchmarks/reliability.py` at a small size. Nothing may be lost:
no retryable failure reaches a client, no stream is cut, none ends with an error event (a
broken one continues on another instance)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "reliability", Path(__file__).resolve().parents[1] / "benchmarks" / "reliability.py")
reliability = importlib.util.module_from_spec(_SPEC)
sys.modules["reliability"] = reliability  # (its dataclasses look their module up)
_SPEC.loader.exec_module(reliability)  # type: ignore[union-attr]


def args(**kw) -> argparse.Namespace:
    d = {"requests": 150, "rate": 60.0, "clients": 12, "burst": 150, "fail_rate": 0.2,
         "soak_s": 4.0, "drain_timeout": 5.0, "churn_s": 1.0}
    d.update(kw)
    return argparse.Namespace(**d)


@pytest.mark.parametrize("name", ["open", "closed", "kill", "churn", "burst", "soak",
                                  "sigterm"])
def test_nothing_is_lost(name: str) -> None:
    row, tally = asyncio.run(asyncio.wait_for(reliability.scenario(name, args()), 240))
    print(row)
    assert tally.requests > 0
    assert tally.lost == 0, tally.notes[:5]
    assert tally.cut == 0, tally.notes[:5]
    assert tally.other == 0, tally.notes[:5]
    # a stream that breaks (an injected break, a killed instance) continues elsewhere
    assert tally.broken == 0, tally.notes[:5]
    assert tally.succeeded == tally.requests
    if name == "churn":  # (every change applied; none of the drained got a new request)
        assert tally.churn["changes"] == {"join": 4, "ready": 4, "drain": 4, "leave": 4}, \
            tally.notes[:1]
        assert tally.churn["served_after_drain"] == 0, tally.notes[:1]
        # every instance that became ready served before it was removed (each stays two
        # changes at least; an idle replica has the least forecast of its model's); how
        # soon is benchmarks/reliability.py's to report
        assert all(t < float("inf") for t in tally.churn["first_answer_s"]), tally.notes[:6]
    if name == "sigterm":
        assert row.rstrip(" |").endswith("| 0"), row  # drained in time: a clean exit
