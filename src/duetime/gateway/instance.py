"""One upstream instance as the gateway sees it: the policies'
:class:`~duetime.estimate.base.InstanceView` over three state sources, with its health and its
in-flight ledger.

Sources (DESIGN.md, "Live state"): the **shadow** replica (always kept,
:mod:`~duetime.gateway.shadow`), **published** snapshots (instances that serve ``/snapshot``,
:mod:`~duetime.gateway.published`) and **scraped** load gauges (``/metrics``,
:mod:`~duetime.gateway.scraped`). A snapshot read uses the published one while it is younger
than ``state.max_age_s``, else the shadow; the load gauges come from the scrape while fresh,
else from the snapshot. ``state.source`` pins a source.

Reads change nothing. Time moves in :meth:`InstanceState.refresh` (the router calls it for the
candidates of a decision whose policy consumes snapshots) and with the events the gateway
records (:meth:`dispatch`, :meth:`first_token`, :meth:`progress`, :meth:`complete`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from duetime.engine.snapshot import Snapshot
from duetime.estimate.base import InstanceStats
from duetime.estimate.prefix_index import EngineCacheIndex
from duetime.gateway.config import Instance, Pool
from duetime.gateway.health import HealthTracker
from duetime.gateway.inflight import Flight, FlightStore, InFlight
from duetime.gateway.metrics import GatewayMetrics
from duetime.gateway.published import PublishedSnapshots
from duetime.gateway.scraped import ScrapedMetrics
from duetime.gateway.shadow import ShadowReplica
from duetime.policy.base import Candidate


class InstanceState:
    """One instance: identity, health, in-flight requests and the live views of it."""

    def __init__(self, instance: Instance, pool: Pool, metrics: GatewayMetrics,
                 store: FlightStore, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.instance = instance
        self.name = instance.name
        self.model = instance.model
        self.state = pool.state
        self.metrics = metrics
        self.candidate = Candidate(instance.name, instance.model, instance.price_prompt,
                                   instance.price_output, self)
        self.inflight = InFlight(instance.name, store)
        self.shadow = ShadowReplica(instance.name, instance.spec, now, pool.state.sync_interval_s)
        # what cache-aware policies read: the replica's cache, the gateway's estimate of the
        # instance's (see duetime.gateway.shadow)
        self.prefix_index = (EngineCacheIndex(self.shadow.engine)
                             if instance.config.enable_prefix_caching else None)
        self.published = PublishedSnapshots(None if instance.snapshot == "auto" else False)
        self.scraped = ScrapedMetrics()
        self.health = HealthTracker(instance.name, pool.health.eject_after, metrics)

    @property
    def url(self) -> str:
        assert self.instance.url is not None
        return self.instance.url

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def flights(self) -> Mapping[str, Flight]:
        return self.inflight.flights

    # -- which source ---------------------------------------------------------------------------

    def _published_fresh(self, now: float) -> bool:
        # (with prefix caching, ``auto`` reads the replica: it estimates the instance's cache,
        # which a published snapshot of version 1 leaves out)
        source = self.state.source
        if source == "auto" and self.instance.config.enable_prefix_caching:
            return False
        return source in ("auto", "published") and self.published.fresh(now, self.state.max_age_s)

    def _metrics_fresh(self, now: float) -> bool:
        return (self.state.source in ("auto", "metrics")
                and self.scraped.fresh(now, self.state.max_age_s))

    def source(self, load: bool = False) -> str:
        """Where a read would come from now: ``published`` or ``shadow`` for a snapshot;
        with ``load``, ``metrics`` when the load gauges come from a fresh scrape."""
        now = time.monotonic()
        if load and self._metrics_fresh(now):
            return "metrics"
        return "published" if self._published_fresh(now) else "shadow"

    # -- InstanceView ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The freshest state: the published snapshot (merged) while fresh, else the shadow
        replica as of its last refresh."""
        now = time.monotonic()
        if self._published_fresh(now):
            return self.published.merged(now, self.inflight)
        return self.shadow.snapshot()

    @property
    def num_running(self) -> int:
        if self._metrics_fresh(time.monotonic()):
            return int(self.scraped.running)
        return len(self.snapshot().running_table)

    @property
    def num_waiting(self) -> int:
        if self._metrics_fresh(time.monotonic()):
            return int(self.scraped.waiting)
        return len(self.snapshot().waiting_table)

    @property
    def kv_usage(self) -> float:
        if self._metrics_fresh(time.monotonic()):
            return float(self.scraped.kv_usage)
        return self.snapshot().kv_usage

    @property
    def stats(self) -> InstanceStats:
        return self.inflight.stats(time.monotonic())

    @property
    def request_overhead_s(self) -> float:
        return self.instance.request_overhead_s

    # -- time -----------------------------------------------------------------------------------

    def refresh(self, now: float) -> None:
        """Bring the shadow replica to ``now`` before a decision that reads snapshots — unless
        a fresh published snapshot will be read instead (the replica catches up at the next
        refresh that needs it; it moves at every recorded event anyway)."""
        if not self._published_fresh(now):
            self.shadow.refresh(now, self.inflight.flights)

    # -- what the gateway does and sees ---------------------------------------------------------

    def dispatch(self, fid: str, prompt_tokens: int, predicted: int, now: float,
                 forecast: float | None, hashes: Sequence[int] | None = None) -> Flight:
        """An attempt sent to this instance (``hashes``: its prompt's block keys, with prefix
        caching: its replica caches them)."""
        f = Flight(fid, prompt_tokens, predicted, now, forecast, hashes)
        self.shadow.add(f, now)
        self.inflight.dispatch(f)
        self.metrics.in_flight.labels(self.name).inc()
        return f

    def first_token(self, f: Flight, now: float) -> None:
        self.inflight.first_token(f, now)
        self.shadow.first_token(f, now)

    def progress(self, f: Flight, tokens: int) -> None:
        self.inflight.progress(f, tokens)

    def complete(self, f: Flight, now: float, *, output_tokens: int | None = None) -> None:
        """The attempt ended (finished, failed or cancelled): it leaves the replica."""
        if not self.inflight.complete(f, now, output_tokens):
            return
        self.shadow.remove(f)
        self.metrics.in_flight.labels(self.name).dec()

    def describe(self) -> dict[str, object]:
        """For ``GET /duetime/instances`` (refresh first for an up-to-date queue)."""
        snap = self.snapshot()
        h = self.health
        return {"name": self.name, "model": self.model, "url": self.instance.url,
                "healthy": h.healthy, "last_error": h.last_error or None,
                "in_flight": len(self.inflight), "state_source": self.source(),
                "publishes_snapshots": self.published.publishes,
                "running": len(snap.running_table), "waiting": len(snap.waiting_table),
                "kv_usage": round(self.kv_usage, 4),
                "price_usd_per_mtok": {"prompt": self.instance.price_prompt,
                                       "output": self.instance.price_output}}
