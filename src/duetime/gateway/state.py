"""Live state of one upstream instance: the :class:`~duetime.estimate.base.InstanceView` the
policies read.

Three sources, as DESIGN.md's "Live state" describes:

* **shadow** (always kept): a compiled engine replica of the instance, advanced in real time
  and corrected by what the gateway sees. On dispatch the request joins the replica's waiting
  queue with its estimated prompt and its predicted output length (as the snapshot's
  ``predicted_output_tokens``; the replica never finishes a request by itself — past its
  prediction the forecaster's remaining-length estimate applies). On the first streamed chunk
  its prefill is marked done (``Engine.observe``); the streamed token counts correct the
  replica's outputs (at most every ``state.sync_interval_s``, vectorised); on completion,
  failure or cancellation it leaves the replica (``Engine.abort``).
* **published**: an instance that serves ``GET /snapshot`` (the emulator) is polled every
  ``state.scrape_interval_s``; the snapshot is moved onto the gateway's clock (the response's
  ``x-duetime-clock`` header gives the instance's clock; the offset is taken at the middle of
  the fetch) and, when read, merged with what the gateway did since: requests it completed are
  dropped, requests it dispatched that the snapshot does not hold yet are appended (waiting, or
  running if their first token came). Preferred while younger than ``state.max_age_s``.
* **metrics**: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` scraped from ``/metrics`` (as llm-d does), for the load
  balancers (``shortest-queue``, ``load-aware``); used as scraped while fresh.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque

import numpy as np

from duetime.engine.compiled import Engine
from duetime.engine.kv import held_blocks
from duetime.engine.scheduler import EngineStuck
from duetime.engine.snapshot import RequestTable, Snapshot
from duetime.estimate.base import InstanceStats
from duetime.gateway.config import Instance, Pool
from duetime.gateway.metrics import GatewayMetrics
from duetime.policy.base import Candidate

log = logging.getLogger("duetime.gateway")

STATS_WINDOW = 256
DONE_MEMORY_S = 5.0


class Flight:
    """One upstream attempt, as the gateway observes it."""

    __slots__ = ("dispatched", "first_token", "forecast", "id", "predicted", "prompt_tokens",
                 "shadowed", "tokens")

    def __init__(self, fid: str, prompt_tokens: int, predicted: int, dispatched: float,
                 forecast: float | None) -> None:
        self.id = fid
        self.prompt_tokens = prompt_tokens
        self.predicted = predicted
        self.dispatched = dispatched
        self.forecast = forecast
        self.first_token: float | None = None
        self.tokens = 0
        self.shadowed = False  # whether it joined the shadow replica


class InstanceState:
    """One instance: its identity, health, in-flight requests and live views."""

    def __init__(self, spec: Instance, pool: Pool, metrics: GatewayMetrics,
                 now: float | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.model = spec.model
        self.pool = pool
        self.metrics = metrics
        self.candidate = Candidate(spec.name, spec.model, spec.price_prompt, spec.price_output,
                                   self)
        now = time.monotonic() if now is None else now
        self.shadow = Engine(spec.config, spec.batch_time, time=now, retain_finished=False)
        self.flights: dict[str, Flight] = {}
        self._done: dict[str, float] = {}
        self._version = 0
        self._last_sync = -math.inf
        # published snapshots
        self.publishes: bool | None = None if spec.snapshot == "auto" else False
        self._published: Snapshot | None = None
        self._published_at = -math.inf
        self._published_version = 0
        self._merged: tuple[tuple[int, int], Snapshot] | None = None
        # scraped metrics
        self.serves_metrics: bool | None = None
        self._scraped: tuple[float, float, float] | None = None   # running, waiting, kv
        self._scraped_at = -math.inf
        # health
        self.healthy = True
        self.failures = 0
        self.last_error = ""
        metrics.healthy.labels(self.name).set(1)
        # time-averaged observations (for LPS): (dispatched, prompt) and finished records
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=STATS_WINDOW)
        self._finished: deque[tuple[float, float | None, float, int]] = deque(
            maxlen=STATS_WINDOW)
        self.last_source = "shadow"

    @property
    def url(self) -> str:
        assert self.spec.url is not None
        return self.spec.url

    # -- InstanceView -----------------------------------------------------------------------------

    def _metrics_fresh(self, now: float) -> bool:
        return (self._scraped is not None and self.pool.state.source in ("auto", "metrics")
                and now - self._scraped_at <= self.pool.state.max_age_s)

    @property
    def num_running(self) -> int:
        now = time.monotonic()
        if self._metrics_fresh(now):
            return int(self._scraped[0])  # type: ignore[index]
        return len(self.snapshot().running_table)

    @property
    def num_waiting(self) -> int:
        now = time.monotonic()
        if self._metrics_fresh(now):
            return int(self._scraped[1])  # type: ignore[index]
        return len(self.snapshot().waiting_table)

    @property
    def request_overhead_s(self) -> float:
        return self.spec.request_overhead_s

    @property
    def kv_usage(self) -> float:
        now = time.monotonic()
        if self._metrics_fresh(now):
            return float(self._scraped[2])  # type: ignore[index]
        snap = self.snapshot()
        return held_blocks(snap.running_table.computed, snap.config.block_size) / (
            snap.config.num_gpu_blocks)

    @property
    def stats(self) -> InstanceStats:
        now = time.monotonic()
        if not self._arrivals:
            return InstanceStats()
        s = InstanceStats(elapsed_s=max(now - self._arrivals[0][0], 1e-9),
                          arrivals=len(self._arrivals),
                          prompt_tokens_sum=sum(p for _, p in self._arrivals))
        for dispatched, first, finish, out in self._finished:
            if first is not None:
                s.ttft_s_sum += first - dispatched
                s.ttft_count += 1
            s.e2e_s_sum += finish - dispatched
            s.e2e_count += 1
            s.output_tokens_sum += out
        return s

    def snapshot(self) -> Snapshot:
        """The freshest state: the published snapshot (merged) while fresh, else the shadow."""
        now = time.monotonic()
        src = self.pool.state.source
        if (src in ("auto", "published") and self._published is not None
                and now - self._published_at <= self.pool.state.max_age_s):
            self.last_source = "published"
            return self._merged_snapshot(now)
        self.last_source = "shadow"
        return self.shadow_snapshot(now)

    # -- shadow replica ---------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        eng = self.shadow
        try:
            eng.run_until(now)
        except EngineStuck as e:  # a request the replica cannot hold: drop it from the replica
            log.warning("shadow replica stuck", extra={"fields": {
                "instance": self.name, "error": str(e)}})
            for rid in eng.waiting_ids()[:1]:
                eng.abort(rid)

    def _sync(self, now: float) -> None:
        if now - self._last_sync < self.pool.state.sync_interval_s:
            return
        self._last_sync = now
        fl = [f for f in self.flights.values() if f.tokens >= 1 and f.shadowed]
        if fl:
            outs = np.fromiter((f.tokens for f in fl), dtype=np.int64, count=len(fl))
            if self.shadow.observe_many([f.id for f in fl], outs):
                self._version += 1

    def shadow_snapshot(self, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        self._advance(now)
        self._sync(now)
        return self.shadow.snapshot()

    # -- published snapshots ----------------------------------------------------------------------

    def set_published(self, snap: Snapshot, instance_clock: float, sent: float,
                      received: float) -> None:
        """A snapshot fetched between ``sent`` and ``received`` (gateway clock) from an instance
        whose clock read ``instance_clock`` when it answered."""
        offset = (sent + received) / 2 - instance_clock
        self._published = snap.shifted(offset)
        self._published_at = received
        self._published_version += 1

    def _merged_snapshot(self, now: float) -> Snapshot:
        """The published snapshot with the gateway's changes since, dated no earlier than
        ``now``: a forecast then counts from now, as if nothing progressed since the snapshot
        (conservative by at most its age) — rather than as if the probe had arrived when the
        snapshot was taken (optimistic; an idle instance would forecast a negative TTFT)."""
        key = (self._published_version, self._version)
        if self._merged is not None and self._merged[0] == key:
            snap = self._merged[1]
            if snap.time >= now - 1e-3:
                return snap
            snap = snap.at(now)
            self._merged = (key, snap)
            return snap
        pub = self._published
        assert pub is not None
        done = self._done

        def keep(t: RequestTable) -> RequestTable:
            if not done or not any(i in done for i in t.ids):
                return t
            m = np.array([i not in done for i in t.ids], dtype=bool)
            return RequestTable([i for i, k in zip(t.ids, m.tolist(), strict=True) if k],
                                t.prompt[m], t.computed[m], t.output[m], t.predicted[m],
                                t.arrival[m])

        run, wait = keep(pub.running_table), keep(pub.waiting_table)
        held = set(run.ids) | set(wait.ids)
        extra_r = [f for f in self.flights.values() if f.id not in held and f.first_token]
        extra_w = [f for f in self.flights.values() if f.id not in held and not f.first_token]
        if extra_r:
            run = _append(run, extra_r, running=True)
        if extra_w:
            wait = _append(wait, extra_w, running=False)
        snap = Snapshot(pub.config, pub.model, time=max(pub.time, now), running=run,
                        waiting=wait)
        self._merged = (key, snap)
        return snap

    # -- scraped metrics --------------------------------------------------------------------------

    def set_metrics(self, text: str, received: float) -> None:
        running = waiting = kv = 0.0
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:num_requests_running":
                running += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:num_requests_waiting":
                waiting += float(line.rsplit(" ", 1)[1])
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv = max(kv, float(line.rsplit(" ", 1)[1]))
        self._scraped = (running, waiting, kv)
        self._scraped_at = received

    # -- what the gateway does and sees -----------------------------------------------------------

    def dispatch(self, fid: str, prompt_tokens: int, predicted: int, now: float,
                 forecast: float | None) -> Flight:
        f = Flight(fid, prompt_tokens, predicted, now, forecast)
        eng = self.shadow
        if prompt_tokens + 1 < eng.config.max_model_len:
            if eng.idle:
                eng.set_clock(now)
            else:
                self._advance(now)
            eng.add(fid, prompt_tokens, eng.config.max_model_len,
                    predicted_output_tokens=predicted, arrival=now)
            f.shadowed = True
        self.flights[fid] = f
        self._arrivals.append((now, prompt_tokens))
        self._version += 1
        self.metrics.in_flight.labels(self.name).inc()
        return f

    def first_token(self, f: Flight, now: float) -> None:
        f.first_token = now
        f.tokens = max(f.tokens, 1)
        if f.shadowed:
            self._advance(now)
            self.shadow.observe(f.id, f.tokens)
        self._version += 1

    def complete(self, f: Flight, now: float, *, output_tokens: int | None = None) -> None:
        """The attempt ended (finished, failed or cancelled): it leaves the replica."""
        if self.flights.pop(f.id, None) is None:
            return
        if f.shadowed:
            self.shadow.abort(f.id)
        done = self._done
        done[f.id] = now
        if len(done) > 64:  # insertion order is time order: forget from the oldest
            cutoff = now - DONE_MEMORY_S
            for k, t in list(itertools.islice(done.items(), 16)):
                if t >= cutoff:
                    break
                del done[k]
        if output_tokens is not None:
            self._finished.append((f.dispatched, f.first_token, now, output_tokens))
        self._version += 1
        self.metrics.in_flight.labels(self.name).dec()

    # -- health -----------------------------------------------------------------------------------

    def report_success(self) -> None:
        self.failures = 0

    def report_failure(self, kind: str, message: str) -> None:
        """An attempt or probe failed; a connect error ejects at once, others after
        ``health.eject_after`` in a row."""
        self.failures += 1
        self.last_error = message
        if self.healthy and (kind == "connect" or self.failures >= self.pool.health.eject_after):
            self.eject(message)

    def eject(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.metrics.healthy.labels(self.name).set(0)
        self.metrics.ejections.labels(self.name).inc()
        log.warning("instance ejected", extra={"fields": {
            "event": "eject", "instance": self.name, "reason": reason}})

    def readmit(self) -> None:
        if self.healthy:
            return
        self.healthy = True
        self.failures = 0
        self.metrics.healthy.labels(self.name).set(1)
        log.info("instance back in rotation", extra={"fields": {
            "event": "readmit", "instance": self.name}})

    def describe(self) -> dict[str, object]:
        """For ``GET /duetime/instances``."""
        snap = self.snapshot()
        return {"name": self.name, "model": self.model, "url": self.spec.url,
                "healthy": self.healthy, "last_error": self.last_error or None,
                "in_flight": len(self.flights), "state_source": self.last_source,
                "publishes_snapshots": self.publishes,
                "running": len(snap.running_table), "waiting": len(snap.waiting_table),
                "kv_usage": round(self.kv_usage, 4),
                "price_usd_per_mtok": {"prompt": self.spec.price_prompt,
                                       "output": self.spec.price_output}}


def _append(t: RequestTable, flights: list[Flight], *, running: bool) -> RequestTable:
    out = np.array([f.tokens if running else 0 for f in flights], dtype=np.int64)
    prompt = np.array([f.prompt_tokens for f in flights], dtype=np.int64)
    comp = prompt + out - 1 if running else np.zeros(len(flights), dtype=np.int64)
    return RequestTable(t.ids + [f.id for f in flights],
                        np.concatenate((t.prompt, prompt)), np.concatenate((t.computed, comp)),
                        np.concatenate((t.output, out)),
                        np.concatenate((t.predicted, [f.predicted for f in flights])),
                        np.concatenate((t.arrival, [f.dispatched for f in flights])))
