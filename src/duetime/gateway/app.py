"""The gateway: an OpenAI-compatible endpoint in front of a pool of model instances.

Per request (:meth:`Gateway.serve`): parse and validate, count the prompt's tokens, read the
client's controls, find the candidates, and let the :class:`~duetime.gateway.routing.Router`
choose an instance with the configured policy over the candidates' live state
(:mod:`duetime.gateway.instance`) and run the attempts (:mod:`duetime.gateway.relay`), retrying
elsewhere on failure. The pollers (:mod:`duetime.gateway.pollers`) keep the live state fresh in
the background; the plain routes are :mod:`duetime.gateway.admin`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from duetime.engine.warmup import warm_up
from duetime.gateway.admin import admin_routes
from duetime.gateway.admission import AdmissionQueue, GatewayLoad, Shed
from duetime.gateway.auth import NO_GRANT, Auth
from duetime.gateway.config import Pool
from duetime.gateway.health import EjectionBudget
from duetime.gateway.inflight import FlightStore, MemoryStore
from duetime.gateway.instance import InstanceState
from duetime.gateway.metrics import GatewayMetrics
from duetime.gateway.observatory import Observatory
from duetime.gateway.openapi import openapi_document
from duetime.gateway.pages import page_routes
from duetime.gateway.pollers import Pollers
from duetime.gateway.ratelimit import Limiter
from duetime.gateway.ratelimit_redis import RedisLimitStore
from duetime.gateway.relay import Relay
from duetime.gateway.routing import Router
from duetime.gateway.store_redis import RedisConnection, RedisFlightStore
from duetime.gateway.upstream import Upstream
from duetime.policy import make_policy
from duetime.policy.registry import METRICS, SNAPSHOT
from duetime.web.asgi import CompletionEndpoint, Disconnect, FastRoutes, Scope, send_error
from duetime.web.errors import ApiError, exception_handlers
from duetime.web.requests import parse_completion

log = logging.getLogger("duetime.gateway")


class Gateway:
    """The gateway's state and behaviour; :meth:`app` is its ASGI app. ``store`` keeps the
    in-flight requests (by default: Redis when the pool's ``state.store`` names it, shared
    with the other gateway replicas, else this process's memory); ``host``: where it listens
    (None: loopback), which the API-key checks consider (:mod:`duetime.gateway.auth`)."""

    def __init__(self, pool: Pool, *, store: FlightStore | None = None,
                 host: str | None = None) -> None:
        missing = [i.name for i in pool.instances if i.url is None]
        if missing:
            raise ValueError(f"instances without a URL (start their emulators first): {missing}")
        self.pool = pool
        self.metrics = GatewayMetrics()
        self.policy = make_policy(pool.policy, pool.policy_params, defaults={
            "lambda": pool.lam, "seed": pool.seed, "delta": pool.delta, "alpha": pool.alpha})
        st = pool.state
        if store is None and st.store is not None:
            store = RedisFlightStore(RedisConnection(st.store, prefix=st.store_prefix),
                                     sync_s=st.store_sync_s, ttl_s=st.store_ttl_s)
        # (shared: other replicas' flights join the shadow replicas; rate limits hold for all)
        self.shared = store if isinstance(store, RedisFlightStore) else None
        limiter = None if self.shared is None else Limiter(RedisLimitStore(self.shared.conn))
        if self.shared is not None and hasattr(self.policy, "bindings"):  # (session-affinity)
            self.policy.bindings = self.shared.bindings
        self.auth = Auth(pool.auth, self.metrics.registry, host=host, limiter=limiter)
        self.store = self.auth.meter(store if store is not None else MemoryStore())
        now = time.monotonic()
        self.ejections = EjectionBudget(len(pool.instances), pool.health.max_ejected_fraction)
        self.queue = AdmissionQueue(pool.admission.max_queued, self.metrics)
        self.load = GatewayLoad(pool.admission.cpu_window_s)
        self.load.on_capacity = self.queue.poke
        self.instances = [InstanceState(i, pool, self.metrics, self.store, now, self.ejections,
                                        self.load if pool.admission.gateway_load else None,
                                        self.shared)
                          for i in pool.instances]
        self.upstream: Upstream | None = None
        self.observatory = Observatory([s.name for s in self.instances])
        self.relay = Relay(pool, self.metrics, self._http, self.observatory)
        self.router = Router(pool, self.policy, self.instances, self.metrics, self.relay,
                             self.queue, self.observatory)
        if self.shared is not None:
            self.router.bindings = self.shared.bindings
        self.draining = asyncio.Event()  # set when the server stops: event streams end
        needs = self.policy.consumes
        src = pool.state.source
        self.pollers = Pollers(
            pool, self.instances, self._http,
            snapshots=SNAPSHOT in needs and src in ("auto", "published"),
            metrics=METRICS in needs or src == "metrics")

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.upstream is not None:
            return
        warm_up()
        if (warning := self.auth.warning()) is not None:
            log.warning(warning, extra={"fields": {"event": "auth_warning"}})
        t = self.pool.timeouts
        self.upstream = Upstream(connect_s=t.connect_s, read_s=t.read_s)
        await self.upstream.start()
        self.pollers.start()
        if self.shared is not None:
            await self.shared.start(self.metrics)
        for s in self.instances:
            if s.events is not None:
                s.events.start()

    def drain(self) -> None:
        """The server is stopping: the dashboard's event streams end (an endless stream would
        hold the drain to its timeout)."""
        self.draining.set()

    async def close(self) -> None:
        self.drain()
        await self.pollers.stop()
        if self.shared is not None:
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

    # -- requests ---------------------------------------------------------------------------------

    async def serve(self, scope: Scope, raw: bytes, guard: Disconnect, t0: float, *,
                    chat: bool) -> None:
        """Answer one completion request (``guard.send`` is the response channel)."""
        send = guard.send
        route = "chat" if chat else "completions"
        status = 500
        self.pollers.request_arrived(t0)
        grant = NO_GRANT
        try:
            key = self.auth.identify(scope)  # (401 before the body is looked at)
            if key is not None:  # (whose turn it is among queued requests: per key)
                scope["duetime.client"] = f"key:{key.name}"
            req = parse_completion(raw, chat=chat)
            router = self.router
            req.prompt_tokens = router.count_tokens(req)
            grant = await self.auth.admit(key, req.model, req.prompt_tokens)
            send = grant.wrap(send)
            ctl = router.controls(scope, req.prompt_tokens)
            router = router.variant(ctl)
            insts = router.candidates(req.model, req.prompt_tokens, req.max_tokens,
                                      param="messages" if chat else "prompt")
            status = await router.route(req, ctl, insts, chat, send, t0)
        except Shed as e:
            status = 429
            await send_error(send, ApiError(
                429, f"no instance can meet this sheddable request's TTFT target now "
                f"(target {e.target_s * 1000:.1f} ms, best forecast "
                f"{e.forecast_s * 1000:.1f} ms); retry later", code="overloaded",
                type_="rate_limit_error"),
                [(b"retry-after", str(max(1, math.ceil(e.retry_after_s))).encode())])
        except ApiError as e:
            status = e.status
            await send_error(send, e, getattr(e, "headers", None))
            log.info("request", extra={"fields": {
                "event": "request", "status": status, "route": route, "error": e.message,
                "e2e_ms": round((time.monotonic() - t0) * 1000, 2)}})
        except asyncio.CancelledError:
            # the client went away (499), or the server cut the request at its drain timeout
            # (the client was told: 503 server_shutdown, as a final event on a stream)
            status = 499 if guard.gone else 503
            if guard.gone:
                self.metrics.cancelled.inc()
            raise
        except Exception:  # a bug: say so in the logs, answer 500 if still possible
            status = 500
            log.exception("internal error", extra={"fields": {"event": "internal_error",
                                                              "route": route}})
            if not guard.started:
                await send_error(send, ApiError(500, "internal error in the gateway (the "
                                                "log has it)", code="internal_error"))
        finally:
            grant.settle()
            self.metrics.requests.labels(route, str(status)).inc()

    async def dry_run(self, request: Request) -> Response:
        """``POST /duetime/route``: a chat or text completion's body and headers, routed
        without being sent (:meth:`Router.dry_run`); the answer explains the choice. Chat if
        the body has ``messages``."""
        t0 = time.monotonic()
        raw = await request.body()
        try:
            self.auth.identify(request.scope)
            try:
                chat = "messages" in json.loads(raw)
            except (ValueError, TypeError):
                chat = False  # (parse_completion says what is wrong)
            req = parse_completion(raw, chat=chat)
            router = self.router
            req.prompt_tokens = router.count_tokens(req)
            ctl = router.controls(request.scope, req.prompt_tokens)
            router = router.variant(ctl)
            insts = router.candidates(req.model, req.prompt_tokens, req.max_tokens,
                                      param="messages" if chat else "prompt")
            out = router.dry_run(router.plan(req, ctl), ctl, insts, t0)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(out)

    # -- the app ----------------------------------------------------------------------------------

    def app(self, routes: Sequence[BaseRoute] = ()) -> FastRoutes:
        """The ASGI app: the completion routes as raw ASGI endpoints (past Starlette's
        middleware), the admin routes, the pages (:mod:`duetime.gateway.pages`) and
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
        chat = CompletionEndpoint(functools.partial(self.serve, chat=True), limits)
        completions = CompletionEndpoint(functools.partial(self.serve, chat=False), limits)
        app = Starlette(routes=[*admin_routes(self), *page_routes(), *routes],
                        lifespan=lifespan,
                        exception_handlers=exception_handlers())
        app.state.gateway = self
        fast = {"/v1/chat/completions": chat, "/v1/completions": completions}
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
