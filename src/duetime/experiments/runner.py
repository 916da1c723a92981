"""Running simulation points: one (router, rate, arrival process) setting each, with the same
requests for every router at a given rate and seed, so routers are compared on equal terms.

Points are independent and deterministic (a point's requests come from generators seeded by
the runner's seed and the point), so :func:`run_points` fans them out (local processes or a Ray
cluster, :mod:`duetime.experiments.fanout`) and returns what a serial run returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from duetime.estimate import Estimator
from duetime.experiments.fanout import Fanout
from duetime.metrics import summarize
from duetime.policy import Policy, make_policy
from duetime.sim import ClusterSim, SimResult
from duetime.sim.admission import SimAdmission
from duetime.sim.cluster import LengthModel
from duetime.sim.fleet import FleetSpec, RouterFleet
from duetime.workload import RequestSet, WorkloadProfile, make_arrivals, sample_requests


@dataclass(frozen=True, slots=True)
class Point:
    """One simulation: a router on a request stream."""

    router: str
    rate: float
    requests: int
    arrivals: str = "poisson"
    arrival_kw: tuple[tuple[str, float], ...] = ()
    delta: float = 1e-6
    label: str = ""            # shown instead of the router name (e.g. "sfs-soft d=1e-6")
    extra: tuple[tuple[str, Any], ...] = ()
    params: tuple[tuple[str, Any], ...] = ()  # the policy's own parameters (registry names)
    fleet: FleetSpec | None = None  # several routers, each with its own view (sim.fleet)

    @property
    def name(self) -> str:
        return self.label or self.router


@dataclass(slots=True)
class Runner:
    """Runs points for one workload profile and seed; caches request streams."""

    profile: WorkloadProfile
    seed: int = 0
    noise: float = 0.0
    length_error: float = 0.3
    quality: str = "table"
    charge_overhead: bool = False
    prefix_caching: bool | None = None   # None: as the profile's configs say
    cache_view: str = "precise"
    step_scale: float = 1.0  # the instances' steps against their calibration (ClusterSim)
    fanout: Fanout = field(default_factory=Fanout)  # where run_all runs (default: here)
    # predicted output lengths, median and p90 (ClusterSim's length_model, length_p90_model;
    # picklable where the runs fan out); None: the truth x U(1 -+ length_error), no p90
    length_model: LengthModel | None = None
    length_p90_model: LengthModel | None = None
    # the gateway's admission queue in front of the pool, at most this many waiting
    # (ClusterSim(admission=SimAdmission(...))); None: none
    admission_queue: int | None = None
    _streams: dict[tuple, RequestSet] = field(default_factory=dict)

    @staticmethod
    def _key(p: Point) -> tuple:
        return (p.rate, p.requests, p.arrivals, p.arrival_kw)

    def set_stream(self, p: Point, requests: RequestSet) -> None:
        """Use these requests (e.g. a replayed trace) for the point's stream."""
        self._streams[self._key(p)] = requests

    def requests(self, p: Point) -> RequestSet:
        key = self._key(p)
        got = self._streams.get(key)
        if got is None:
            rng = np.random.default_rng([self.seed, int(p.rate * 1000), p.requests])
            times = make_arrivals(p.arrivals, p.rate, **dict(p.arrival_kw)).times(p.requests, rng)
            got = self._streams[key] = sample_requests(self.profile, times, rng)
        return got

    def run(self, p: Point, shadow: tuple[Estimator, ...] = (),
            closed_loop: int | None = None) -> tuple[dict[str, Any], SimResult]:
        def policy_for(k: int = 0) -> Policy:  # router k of a fleet: its own tie-breaks
            return make_policy(p.router, dict(p.params), defaults={
                "lambda": self.profile.lam, "seed": self.seed + k, "delta": p.delta})

        policy = policy_for() if p.fleet is None else p.fleet.fleet(policy_for, self.seed)
        sim = ClusterSim(self.profile, policy, noise=self.noise,
                         length_error=self.length_error, quality=self.quality, seed=self.seed,
                         charge_overhead=self.charge_overhead, shadow_estimators=shadow,
                         prefix_caching=self.prefix_caching, cache_view=self.cache_view,
                         step_scale=self.step_scale, length_model=self.length_model,
                         length_p90_model=self.length_p90_model,
                         admission=None if self.admission_queue is None
                         else SimAdmission(self.admission_queue))
        res = sim.run(self.requests(p), closed_loop=closed_loop)
        row: dict[str, Any] = {"router": p.name, "rate": p.rate, "arrivals": p.arrivals}
        if closed_loop is not None:
            row["clients"] = closed_loop
        row.update(dict(p.arrival_kw))
        if p.router == "sfs-soft":
            row["delta"] = p.delta
        row.update(dict(p.params))
        row.update(dict(p.extra))
        if isinstance(policy, RouterFleet):
            row.update(routers=policy.n, router_view=policy.sharing,
                       staleness_s=policy.staleness_s, view_share=policy.seen_share())
            if self.step_scale != 1.0 or policy.step_correction:
                factors = policy.step_factors()
                row.update(step_scale=self.step_scale, step_correction=policy.step_correction,
                           step_factor=float(np.mean(factors)) if factors else 1.0)
        row.update(summarize(res))
        row["wall_s"] = res.wall_s
        row["simulated_s"] = res.simulated_s
        return row, res

    def run_all(self, points: Iterable[Point], *, progress: Callable[[str], None] | None = None,
                keep: Callable[[Point], bool] | None = None,
                shadow: tuple[Estimator, ...] = ()) -> tuple[list[dict], dict[Point, SimResult]]:
        """Every point's row (in order) and the results ``keep`` asks for, the points run
        where this runner's ``fanout`` says."""
        points = list(points)
        got = run_points([(self, p) for p in points], self.fanout, progress=progress,
                         keep=keep, shadow=shadow)
        rows = [row for row, _ in got]
        return rows, {p: res for p, (_, res) in zip(points, got, strict=True) if res is not None}

    def portable(self, p: Point) -> Runner:
        """This runner as another process needs it for ``p``: its settings and, where the
        point's requests were given (:meth:`set_stream`) or drawn already, those requests."""
        got = self._streams.get(self._key(p))
        return replace(self, fanout=Fanout(), _streams={} if got is None else {self._key(p): got})


