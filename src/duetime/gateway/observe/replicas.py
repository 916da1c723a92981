"""The live desired-replica signal: every ``autoscale.interval_s`` the gateway asks its
autoscaler (:mod:`duetime.autoscale`; duetime's own by default) how many replicas each model
should have, from what the gateway sees — the requests the router sent each model, their
first tokens and ends, its members by phase, and the engines' forecast of a typical request at
each model's best serving replica — and exports the answer: ``duetime_desired_replicas{model}``
on ``/metrics`` (what KEDA's Prometheus scaler reads) and ``GET /duetime/replicas``.

The gateway scales nothing: an actuator reads the signal. Members joining (probing before
they serve) count as starting, and so do replicas asked for and not yet seen, for a
scale-up delay after the ask: a replica asked for and coming is not asked for twice. The
same :class:`~duetime.autoscale.status.PoolStatus` as the simulator's scaling pool
(:mod:`duetime.sim.scaling`) feeds the autoscaler, so a policy behaves alike in both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.autoscale.status import PoolStatus, Recent
from duetime.estimate.sfs import SfsEstimator
from duetime.gateway.autoscaling import AutoscaleConfig
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.gateway.state.membership import Membership, Phase

log = logging.getLogger("duetime.gateway")

LOOKBACK_S = 120.0  # how far back the autoscaler sees requests (at least 4 intervals)


@dataclass(slots=True)
class _Seen:
    """One request as the autoscaler sees it (its first attempt's model and times)."""

    model: str
    arrival: float
    target: float
    prompt: int
    first_token: float = math.nan
    finish: float = math.nan
    output: int = 0


class DesiredReplicas(Subscriber):
    """The autoscaler over the gateway's live state; :meth:`tick` asks it (the gateway calls
    it every ``config.interval_s``)."""

    def __init__(self, config: AutoscaleConfig, membership: Membership,
                 metrics: GatewayMetrics, models: list[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.autoscaler = config.make()
        self.membership = membership
        self.metrics = metrics
        self.models = list(models)
        self.clock = clock
        self.lookback_s = max(LOOKBACK_S, 4 * config.interval_s)
        self._seen: deque[_Seen] = deque()
        self._by_flight: dict[str, _Seen] = {}
        self._routed: Counter[str] = Counter()
        # model -> (when, replicas) of the last ask above what was provisioned: counted as
        # starting until the members show them or a scale-up delay passed (an actuator whose
        # new replicas are invisible until ready — Kubernetes discovery lists ready pods
        # only — is not asked again for what it is bringing up)
        self._asked: dict[str, tuple[float, int]] = {}
        self._estimator = SfsEstimator()
        self.last: dict[str, Any] | None = None

    # -- what the router did ----------------------------------------------------------------------

    def on_dispatch(self, a: Attempt) -> None:
        if a.number != 1:  # (a request counts once, where the router first sent it)
            return
        seen = _Seen(a.inst.model, a.arrival, a.target_s, a.flight.prompt_tokens)
        self._seen.append(seen)
        self._by_flight[a.flight.id] = seen
        self._routed[seen.model] += 1

    def on_first_token(self, a: Attempt) -> None:
        seen = self._by_flight.get(a.flight.id)
        if seen is not None and a.flight.first_token is not None:
            seen.first_token = a.flight.first_token

    def on_end(self, a: Attempt) -> None:
        seen = self._by_flight.pop(a.flight.id, None)
        if seen is not None and a.ended is not None:
            seen.finish = a.ended
            seen.output = a.output_tokens or a.flight.tokens

    # -- the tick ---------------------------------------------------------------------------------

    def status(self, now: float) -> PoolStatus:
        """What the autoscaler sees at ``now`` (the routed counts since the last tick)."""
        while self._seen and self._seen[0].arrival < now - self.lookback_s:
            self._seen.popleft()
        phases: dict[Phase, Counter[str]] = {p: Counter() for p in Phase}
        waiting: Counter[str] = Counter()
        running: Counter[str] = Counter()
        for s in self.membership:
            if s.phase is Phase.SERVING and not s.healthy:
                continue  # (ejected: neither serving nor coming)
            phases[s.phase][s.model] += 1
            if s.phase is Phase.SERVING:
                waiting[s.model] += s.num_waiting
                running[s.model] += s.num_running
        recent = self._recent()
        models = tuple(dict.fromkeys([*self.models, *(s.model for s in self.membership)]))
        starting = phases[Phase.JOINING]
        for m, (t, asked) in list(self._asked.items()):
            if now - t >= self.config.scale_up_delay_s:
                del self._asked[m]  # (not come in the time a replica takes: ask again)
                continue
            starting[m] += max(0, asked - phases[Phase.SERVING][m] - starting[m])
        return PoolStatus(now, self.config.interval_s, dict(phases[Phase.SERVING]),
                          dict(starting), dict(phases[Phase.DRAINING]),
                          dict(self._routed), dict(waiting), dict(running), recent, models,
                          self.forecast_ratio(now, recent), self.config.scale_up_delay_s)

    def _recent(self) -> dict[str, Recent]:
        by: dict[str, list[_Seen]] = {}
        for seen in self._seen:
            by.setdefault(seen.model, []).append(seen)

        def col(rows: list[_Seen], f: str) -> np.ndarray:
            return np.array([getattr(r, f) for r in rows], dtype=float)

        return {m: Recent(*(col(rows, f) for f in ("arrival", "first_token", "finish",
                                                    "target", "output", "prompt")))
                for m, rows in by.items()}

    def forecast_ratio(self, now: float, recent: dict[str, Recent]) -> dict[str, float]:
        """Per model with recent requests: the least forecast TTFT of a typical one (the
        median prompt) over its serving replicas in rotation, over the median target."""
        now = min(now, self.clock())  # (a tick asked about a later time: the state is now's)
        out = {}
        for m, r in recent.items():
            serving = [s for s in self.membership
                       if s.model == m and s.phase is Phase.SERVING and s.healthy]
            if not serving:
                continue
            for s in serving:
                s.refresh(now)
            ratio = r.forecast_ratio(lambda p, ss=serving: min(
                self._estimator.ttft(s, p, now) for s in ss))
            if ratio is not None:
                out[m] = ratio
        return out

    def tick(self, now: float | None = None) -> dict[str, int]:
        """Ask the autoscaler; export and return the desired replicas per model (a model it
        leaves out keeps what it has provisioned)."""
        now = self.clock() if now is None else now
        st = self.status(now)
        asked = self.autoscaler.desired(st)
        self._routed.clear()
        desired = {m: self.config.clamp(asked.get(m, st.provisioned(m))) for m in st.models}
        for m, n in desired.items():
            if n > st.provisioned(m):
                self._asked[m] = (now, n)
            elif n < st.provisioned(m):
                self._asked.pop(m, None)
        for m, n in desired.items():
            self.metrics.desired_replicas.labels(m).set(n)
        self.last = {
            "t": time.time(), "autoscaler": self.config.autoscaler,
            "interval_s": self.config.interval_s, "desired": desired,
            "models": {m: {"ready": st.ready.get(m, 0), "starting": st.starting.get(m, 0),
                           "draining": st.draining.get(m, 0), "routed": st.routed.get(m, 0),
                           "rate_rps": st.routed.get(m, 0) / st.interval_s,
                           "forecast_ratio": _finite(st.forecast_ratio.get(m))}
                       for m in st.models}}
        return desired

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled (the gateway's task)."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick()
            except Exception:  # (a failed tick keeps the last answer; the next one retries)
                log.exception("desired replicas: the tick failed")

    def describe(self) -> dict[str, Any]:
        """For ``GET /duetime/replicas``: the last tick's answer and what it read."""
        c = self.config
        return {"autoscaler": c.autoscaler, "params": dict(c.params), "interval_s": c.interval_s,
                "scale_up_delay_s": c.scale_up_delay_s, "min_replicas": c.min_replicas,
                "max_replicas": c.max_replicas, "last": self.last}


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)
