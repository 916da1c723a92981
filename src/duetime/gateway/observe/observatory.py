"""What the dashboard shows, kept as the gateway works: the latest routing decisions (with
their explanations, where made), per-second series of requests, TTFT observed and forecast,
and decisions per instance, and each instance's last minute of first tokens (on time or not,
forecast error).

The observatory learns from the attempt lifecycle (:mod:`duetime.gateway.state.lifecycle`):
each dispatch is a routed decision, each first token its outcome. Recording is a few appends
per request (the dashboard's cost is measured in ``benchmarks/dashboard_cost.py``);
explanations, which forecast every candidate, are made only while a dashboard watches, for at
most one decision each ``explain_every_s`` (the router asks :meth:`Observatory.
wants_explanation`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.gateway.state.membership import Change

MINUTE_S = 60.0


@dataclass(slots=True)
class DecisionRecord:
    """One routed attempt, as the dashboard lists it."""

    id: str
    t: float  # wall clock (s since the epoch)
    instance: str
    model: str
    policy: str
    forecast_ms: float | None
    target_ms: float
    attempt: int
    explanation: dict[str, Any] | None = None
    ttft_ms: float | None = None  # arrival to first token, once it came

    def as_dict(self, *, explanation: bool = True) -> dict[str, Any]:
        """As JSON data; ``explanation`` False: without its explanation (only whether it
        has one: the dashboard sends each explanation only while it is among the latest)."""
        return {"id": self.id, "t": round(self.t, 3), "instance": self.instance,
                "model": self.model, "policy": self.policy, "forecast_ms": self.forecast_ms,
                "target_ms": self.target_ms, "attempt": self.attempt, "ttft_ms": self.ttft_ms,
                "on_time": None if self.ttft_ms is None else self.ttft_ms <= self.target_ms,
                "explained": self.explanation is not None,
                **({"explanation": self.explanation} if explanation else {})}


@dataclass(slots=True)
class Second:
    """What happened in one wall-clock second."""

    t: int
    decisions: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    forecast_ms: list[float] = field(default_factory=list)
    # (requests, TTFT median, forecast median) once the second is over (not computed again)
    summary: tuple[int, float | None, float | None] | None = None

    def summarized(self, final: bool) -> tuple[int, float | None, float | None]:
        if self.summary is not None:
            return self.summary
        out = (sum(self.decisions.values()), _round(_median(self.ttft_ms)),
               _round(_median(self.forecast_ms)))
        if final:
            self.summary = out
        return out


class Minute:
    """One instance's first tokens of the last minute: how many, how many on time, and the
    relative forecast errors, kept so that reading them costs no pass in Python."""

    def __init__(self) -> None:
        self.firsts: deque[tuple[float, bool]] = deque()
        self.on_time = 0
        self.errors_t: deque[float] = deque()
        self.errors: deque[float] = deque()

    def add(self, now: float, on_time: bool, error: float | None) -> None:
        self.firsts.append((now, on_time))
        self.on_time += on_time
        if error is not None:
            self.errors_t.append(now)
            self.errors.append(error)
        self._forget(now)  # (kept to a minute whether or not a dashboard reads it)

    def _forget(self, now: float) -> None:
        start = now - MINUTE_S
        firsts = self.firsts
        while firsts and firsts[0][0] < start:
            self.on_time -= firsts.popleft()[1]
        while self.errors_t and self.errors_t[0] < start:
            self.errors_t.popleft()
            self.errors.popleft()

    def read(self, now: float) -> dict[str, Any]:
        self._forget(now)
        firsts = self.firsts
        n = len(firsts)
        return {"first_tokens_1m": n, "on_time_1m": None if n == 0 else self.on_time / n,
                "forecast_error_1m": (round(float(np.median(np.array(self.errors))), 4)
                                      if self.errors else None)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class Observatory(Subscriber):
    """The gateway's recent history for the dashboard (one per gateway)."""

    def __init__(self, instances: list[str], *, window_s: int = 120, recent: int = 50,
                 explain_every_s: float = 2.0) -> None:
        self.instances = list(instances)
        self.window_s = window_s
        self.explain_every_s = explain_every_s
        self.watchers = 0  # dashboards connected (explanations are made only for them)
        self.recent: deque[DecisionRecord] = deque(maxlen=recent)
        # the latest explained decisions (at a high rate they leave ``recent`` within a second)
        self.explained: deque[DecisionRecord] = deque(maxlen=3)
        self._by_id: dict[str, DecisionRecord] = {}
        self.seconds: deque[Second] = deque(maxlen=window_s)
        # per instance: its first tokens of the last minute
        self.minutes: dict[str, Minute] = {n: Minute() for n in instances}
        self._last_explained = -1e9

    def on_membership(self, c: Change, s: InstanceState) -> None:
        """A member joined (its series start) or left (its series end)."""
        if c.change == "join" and s.name not in self.minutes:
            self.instances.append(s.name)
            self.minutes[s.name] = Minute()
        elif c.change == "leave" and s.name in self.minutes:
            self.instances.remove(s.name)
            del self.minutes[s.name]

    def wants_explanation(self, now: float) -> bool:
        """Whether the decision made ``now`` should be explained for the dashboard."""
        return self.watchers > 0 and now - self._last_explained >= self.explain_every_s

    def _second(self, wall: float) -> Second:
        t = int(wall)
        if not self.seconds or self.seconds[-1].t != t:
            self.seconds.append(Second(t))
        return self.seconds[-1]

    def on_dispatch(self, a: Attempt) -> None:
        f = a.flight
        forecast = f.forecast
        self.record_decision(DecisionRecord(
            f.id, time.time(), a.inst.name, a.inst.model, a.policy,
            None if forecast is None or not math.isfinite(forecast) else round(forecast * 1e3, 3),
            round(a.target_s * 1e3, 3), a.number, a.explanation), f.dispatched)

    def on_first_token(self, a: Attempt) -> None:
        f = a.flight
        assert f.first_token is not None
        forecast = f.forecast if f.forecast is not None and math.isfinite(f.forecast) else None
        self.record_first_token(f.id, a.inst.name, f.first_token - a.arrival, a.target_s,
                                forecast, f.first_token - f.dispatched, f.first_token)

    def record_decision(self, d: DecisionRecord, now: float) -> None:
        """A routed attempt (``now``: monotonic, for the explanation's pacing)."""
        if d.explanation is not None:
            self._last_explained = now
            self.explained.append(d)
        if len(self.recent) == self.recent.maxlen:
            self._by_id.pop(self.recent[0].id, None)
        self.recent.append(d)
        self._by_id[d.id] = d
        counts = self._second(d.t).decisions
        counts[d.instance] = counts.get(d.instance, 0) + 1

    def record_first_token(self, fid: str, instance: str, ttft_s: float, target_s: float,
                           forecast_s: float | None, observed_s: float, now: float) -> None:
        """An attempt's first token: ``ttft_s`` from the request's arrival, ``observed_s``
        from its dispatch (what ``forecast_s`` forecast)."""
        sec = self._second(time.time())
        sec.ttft_ms.append(ttft_s * 1e3)
        err = None
        if forecast_s is not None:
            sec.forecast_ms.append(forecast_s * 1e3)
            if observed_s > 0:
                err = abs(forecast_s - observed_s) / observed_s
        minute = self.minutes.get(instance)
        if minute is not None:
            minute.add(now, ttft_s <= target_s, err)
        d = self._by_id.get(fid)
        if d is not None:
            d.ttft_ms = round(ttft_s * 1e3, 3)

    def minute(self, instance: str, now: float) -> dict[str, Any]:
        """The instance's last minute: first tokens, the share on time, the median relative
        forecast error."""
        minute = self.minutes.get(instance)
        return Minute().read(now) if minute is None else minute.read(now)

    def series(self, wall: float) -> dict[str, Any]:
        """The last ``window_s`` seconds, one point a second (gaps filled: 0 requests)."""
        end = int(wall)
        start = end - self.window_s + 1
        by_t = {s.t: s for s in self.seconds if s.t >= start}
        ts = list(range(start, end + 1))
        empty = Second(0)
        secs = [by_t.get(t, empty) for t in ts]
        # (a second's first token may come after it: a second is final 2 s after its end)
        sums = [s.summarized(s.t < end - 2) for s in secs]
        return {
            "t": ts,
            "requests": [x[0] for x in sums],
            "ttft_p50_ms": [x[1] for x in sums],
            "forecast_p50_ms": [x[2] for x in sums],
            "decisions": {n: [s.decisions.get(n, 0) for s in secs] for n in self.instances},
        }
