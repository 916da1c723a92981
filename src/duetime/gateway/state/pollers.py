"""Background reads of the instances: ``/snapshot`` and ``/metrics`` polls, ``/health`` probes.

Snapshots are polled only for a policy that consumes them and metrics only for one that
consumes load gauges (or when ``state.source`` pins a source), every
``state.scrape_interval_s`` while requests come and every ``state.idle_scrape_interval_s``
after ``IDLE_AFTER_S`` without any (no decision needs fresh state then, and a quiet gateway
should stay quiet); a request ends an idle wait at once. An instance that answers 404 is not
polled again. Every ``health.interval_s`` each instance's ``/health`` is probed, and the
``/v1/models`` of one with LoRA on (``config.max_loras``): the adapters it lists (those with a
``parent``, as vLLM lists them: loaded at start or at run time) are what it serves from then
on. Once, at start, each instance's KV cache config is read from ``/metrics``
(``vllm:cache_config_info``).

The pollers follow the pool's membership (:mod:`~duetime.gateway.state.membership`): a
joining instance is probed every :data:`JOIN_PROBE_S` until its ``/health`` answers 200 (then
it is ready: in rotation), and polled from then on; a draining one is polled until its last
request in flight ends, when it leaves; an instance whose address changed is polled afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable

from duetime.engine.snapshot import Snapshot, SnapshotError
from duetime.gateway.config import Pool
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Change, Membership, Phase
from duetime.gateway.upstream import Upstream, UpstreamError
from duetime.web.cache_info import cache_config_info

log = logging.getLogger("duetime.gateway")

IDLE_AFTER_S = 2.0  # no request for this long: poll instances at the idle interval
JOIN_PROBE_S = 0.1  # a joining instance's /health is probed this often until it passes
DRAIN_CHECK_S = 0.05  # a draining instance leaves within this long of its last request's end


class Pollers:
    """The polling tasks of one gateway (``upstream()`` gives its started HTTP client)."""

    def __init__(self, pool: Pool, members: Membership,
                 upstream: Callable[[], Upstream], *, snapshots: bool, metrics: bool) -> None:
        self.pool = pool
        self.members = members
        self._upstream = upstream
        self.snapshots = snapshots
        self.metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []
        self._per: dict[str, list[asyncio.Task[None]]] = {}  # each member's own tasks
        self._started = False
        self._last_request = -math.inf
        self._active = asyncio.Event()  # set by the first request after an idle spell
        members.listeners.append(self._on_change)

    def start(self) -> None:
        self._started = True
        for s in self.members:
            self._add(s)
        self._tasks.append(asyncio.get_running_loop().create_task(self._health_loop()))

    def _add(self, s: InstanceState) -> None:
        """The member's tasks: its polls and cache config read (once serving), its join
        probes (while joining) or its drain watch (while draining)."""
        loop = asyncio.get_running_loop()
        tasks = self._per.setdefault(s.name, [])
        if s.phase is Phase.JOINING:
            tasks.append(loop.create_task(self._join(s)))
            return
        if self.snapshots and s.published.publishes is not False:
            tasks.append(loop.create_task(self._poll(s, "/snapshot")))
        if self.metrics:
            tasks.append(loop.create_task(self._poll(s, "/metrics")))
        tasks.append(loop.create_task(self._cache_config(s)))
        if s.instance.config.max_loras:
            tasks.append(loop.create_task(self._adapters(s)))
        if s.phase is Phase.DRAINING:
            tasks.append(loop.create_task(self._drain(s)))

    def _remove(self, s: InstanceState) -> None:
        for task in self._per.pop(s.name, []):
            if task is not asyncio.current_task():
                task.cancel()

    def _on_change(self, c: Change, s: InstanceState) -> None:
        if not self._started:
            return
        if c.change in ("join", "ready", "update"):
            # (its tasks for its phase now; an update may have moved it: its new address)
            self._remove(s)
            self._add(s)
        elif c.change == "drain":
            self._per.setdefault(s.name, []).append(
                asyncio.get_running_loop().create_task(self._drain(s)))
        elif c.change == "leave":
            self._remove(s)

    async def stop(self) -> None:
        self._started = False
        tasks = [*self._tasks, *(t for ts in self._per.values() for t in ts)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._per.clear()

    def request_arrived(self, t: float) -> None:
        """A request came at ``t``: the first one after an idle spell wakes the pollers."""
        if t - self._last_request >= IDLE_AFTER_S:
            self._active.set()
            self._active.clear()
        self._last_request = t

    def _interval(self) -> float:
        st = self.pool.state
        if time.monotonic() - self._last_request < IDLE_AFTER_S:
            return st.scrape_interval_s
        return max(st.scrape_interval_s, st.idle_scrape_interval_s)

    async def _poll(self, s: InstanceState, path: str) -> None:
        """Poll ``/snapshot`` or ``/metrics`` of one instance until it answers 404."""
        timeout = max(0.25, 4 * self.pool.state.scrape_interval_s)
        url = s.url + path
        reported = ""
        while True:
            sent = time.monotonic()
            if s.healthy:
                try:
                    r = await self._upstream().get(url, timeout)
                    received = time.monotonic()
                    if r.status == 404:
                        log.info(f"instance does not serve {path}", extra={"fields": {
                            "instance": s.name}})
                        if path == "/snapshot":
                            s.published.publishes = False
                        else:
                            s.scraped.serves = False
                        return
                    if r.status == 200:
                        if path == "/snapshot":
                            clock = r.headers.get("x-duetime-clock")
                            if clock is None:
                                raise ValueError("no x-duetime-clock header")
                            s.published.set(Snapshot.from_dict(json.loads(r.body)),
                                            float(clock), sent, received)
                        else:
                            s.scraped.set(r.body.decode(errors="replace"), received)
                        reported = ""
                except UpstreamError:
                    pass  # the health loop deals with unreachable instances
                except (ValueError, SnapshotError) as e:
                    if str(e) != reported:  # once per distinct problem, not every poll
                        reported = str(e)
                        log.warning(f"bad {path} answer", extra={"fields": {
                            "instance": s.name, "error": reported}})
            wait = self._interval() - (time.monotonic() - sent)
            if wait > self.pool.state.scrape_interval_s:  # idle: a request ends the wait
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._active.wait(), wait)
            else:
                await asyncio.sleep(max(0.0, wait))

    async def _cache_config(self, s: InstanceState) -> None:
        """Read the instance's KV cache config (``vllm:cache_config_info`` on ``/metrics``)
        once it answers, and have the instance adopt it (:meth:`InstanceState.
        adopt_cache_config`). A server without the metric keeps the pool config's numbers."""
        while True:
            try:
                r = await self._upstream().get(s.url + "/metrics", self.pool.health.timeout_s)
                if r.status == 200:
                    s.adopt_cache_config(cache_config_info(r.body.decode(errors="replace")))
                return
            except UpstreamError:
                pass  # not up yet: the health loop reports it
            await asyncio.sleep(self.pool.health.interval_s)

    async def _adapters(self, s: InstanceState) -> None:
        """Read the LoRA adapters an instance serves from its ``/v1/models`` every
        ``health.interval_s`` (until it answers 404: then its configured ones stand)."""
        reported = ""
        while True:
            try:
                r = await self._upstream().get(s.url + "/v1/models", self.pool.health.timeout_s)
                if r.status == 404:
                    return
                if r.status == 200:
                    self.members.adapters_listed(s, listed_adapters(r.body, self.pool))
                    reported = ""
            except UpstreamError:
                pass  # the health loop deals with unreachable instances
            except ValueError as e:
                if str(e) != reported:
                    reported = str(e)
                    log.warning("bad /v1/models answer", extra={"fields": {
                        "instance": s.name, "error": reported}})
            await asyncio.sleep(self.pool.health.interval_s)

    async def _check(self, s: InstanceState) -> tuple[bool, str]:
        """Whether the instance's ``/health`` answers 200 now, and why not."""
        try:
            r = await self._upstream().get(s.url + "/health", self.pool.health.timeout_s)
            return r.status == 200, f"/health answered {r.status}"
        except UpstreamError as e:
            return False, str(e)

    async def _probe(self, s: InstanceState) -> None:
        ok, why = await self._check(s)
        if s.phase is not Phase.JOINING:  # (a joining one has its own probes: _join)
            s.health.probe(ok, why)

    async def _join(self, s: InstanceState) -> None:
        """Probe a joining instance until it passes: then it is ready (in rotation)."""
        while s.phase is Phase.JOINING:
            ok, why = await self._check(s)
            if ok and s.phase is Phase.JOINING:
                s.health.probe(True, "")
                self.members.ready(s)  # (its listener starts the polls: this task ends)
                return
            s.health.last_error = why
            await asyncio.sleep(JOIN_PROBE_S)

    async def _drain(self, s: InstanceState) -> None:
        """Wait for a draining instance's requests in flight to end: then it leaves."""
        while s.phase is Phase.DRAINING and len(s.ledger):
            await asyncio.sleep(DRAIN_CHECK_S)
        if s.phase is Phase.DRAINING:
            self.members.leave(s)

    async def _health_loop(self) -> None:
        interval = self.pool.health.interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._probe(s) for s in self.members),
                                 return_exceptions=True)


def listed_adapters(body: bytes, pool: Pool) -> tuple[str, ...]:
    """The LoRA adapters of a ``/v1/models`` answer: its models with a ``parent`` (vLLM lists
    an adapter so, the base model without one), in its order, but for names the pool gives
    its models or aliases (a request for those means them). ValueError for another shape."""
    try:
        data = json.loads(body)["data"]
        cards = [(str(m["id"]), m.get("parent")) for m in data]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not an OpenAI model list ({type(e).__name__}: {e})") from None
    taken = {*pool.models, *pool.aliases}
    return tuple(dict.fromkeys(name for name, parent in cards if parent and name not in taken))
