"""The gateway's composition root: it builds the pipeline's parts from a pool config, wires them
and serves them as one ASGI app. Nothing in the gateway imports this module; the services above
it (:mod:`duetime.service`: ``duetime serve``, ``duetime epp``) do.

A request's walk (docs/architecture.md has it step by step): the completion route
(:mod:`.relay.handler`) → the intake (:mod:`.intake.request`: keys, body, prompt tokens,
controls, policy, candidates, predictions) → the router (:mod:`.routing.router`: the decision,
admitted by priority) → the relay (:mod:`.relay.retries`, :mod:`.relay.attempt`: attempts and
retries), whose attempts' events the lifecycle (:mod:`.state.lifecycle`) hands to every
subscriber. The live state (:mod:`.state`) is kept fresh by the pollers; a shared-state backend
(:mod:`.backends`) keeps what the gateway's replicas share; the observation routes
(:mod:`.observe`) read it all. The endpoint picker (:mod:`.picker`) runs over the same parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from duetime.engine.warmup import warm_up
from duetime.gateway.backends import SharedState, open_shared_state
from duetime.gateway.changes import InstanceChanges, check_live, members_of
from duetime.gateway.config import ConfigError, Instance, Pool
from duetime.gateway.intake.admission import Admission, AdmissionQueue
from duetime.gateway.intake.auth import Auth, KeyMetering
from duetime.gateway.intake.policies import PolicyBook
from duetime.gateway.intake.ratelimit import Limiter
from duetime.gateway.intake.request import Intake
from duetime.gateway.observe.admin import admin_routes
from duetime.gateway.observe.attempt_metrics import AttemptMetrics
from duetime.gateway.observe.observatory import Observatory
from duetime.gateway.observe.openapi import openapi_document
from duetime.gateway.observe.pages import page_routes
from duetime.gateway.observe.replicas import DesiredReplicas
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.relay.attempt import AttemptRunner
from duetime.gateway.relay.handler import CompletionHandler
from duetime.gateway.relay.retries import Relay
from duetime.gateway.routing.router import Router
from duetime.gateway.state.discovery import Discovery
from duetime.gateway.state.health import EjectionBudget
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.lifecycle import Lifecycle, Subscriber
from duetime.gateway.state.load import GatewayLoad
from duetime.gateway.state.membership import Change, Membership, Phase
from duetime.gateway.state.pollers import Pollers
from duetime.gateway.upstream import Upstream
from duetime.policy.registry import LOAD, SNAPSHOT
from duetime.policy.tiers import warm_up_tiers
from duetime.web.asgi import CompletionEndpoint, FastRoutes
from duetime.web.errors import exception_handlers

log = logging.getLogger("duetime.gateway")


class Gateway:
    """The gateway's parts, wired; :meth:`app` is its ASGI app. The pool's ``state.store``
    picks the shared-state backend (Redis shared with the other gateway replicas, else this
    process's memory); ``host``: where it listens (None: loopback), which the API-key checks
    consider (:mod:`duetime.gateway.intake.auth`)."""

    def __init__(self, pool: Pool, *, host: str | None = None) -> None:
        missing = [i.name for i in pool.instances if i.url is None and i.discover == "none"]
        if missing:
            raise ValueError(f"instances without a URL (start their emulators first): {missing}")
        self.pool = pool
        self.metrics = GatewayMetrics()
        self.shared: SharedState = open_shared_state(pool.state)
        self.auth = Auth(pool.auth, self.metrics.registry, host=host,
                         limiter=Limiter(self.shared.limits))
        self.policies = PolicyBook(pool, bindings=self.shared.bindings)
        self.load = GatewayLoad(pool.admission.cpu_window_s)
        self.queue = AdmissionQueue(pool.admission.max_queued, self.metrics,
                                    pool.admission.fairness_half_life_s)
        self.budget = EjectionBudget(0, pool.health.max_ejected_fraction)
        first = members_of(pool, {})  # (groups join once discovered: at start)
        self.membership = Membership([self._instance(i) for i in first], self.metrics)
        self.budget.size = len(self.membership)
        self.discovery = Discovery(pool, self.membership, first, self._instance, self.started)
        self.observatory = Observatory([s.name for s in self.membership])
        self.replicas = DesiredReplicas(pool.autoscale, self.membership, self.metrics,
                                        pool.models)
        self._ticking: asyncio.Task[None] | None = None
        self.lifecycle = Lifecycle(self._subscribers())
        self.membership.listeners += [self._on_change, self.observatory.on_membership]
        self.intake = Intake(pool, self.membership, self.auth, self.policies)
        admission = Admission(self.queue, self.metrics, pool.admission.expired)
        self.router = Router(pool, self.lifecycle, admission, self.metrics,
                             self.observatory.wants_explanation)
        self.upstream: Upstream | None = None
        self.relay = Relay(pool, self.router, AttemptRunner(pool, self._http, self.lifecycle),
                           self.metrics)
        needs, src = self.policies.default.consumes, pool.state.source
        self.pollers = Pollers(pool, self.membership, self._http,
                               snapshots=SNAPSHOT in needs and src in ("auto", "published"),
                               metrics=LOAD in needs or src == "metrics")
        self.handler = CompletionHandler(self.intake, self.relay, self.pollers, self.metrics)
        self.draining = asyncio.Event()  # set when the server stops: event streams end

    @property
    def instances(self) -> list[InstanceState]:
        """The pool's members now (joining, serving and draining: :attr:`membership`)."""
        return list(self.membership)

    def _instance(self, i: Instance) -> InstanceState:
        """The live state of a new member ``i``."""
        load = self.load if self.pool.admission.gateway_load else None
        return InstanceState(i, self.pool, self.metrics, self.shared.flights, time.monotonic(),
                             budget=self.budget, load=load, peers=self.shared.peers)

    # -- membership -------------------------------------------------------------------------------

    def apply(self, pool: Pool, why: str = "config") -> InstanceChanges:
        """A new config of the pool, applied while serving (:mod:`duetime.gateway.changes`):
        its instances join, drain or change; raises ConfigError (changing nothing) if it
        changes what needs a restart."""
        check_live(self.pool, pool)
        if missing := [i.name for i in pool.instances
                       if i.url is None and i.discover == "none"]:
            raise ConfigError(f"{pool.source}: instances without a URL: {missing}")
        self.pool = pool
        self.intake.reconfigure(pool)
        return self.discovery.apply(pool, why)

    def _on_change(self, c: Change, s: InstanceState) -> None:
        """The ejection budget counts the members not draining; one that left is dropped."""
        self.budget.size = sum(m.phase is not Phase.DRAINING for m in self.membership)
        if c.change == "leave":
            self.budget.ejected.discard(s.name)
            self.lifecycle.forget(s)
            with contextlib.suppress(KeyError):  # (its series end with it)
                self.metrics.healthy.remove(s.name)
            if s.events is not None:
                s.events.close()

    def _subscribers(self) -> list[Subscriber]:
        """The pool-wide lifecycle subscribers, in order (after each instance's own: its
        ledger, KV-event cache view, shadow replica, TTFT correction, health)."""
        gateway_load = [self.load] if self.pool.admission.gateway_load else []
        return [*gateway_load, self.queue, KeyMetering(self.auth.limiter), self.observatory,
                self.replicas, AttemptMetrics(self.metrics)]

    # -- lifecycle --------------------------------------------------------------------------------

    def started(self) -> bool:
        return self.upstream is not None

    async def start(self) -> None:
        if self.upstream is not None:
            return
        warm_up()
        warm_up_tiers()
        if (warning := self.auth.warning()) is not None:
            log.warning(warning, extra={"fields": {"event": "auth_warning"}})
        t = self.pool.timeouts
        self.upstream = Upstream(connect_s=t.connect_s, read_s=t.read_s)
        await self.upstream.start()
        self.pollers.start()
        await self.shared.start(self.metrics)
        for s in self.instances:
            if s.events is not None:
                s.events.start()
        await self.discovery.start()  # (groups' members join: probed before they serve)
        self._ticking = asyncio.create_task(self.replicas.run())

    def drain(self) -> None:
        """The server is stopping: the dashboard's event streams end (an endless stream would
        hold the drain to its timeout)."""
        self.draining.set()

    async def close(self) -> None:
        self.drain()
        if self._ticking is not None:
            self._ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticking
            self._ticking = None
        await self.discovery.close()
        await self.pollers.stop()
        await self.shared.close()
        for s in self.instances:
            if s.events is not None:
                s.events.close()
        if self.upstream is not None:
            await self.upstream.close()
            self.upstream = None

    def _http(self) -> Upstream:
        if self.upstream is None:
            raise RuntimeError("the gateway is not started")
        return self.upstream

    def describe_store(self) -> dict[str, Any]:
        return self.shared.describe()

    # -- the app ----------------------------------------------------------------------------------

    def app(self, routes: Sequence[BaseRoute] = ()) -> FastRoutes:
        """The ASGI app: the completion routes as raw ASGI endpoints (past Starlette's
        middleware), the admin routes, the pages (:mod:`duetime.gateway.observe.pages`) and
        ``/openapi.json`` through Starlette, whose errors (404, 405, 500) are OpenAI JSON too;
        its lifespan starts and closes the gateway. ``routes``: more routes from a higher layer
        (``duetime serve`` adds the simulator's demo: :mod:`duetime.service.demo`)."""
        gw = self

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await gw.start()
            try:
                yield
            finally:
                await gw.close()

        limits = self.pool.limits
        fast = {"/v1/chat/completions": CompletionEndpoint(
                    functools.partial(self.handler, chat=True), limits),
                "/v1/completions": CompletionEndpoint(
                    functools.partial(self.handler, chat=False), limits)}
        app = Starlette(routes=[*admin_routes(self), *page_routes(), *routes],
                        lifespan=lifespan, exception_handlers=exception_handlers())
        app.state.gateway = self
        for path, endpoint in fast.items():  # (so that a GET there is a 405, not a 404)
            app.router.routes.append(Route(path, endpoint, methods=["POST"]))
        document: dict | None = None

        async def openapi(request: Request) -> JSONResponse:
            nonlocal document  # (built once, from the routes the app has)
            if document is None:
                document = openapi_document(app.router.routes, list(gw.pool.quality))
            return JSONResponse(document)

        app.router.routes.append(Route("/openapi.json", openapi, methods=["GET"]))
        return FastRoutes(app, fast)
