"""Pools that change while a simulation runs: replicas added after a scale-up delay (model
load and warm-up) and removed by draining (no new requests; those in flight finish), as an
autoscaler decides at every interval.

An :class:`Autoscaler` reads a :class:`PoolStatus` at each tick (every ``interval_s`` of
simulated time; the instances stepped to the tick first) and says how many replicas of each
model it wants. :class:`ScalingPool` carries it out: a replica asked for is created at once
(its GPUs paid from then) and serves from ``scale_up_delay_s`` later; a replica no longer
wanted is, if still starting, cancelled (paid until then), else drained (the one with the
fewest requests, the newest among equals), paid until its last request finishes. Replicas
are never reused: each scale-up is a new instance (a fresh engine: an empty prefix cache).

With an autoscaler that never changes the pool (``static``) a run is the run without
scaling, request for request (tested).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from duetime.autoscale.status import Autoscaler, PoolStatus, Recent
from duetime.estimate.sfs import SfsEstimator
from duetime.sim.instance import SimInstance

LOOKBACK_S = 120.0  # how far back an autoscaler sees requests (at least 4 intervals)


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a simulated pool changes: the ``autoscaler``, asked every ``interval_s``; a new
    replica serves ``scale_up_delay_s`` after it is asked for; each model keeps between
    ``min_replicas`` and ``max_replicas`` provisioned; ``gpus``: GPUs a replica of a model
    holds (default 1), for GPU-hours."""

    autoscaler: Autoscaler
    interval_s: float = 30.0
    scale_up_delay_s: float = 60.0
    min_replicas: int = 1
    max_replicas: int = 8
    gpus: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or not math.isfinite(self.interval_s):
            raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")
        if not self.scale_up_delay_s >= 0:
            raise ValueError(f"scale_up_delay_s must be >= 0, got {self.scale_up_delay_s!r}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"want 1 <= min_replicas <= max_replicas (no scale to zero: a "
                             f"model keeps a replica), got {self.min_replicas}, "
                             f"{self.max_replicas}")


@dataclass(slots=True)
class Replica:
    """One instance's life in a scaling pool (times in simulated seconds)."""

    name: str
    model: str
    asked: float                 # when it was asked for (paid from here)
    ready: float                 # when it serves
    drained: float = math.inf    # when it stopped taking requests (cancelled, if not ready)
    released: float = math.inf   # when it was let go (its last request done); set at the end
    serving: bool = False        # takes requests now (the pool's clock)

    def state(self, t: float) -> str:
        if t >= self.drained:
            return "draining" if self.drained >= self.ready else "cancelled"
        return "ready" if t >= self.ready else "starting"


@dataclass(slots=True)
class ScalingRecord:
    """What a run's scaling did: every replica's life and every change asked for."""

    replicas: list[Replica]
    events: list[tuple[float, str, int]]  # (time, model, +1 asked / -1 drained or cancelled)
    timeline: list[tuple[float, dict[str, int]]]  # (tick, serving replicas per model)
    gpus: dict[str, int]

    def gpu_hours(self) -> float:
        return sum(self.gpus.get(r.model, 1) * (r.released - r.asked)
                   for r in self.replicas) / 3600.0

    def instance_hours(self) -> float:
        return sum(r.released - r.asked for r in self.replicas) / 3600.0


class ScalingPool:
    """The simulator's side of a scaling pool: which instances take requests (:meth:`serving`)
    and, up to each arrival (:meth:`until`), the replicas that become ready and the ticks at
    which the autoscaler is asked."""

    def __init__(self, scaling: Scaling, insts: list[SimInstance], models: list[str],
                 make: Callable[[str, str], SimInstance], start: float) -> None:
        """``insts`` / ``models``: the pool at ``start`` (serving; both lists grow as replicas
        are added); ``make(name, model)``: a new instance of a model."""
        self.scaling = scaling
        self.insts = insts
        self.models = models
        self.make = make
        self.replicas = [Replica(i.name, m, start, start, serving=True)
                         for i, m in zip(insts, models, strict=True)]
        self.events: list[tuple[float, str, int]] = []
        self.timeline: list[tuple[float, dict[str, int]]] = []
        self.next_tick = start + scaling.interval_s
        self.routed: dict[str, int] = {}
        self.lookback_s = max(LOOKBACK_S, 4 * scaling.interval_s)
        # requests routed within the lookback: (request id, instance, arrival, target, output)
        self._log: deque[tuple[int, int, float, float, int, int]] = deque()
        self._estimator = SfsEstimator()
        self._counter: dict[str, int] = {}
        for m in models:
            self._counter[m] = self._counter.get(m, 0) + 1
        self._starting: list[int] = []  # replicas asked for and not serving yet

    @property
    def next_event(self) -> float:
        """When the pool next changes or is looked at: a tick, or a replica becoming ready."""
        ready = min((self.replicas[k].ready for k in self._starting), default=math.inf)
        return min(self.next_tick, ready)

    def serving(self) -> list[int]:
        """Indices (into the instances) of those that take requests now."""
        return [k for k, r in enumerate(self.replicas) if r.serving]

    def routed_to(self, model: str, request: int, instance: int, arrival: float,
                  target: float, output: int, prompt: int) -> None:
        self.routed[model] = self.routed.get(model, 0) + 1
        self._log.append((request, instance, arrival, target, output, prompt))

    def recent(self, t: float) -> dict[str, Recent]:
        """Per model, its requests routed within the lookback as known at ``t``."""
        log = self._log
        while log and log[0][2] < t - self.lookback_s:
            log.popleft()
        if not log:
            return {}
        rid, inst, arrival, target, output, prompt = (np.array(c) for c in zip(*log,
                                                                                strict=True))
        first = np.full(len(rid), np.nan)
        fin = np.full(len(rid), np.nan)
        for k in np.unique(inst).tolist():
            sel = np.flatnonzero(inst == k)
            f, e = self.insts[k].delivered([str(i) for i in rid[sel].tolist()])
            first[sel], fin[sel] = f, e
        first[first > t] = np.nan  # (a step that ends after the tick)
        fin[fin > t] = np.nan
        model = np.array([self.models[k] for k in inst.tolist()])
        out = {}
        for m in np.unique(model).tolist():
            sel = model == m
            out[m] = Recent(arrival[sel], first[sel], fin[sel], target[sel],
                            output[sel].astype(float), prompt[sel].astype(float))
        return out

    def until(self, t: float, step_to: Callable[[float], None]) -> bool:
        """Everything due up to ``t``, in time order (``step_to(tick)`` brings the instances
        to a tick before the autoscaler reads them); whether the serving set changed."""
        changed = False
        while self.next_event <= t:
            ready = min((self.replicas[k].ready for k in self._starting), default=math.inf)
            if ready <= self.next_tick:
                for k in [k for k in self._starting if self.replicas[k].ready <= ready]:
                    self._starting.remove(k)
                    self.replicas[k].serving = True
                    changed = True
            else:
                tick = self.next_tick
                step_to(tick)
                changed |= self.tick(tick)
        return changed

    def status(self, t: float) -> PoolStatus:
        ready: dict[str, int] = {}
        starting: dict[str, int] = {}
        draining: dict[str, int] = {}
        waiting: dict[str, int] = {}
        running: dict[str, int] = {}
        for r, inst in zip(self.replicas, self.insts, strict=True):
            state = r.state(t)
            if state == "draining":
                if inst.busy_until() < math.inf:
                    draining[r.model] = draining.get(r.model, 0) + 1
            elif state == "starting":
                starting[r.model] = starting.get(r.model, 0) + 1
            elif state == "ready":
                ready[r.model] = ready.get(r.model, 0) + 1
                waiting[r.model] = waiting.get(r.model, 0) + inst.num_waiting
                running[r.model] = running.get(r.model, 0) + inst.num_running
        recent = self.recent(t)
        return PoolStatus(t, self.scaling.interval_s, ready, starting, draining,
                          dict(self.routed), waiting, running, recent,
                          tuple(dict.fromkeys(self.models)), self.forecast_ratio(t, recent),
                          self.scaling.scale_up_delay_s)

    def forecast_ratio(self, t: float, recent: dict[str, Recent]) -> dict[str, float]:
        """Per model with recent requests: the least forecast TTFT of a typical one (the
        median prompt) over its serving replicas, over the median target."""
        out = {}
        for m, r in recent.items():
            serving = [k for k, rep in enumerate(self.replicas) if rep.serving and rep.model == m]
            if not serving:
                continue
            for k in serving:
                self.insts[k].now = t
            ratio = r.forecast_ratio(lambda p, ks=serving: min(
                self._estimator.ttft(self.insts[k], p, t) for k in ks))
            if ratio is not None:
                out[m] = ratio
        return out

    def tick(self, t: float) -> bool:
        """Ask the autoscaler at ``t`` (the instances stepped to it) and carry out what it
        wants; whether the serving set changed now (new replicas serve later)."""
        s = self.scaling
        status = self.status(t)
        self.timeline.append((t, dict(status.ready)))
        self.routed = {}
        self.next_tick = t + s.interval_s
        changed = False
        for model, want in s.autoscaler.desired(status).items():
            want = min(max(int(want), s.min_replicas), s.max_replicas)
            have = status.provisioned(model)
            for _ in range(want - have):
                self._add(model, t)
            if want < have:
                changed |= self._remove(model, have - want, t)
        return changed

    def _add(self, model: str, t: float) -> None:
        k = self._counter.get(model, 0)
        self._counter[model] = k + 1
        name = f"{model}.{k}"
        self.insts.append(self.make(name, model))
        self.models.append(model)
        self.replicas.append(Replica(name, model, t, t + self.scaling.scale_up_delay_s))
        self._starting.append(len(self.replicas) - 1)
        self.events.append((t, model, +1))

    def _remove(self, model: str, n: int, t: float) -> bool:
        """Cancel starting replicas (newest first), then drain serving ones (fewest requests,
        newest among equals); whether a serving one stopped."""
        starting = [k for k in self._starting if self.replicas[k].model == model][::-1]
        serving = sorted((k for k, r in enumerate(self.replicas)
                          if r.model == model and r.serving),
                         key=lambda k: (self.insts[k].num_running + self.insts[k].num_waiting,
                                        -k))
        changed = False
        for k in (starting + serving)[:n]:
            r = self.replicas[k]
            r.drained = t
            self.events.append((t, model, -1))
            if k in self._starting:
                self._starting.remove(k)
            else:
                r.serving = False
                changed = True
        return changed

    def record(self, finish: np.ndarray, chosen: np.ndarray, end: float) -> ScalingRecord:
        """Every replica released when its last request finished (or when it was cancelled
        or drained idle, or at the run's ``end`` if still serving)."""
        for k, r in enumerate(self.replicas):
            mine = finish[chosen == k]
            last = float(np.nanmax(mine)) if mine.size else -math.inf
            if r.drained == math.inf:
                r.released = max(end, last, r.asked)
            elif r.drained < r.ready:  # cancelled while starting
                r.released = r.drained
            else:
                r.released = max(r.drained, last)
        return ScalingRecord(self.replicas, self.events, self.timeline,
                             {m: self.scaling.gpus.get(m, 1) for m in set(self.models)})