def _run_one(runner: Runner, p: Point, shadow: tuple[Estimator, ...], keep: bool
             ) -> tuple[dict[str, Any], SimResult | None]:
    row, res = runner.run(p, shadow)
    return row, res if keep else None


def run_points(jobs: list[tuple[Runner, Point]], fanout: Fanout, *,
               progress: Callable[[str], None] | None = None,
               keep: Callable[[Point], bool] | None = None, shadow: tuple[Estimator, ...] = ()
               ) -> list[tuple[dict[str, Any], SimResult | None]]:
    """Each (runner, point)'s row and, where ``keep(point)``, its result, in the order of
    ``jobs``; run serially here or fanned out (the same rows but for their ``wall_s``)."""
    def done(k: int, got: tuple[dict[str, Any], SimResult | None]) -> None:
        if progress is not None:
            row, p = got[0], jobs[k][1]
            finished.append(k)
            progress(f"[{len(finished)}/{len(jobs)}] {p.name} @ {p.rate:g} q/s: on time "
                     f"{row['on_time']:.3f}, OnTimeUtility {row['ontime_utility']:.3f} "
                     f"({row['wall_s']:.1f} s)")

    finished: list[int] = []
    serial = fanout.ray is None and fanout.workers == 1
    items = [(r if serial else r.portable(p), p, shadow, keep is not None and keep(p))
             for r, p in jobs]
    return fanout.map(_run_one, items, done)
