"""One upstream instance as the gateway sees it: the policies'
:class:`~duetime.estimate.base.InstanceView` over three state sources, with its health, its
in-flight ledger and the parts that learn from its attempts.

Sources (docs/gateway.md, "Live state"): the **shadow** replica (always kept,
:mod:`~duetime.gateway.state.shadow`), **published** snapshots (instances that serve
``/snapshot``, :mod:`~duetime.gateway.state.published`) and **scraped** load gauges
(``/metrics``, :mod:`~duetime.gateway.state.scraped`). A snapshot read uses the published one
while it is younger than ``state.max_age_s``, else the shadow; the load gauges come from the
scrape while fresh, else from the snapshot. ``state.source`` pins a source.

Reads change nothing. Time moves in :meth:`InstanceState.refresh` (the router calls it for the
candidates of a decision whose policy consumes snapshots) and with the attempts' events, which
the lifecycle (:mod:`~duetime.gateway.state.lifecycle`) hands to the instance's own
:attr:`~InstanceState.subscribers` — its ledger, KV-event cache view, shadow replica, TTFT
correction and health, in that order — and with the other gateway replicas' attempts
(:meth:`~InstanceState.on_peer_dispatch`, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence

from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import Forecaster
from duetime.engine.frontend import FrontendModel
from duetime.engine.snapshot import Snapshot
from duetime.estimate.base import GATEWAY_TIE, InstanceStats
from duetime.estimate.correction import StepCorrection, TtftCorrection
from duetime.estimate.prefix_index import EngineCacheIndex
from duetime.gateway.config import Instance, Pool, adapter_id
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.event_cache import EventCache
from duetime.gateway.state.flight import Flight, FlightStore
from duetime.gateway.state.frontend_queue import FrontendQueue
from duetime.gateway.state.health import EjectionBudget, HealthTracker
from duetime.gateway.state.ledger import Ledger
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.gateway.state.load import GatewayLoad
from duetime.gateway.state.membership import Phase
from duetime.gateway.state.peers import NO_PEERS, PeerFeed
from duetime.gateway.state.published import PublishedSnapshots
from duetime.gateway.state.scraped import ScrapedLoad
from duetime.gateway.state.shadow import ShadowReplica
from duetime.policy.base import Candidate

log = logging.getLogger("duetime.gateway")


class _Correction(Subscriber):
    """The instance's TTFT correction learns from each first token: what was observed from
    dispatch against what the model forecast before the correction."""

    def __init__(self, correction: TtftCorrection) -> None:
        self.correction = correction

    def on_first_token(self, a: Attempt) -> None:
        f = a.flight
        if f.raw_forecast is not None and f.first_token is not None:
            self.correction.observe(f.raw_forecast, f.first_token - f.dispatched)


class InstanceState:
    """One instance: identity, health, in-flight requests and the live views of it."""

    def __init__(self, instance: Instance, pool: Pool, metrics: GatewayMetrics,
                 flights: FlightStore, now: float | None = None, *,
                 budget: EjectionBudget | None = None, load: GatewayLoad | None = None,
                 peers: PeerFeed = NO_PEERS) -> None:
        """``flights``: where its in-flight attempts are kept. ``budget``: the pool's ejection
        budget, shared by its instances (alone: none may be ejected). ``load``: the gateway's
        own backlog, added to every forecast's overhead (:mod:`duetime.gateway.state.load`;
        none: nothing added). ``peers``: the other gateway replicas (their flights join the
        shadow replica: :meth:`on_peer_dispatch`; none: a gateway alone)."""
        self.load = load
        self.phase = Phase.SERVING  # (its membership sets it: duetime.gateway.state.membership)
        now = time.monotonic() if now is None else now
        self.instance = instance
        self.name = instance.name
        self.model = instance.model
        self.state_spec = pool.state
        # the LoRA adapters it serves as its /v1/models lists them (None: not read yet, or
        # LoRA off: its configured ones stand; see adapters)
        self.loaded_adapters: tuple[str, ...] | None = None
        self.candidate = Candidate(instance.name, instance.model, instance.price_prompt,
                                   instance.price_output, self)
        self.ledger = Ledger(instance.name, flights)
        # what the instance really did corrects what its model forecasts (SfsEstimator reads it)
        self.ttft_correction = TtftCorrection(enabled=pool.state.ttft_correction)
        # the replica's step time from the tokens the instance streams (state.step_correction)
        self.step_correction = StepCorrection() if pool.state.step_correction else None
        self._sync_interval_s = pool.state.sync_interval_s
        # vLLM's KV events, where the instance publishes them: the precise view of its cache
        self.events = (EventCache(instance.name, instance.kv_events)
                       if instance.kv_events is not None else None)
        self.published = PublishedSnapshots(None if instance.snapshot == "auto" else False)
        self.scraped = ScrapedLoad()
        h = pool.health
        self.health = HealthTracker(instance.name, metrics, budget or EjectionBudget(1, 0.0),
                                    eject_after=h.eject_after, window_s=h.window_s,
                                    failure_rate=h.failure_rate, min_requests=h.min_requests)
        self._correction = _Correction(self.ttft_correction)
        self._replica(now)
        self.peers = peers
        peers.listen(self.name, self)
        name = self.name
        self.health.on_change = lambda ejected: peers.eject(name, ejected)

    def _replica(self, now: float) -> None:
        """A new shadow replica of the instance as configured now."""
        self.shadow = ShadowReplica(self.name, self.instance.spec, now, self._sync_interval_s,
                                    self.step_correction)
        # what cache-aware policies read: the replica's cache, the gateway's estimate of the
        # instance's (see duetime.gateway.state.shadow)
        self.prefix_index = (EngineCacheIndex(self.shadow.engine)
                             if self.instance.config.enable_prefix_caching else None)
        fm = self.instance.frontend
        self.frontend_queue = None if fm is None else FrontendQueue(fm, now)
        # the instance's own lifecycle subscribers, in order (docs/architecture.md)
        self.subscribers: list[Subscriber] = [
            self.ledger, *([self.events] if self.events is not None else []), self.shadow,
            self._correction, self.health,
            *([self.frontend_queue] if self.frontend_queue is not None else [])]

    def adopt_cache_config(self, info: Mapping[str, int | bool]) -> bool:
        """The instance reported its KV cache (``vllm:cache_config_info``: block size, KV
        blocks, prefix caching on or off): where that differs from the pool config, the
        instance's word wins and the replica is rebuilt, with the requests in flight joining
        it again. Returns whether anything changed."""
        cfg = self.instance.config
        new = {k: v for k, v in info.items()
               if k in ("block_size", "num_gpu_blocks", "enable_prefix_caching")
               and getattr(cfg, k) != v}
        if not new:
            return False
        try:
            config = dataclasses.replace(cfg, **new)
        except ValueError as e:  # (a report the engine cannot run: keep the pool's)
            log.warning("instance cache config not adopted", extra={"fields": {
                "instance": self.name, "reported": dict(info), "error": str(e)}})
            return False
        log.info("instance cache config adopted", extra={"fields": {
            "instance": self.name, **new}})
        old = self.instance.config
        self.instance = dataclasses.replace(
            self.instance, spec=dataclasses.replace(self.instance.spec, config=config))
        self._rebuild(old)
        return True

    def _rebuild(self, old: SchedulerConfig) -> None:
        """A new shadow replica of the instance as configured now (it was configured
        ``old``), with the requests in flight joining it again."""
        config = self.instance.config
        rehash = old.block_size != config.block_size or not config.enable_prefix_caching
        now = time.monotonic()
        self._replica(now)
        for f in self.all_flights():  # (in dispatch order, this replica's first)
            f.shadowed = False
            if rehash:
                f.hashes = None  # (keyed at the old block size)
            self.shadow.add(f, now)
            if f.first_token is not None:
                self.shadow.observe_first(f, now)

    def reconfigure(self, instance: Instance) -> None:
        """The pool's config changed this instance (same name and model): its URL, timing,
        limits, prices, overhead or state sources now are ``instance``'s. The replica is
        rebuilt with the requests in flight (they finish where they were sent); its health,
        ledger and TTFT correction are kept. A new KV-event endpoint's subscription is made
        here and started by the caller (:attr:`events`)."""
        old = self.instance
        self.instance = instance
        self.candidate = Candidate(instance.name, instance.model, instance.price_prompt,
                                   instance.price_output, self)
        if instance.snapshot != old.snapshot or instance.url != old.url:
            self.published = PublishedSnapshots(None if instance.snapshot == "auto" else False)
        if instance.kv_events != old.kv_events:
            if self.events is not None:
                self.events.close()
            self.events = (EventCache(instance.name, instance.kv_events)
                           if instance.kv_events is not None else None)
        self._rebuild(old.config)

    @property
    def url(self) -> str:
        assert self.instance.url is not None
        return self.instance.url

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def serving(self) -> bool:
        """Whether it is a serving member (not joining, not draining): only those may get
        requests (:meth:`~duetime.gateway.routing.router.Router.rotation`)."""
        return self.phase is Phase.SERVING

    @property
    def flights(self) -> Mapping[str, Flight]:
        return self.ledger.flights

    @property
    def remote_flights(self) -> Mapping[str, Flight]:
        """The other gateway replicas' flights here, as last synced (none when alone)."""
        return self.peers.remote(self.name)

    def all_flights(self) -> Iterator[Flight]:
        """This replica's flights, then the others'."""
        return itertools.chain(self.ledger.flights.values(), self.remote_flights.values())

    # -- which source ---------------------------------------------------------------------------

    def _published_fresh(self, now: float) -> bool:
        # (with prefix caching, ``auto`` reads the replica: it estimates the instance's cache,
        # which a published snapshot of version 1 leaves out)
        source = self.state_spec.source
        if source == "auto" and self.instance.config.enable_prefix_caching:
            return False
        if self.instance.config.max_loras:
            # (LoRA: the merged published state does not carry adapters yet; the replica's
            # requests run on theirs)
            return False
        return source in ("auto", "published") and self.published.fresh(
            now, self.state_spec.max_age_s)

    def _scrape_fresh(self, now: float) -> bool:
        return (self.state_spec.source in ("auto", "metrics")
                and self.scraped.fresh(now, self.state_spec.max_age_s))

    def source(self, load: bool = False) -> str:
        """Where a read would come from now: ``published`` or ``shadow`` for a snapshot;
        with ``load``, ``metrics`` when the load gauges come from a fresh scrape."""
        now = time.monotonic()
        if load and self._scrape_fresh(now):
            return "metrics"
        return "published" if self._published_fresh(now) else "shadow"

    # -- InstanceView ---------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The freshest state: the published snapshot (merged) while fresh, else the shadow
        replica as of its last refresh."""
        now = time.monotonic()
        if self._published_fresh(now):
            return self.published.merged(now, self.ledger)
        return self.shadow.snapshot()

    def forecaster(self) -> Forecaster:
        """The forecaster of :meth:`snapshot`'s state: the published snapshot's while fresh,
        else the one the shadow replica's engine keeps across decisions."""
        now = time.monotonic()
        if self._published_fresh(now):
            return self.published.forecaster(now, self.ledger)
        return self.shadow.engine.forecaster()

    @property
    def num_running(self) -> int:
        if self._scrape_fresh(time.monotonic()):
            return int(self.scraped.running)
        return len(self.snapshot().running_table)

    @property
    def num_waiting(self) -> int:
        if self._scrape_fresh(time.monotonic()):
            return int(self.scraped.waiting)
        return len(self.snapshot().waiting_table)

    @property
    def kv_usage(self) -> float:
        if self._scrape_fresh(time.monotonic()):
            return float(self.scraped.kv_usage)
        return self.snapshot().kv_usage

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters it serves: as its ``/v1/models`` last listed them, else as its
        config lists them (:mod:`~duetime.gateway.state.pollers`)."""
        loaded = self.loaded_adapters
        return self.instance.adapters if loaded is None else loaded

    @property
    def lora_adapters(self) -> tuple[frozenset[int], int]:
        """The LoRA adapters of its requests scheduled and not finished (by the gateway's ids:
        :func:`~duetime.gateway.config.adapter_id`) and its ``max_loras``: from a fresh
        scrape of ``vllm:lora_requests_info`` where it exports one, else from the snapshot
        (the replica's requests, on their adapters)."""
        cfg = self.instance.config.max_loras
        scraped = self.scraped
        if scraped.lora_names is not None and self._scrape_fresh(time.monotonic()):
            return (frozenset(adapter_id(n) for n in scraped.lora_names),
                    scraped.max_lora or cfg)
        return self.snapshot().live_adapters(), cfg

    @property
    def stats(self) -> InstanceStats:
        return self.ledger.stats(time.monotonic())

    @property
    def request_overhead_s(self) -> float:
        """The instance's own (calibrated) overhead."""
        return self.instance.request_overhead_s

    @property
    def gateway_delay_s(self) -> float:
        """What the gateway's own loop needs for the work ahead of a request sent now (the
        forecasts take the later of it and the engine's: :func:`duetime.estimate.base.
        with_gateway`); 0 where the gateway's load is not counted."""
        return 0.0 if self.load is None else self.load.delay_s()

    @property
    def frontend(self) -> FrontendModel | None:
        """The instance's API-server costs (its forecasts add their queue), if calibrated."""
        return self.instance.frontend

    def frontend_wait_s(self, now: float) -> float:
        """The hand-offs queued at its API server ahead of a request sent ``now``."""
        q = self.frontend_queue
        return 0.0 if q is None else q.wait_s(now)

    # -- time -----------------------------------------------------------------------------------

    def refresh(self, now: float) -> None:
        """Bring the shadow replica to ``now`` before a decision that reads snapshots — unless
        a fresh published snapshot will be read instead (the replica catches up at the next
        refresh that needs it; it moves at every recorded event anyway). The KV events
        received so far correct its cache first."""
        self._apply_events(now)
        if not self._published_fresh(now):
            self.shadow.refresh(now, self.all_flights())

    def _apply_events(self, now: float) -> None:
        ev = self.events
        if ev is not None and self.shadow.engine.caching:
            ev.apply(self.shadow.engine, now)

    @property
    def cache_source(self) -> str | None:
        """Where the view of the instance's prefix cache comes from now: ``kv-events`` (its
        events are live), ``estimated`` (the gateway's own routing), None without caching."""
        if self.prefix_index is None:
            return None
        return "kv-events" if self.events is not None and self.events.live else "estimated"

    def cached_tokens(self, hashes: Sequence[int] | None, prompt_tokens: int) -> int:
        """Prompt tokens the instance would find cached now, as far as the gateway knows
        (whole blocks, and never the prompt's last token: vLLM computes that one again)."""
        if hashes is None or len(hashes) == 0 or self.prefix_index is None:
            return 0
        bs = self.instance.config.block_size
        return min(self.prefix_index.match(hashes), (prompt_tokens - 1) // bs) * bs

    # -- the attempts --------------------------------------------------------------------------

    def new_flight(self, fid: str, prompt_tokens: int, predicted: int, now: float,
                   forecast: float | None, hashes: Sequence[int] | None = None,
                   lora: int = 0) -> Flight:
        """The record of an attempt about to be sent here (``hashes``: its prompt's block keys,
        with prefix caching), its cached tokens read from the cache view brought up to the KV
        events received so far (the lifecycle then dispatches it)."""
        self._apply_events(now)
        f = Flight(fid, prompt_tokens, predicted, now, forecast, hashes, lora)
        # the instance's correction learns from forecasts its own part set, not the gateway's
        # delay (a floor under every instance's forecast alike: with_gateway)
        if forecast is not None and math.isfinite(forecast) and \
                forecast > self.gateway_delay_s * (1.0 + GATEWAY_TIE):
            f.raw_forecast = forecast / self.ttft_correction.factor
        f.cached_tokens = self.cached_tokens(hashes, prompt_tokens)
        return f

    # -- what the other gateway replicas did (PeerListener) -------------------------------------

    def on_peer_dispatch(self, f: Flight, now: float) -> None:
        """Another replica sent ``f`` here: it joins the shadow replica's queue (its block keys
        only if they fit this replica's block size)."""
        if f.hashes is not None and (not self.instance.config.enable_prefix_caching or len(
                f.hashes) > f.prompt_tokens // self.instance.config.block_size):
            f.hashes = None
        self._apply_events(now)
        self.shadow.add(f, now)

    def on_peer_first_token(self, f: Flight, now: float) -> None:
        self.shadow.observe_first(f, now)

    def on_peer_end(self, f: Flight, now: float) -> None:
        self.shadow.leave(f)

    def on_peer_eject(self, by: str) -> None:
        """Another replica ejected the instance: out of rotation here too (within this
        replica's ejection budget) until that replica readmits it."""
        self.health.eject(f"ejected by gateway replica {by}", peer=by)

    def on_peer_readmit(self) -> None:
        if self.health.peer_ejected is not None:
            self.health.readmit()

    def describe(self) -> dict[str, object]:
        """For ``GET /duetime/instances`` (refresh first for an up-to-date queue)."""
        snap = self.snapshot()
        h = self.health
        return {"name": self.name, "model": self.model, "url": self.instance.url,
                "phase": self.phase.value, "healthy": h.healthy,
                "last_error": h.last_error or None,
                "in_flight": len(self.ledger),
                "in_flight_all": len(self.ledger) + len(self.remote_flights),
                "state_source": self.source(),
                "publishes_snapshots": self.published.publishes,
                "running": len(snap.running_table), "waiting": len(snap.waiting_table),
                "kv_usage": round(self.kv_usage, 4),
                "ttft_correction": round(self.ttft_correction.factor, 4),
                "step_correction": None if self.step_correction is None else round(
                    self.step_correction.applied, 4),
                "prefix_cache": None if self.prefix_index is None else {
                    "source": self.cache_source,
                    "block_size": self.instance.config.block_size,
                    "cached_blocks": self.prefix_index.cached_blocks(),
                    "kv_events": None if self.events is None else self.events.describe()},
                "price_usd_per_mtok": {"prompt": self.instance.price_prompt,
                                       "output": self.instance.price_output}}
