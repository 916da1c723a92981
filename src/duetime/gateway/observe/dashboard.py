"""The dashboard's data: ``GET /duetime/dashboard`` (the state now, JSON) and
``GET /duetime/dashboard/events`` (the same as server-sent events, one a second by default,
the first at once), which the ``/dashboard`` page reads.

The state: per instance its model, health, running and waiting requests, KV use, in-flight
attempts, the TTFT forecast a reference probe (``PROBE_TOKENS`` prompt tokens) would get
(forecast again every ``PROBE_EVERY_S``: on a busy instance a forecast is the update's
largest cost),
and its last minute (first tokens, share on time, median forecast error); the last two minutes
as per-second series; the latest decisions, and the latest explained ones with their
explanations (:mod:`duetime.gateway.observe.observatory`; while a dashboard watches, one decision
each two seconds is explained). One state is built per tick however many dashboards
watch; the CPU time spent building them is ``duetime_dashboard_seconds_total{part="update"}``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from duetime.estimate import SfsEstimator
from duetime.gateway.observe.view import GatewayView
from duetime.web.errors import ApiError, number_in

PROBE_TOKENS = 512  # the reference probe's prompt
PROBE_EVERY_S = 2.0  # the probes are forecast again this often (a forecast each, per instance)
RECENT = 20  # decisions sent per update
SHARED_S = 0.25  # a state younger than this is sent again rather than built again


class DashboardFeed:
    """Builds the dashboard's state for a gateway, at most once per ``SHARED_S``."""

    def __init__(self, gw: GatewayView) -> None:
        self.gw = gw
        self.estimator = SfsEstimator()
        self._state: bytes = b""
        self._built = -math.inf
        self._probes: dict[str, float] = {}  # the last probe forecast per instance
        self._probed = -math.inf

    def state(self) -> dict[str, Any]:
        gw = self.gw
        obs = gw.observatory
        now = time.monotonic()
        wall = time.time()
        cards = []
        fresh = now - self._probed >= PROBE_EVERY_S
        if fresh:
            self._probed = now
        for s in gw.instances:
            if fresh or s.name not in self._probes:
                s.refresh(now)
                self._probes[s.name] = self.estimator.ttft(s, PROBE_TOKENS, now)
            probe = self._probes[s.name]
            cards.append({
                "name": s.name, "model": s.model, "healthy": s.healthy,
                "last_error": s.health.last_error or None,
                "running": s.num_running, "waiting": s.num_waiting,
                "kv_usage": round(s.kv_usage, 4), "in_flight": len(s.flights),
                "probe_ttft_ms": round(probe * 1e3, 3) if math.isfinite(probe) else None,
                **obs.minute(s.name, now)})
        latest = list(obs.recent)[-RECENT:][::-1]
        return {"t": round(wall, 3), "policy": gw.pool.policy, "probe_tokens": PROBE_TOKENS,
                "instances": cards, "series": obs.series(wall),
                "decisions": [d.as_dict(explanation=False) for d in latest],
                "explained": [d.as_dict() for d in reversed(obs.explained)]}

    def encoded(self) -> bytes:
        """The state as one server-sent event (shared by the watchers of one tick)."""
        t = time.monotonic()
        if t - self._built >= SHARED_S:
            cpu = time.thread_time()  # (the event loop's thread: CPU, not time waited)
            # (msgspec's encoder, already a dependency: several times json's speed here)
            self._state = b"data: " + msgspec.json.encode(self.state()) + b"\n\n"
            self._built = t
            self.gw.metrics.dashboard.labels("update").inc(time.thread_time() - cpu)
        return self._state


def _interval(request: Request) -> float:
    return number_in(request.query_params.get("interval", "1"), 0.2, 10.0, param="interval",
                     code="invalid_value", what="a number of seconds")


def dashboard_routes(gw: GatewayView) -> list[Route]:
    feed = DashboardFeed(gw)

    async def state(request: Request) -> Response:
        return JSONResponse(feed.state())

    async def events(request: Request) -> Response:
        try:
            interval = _interval(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)

        async def stream() -> AsyncIterator[bytes]:
            gw.observatory.watchers += 1
            try:
                while True:
                    yield feed.encoded()
                    try:  # (the gateway stopping ends the stream: it must not hold the drain)
                        await asyncio.wait_for(gw.draining.wait(), interval)
                        return
                    except TimeoutError:
                        pass
            finally:
                gw.observatory.watchers -= 1

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache",
                                          "x-accel-buffering": "no"})

    return [Route("/duetime/dashboard", state, methods=["GET"]),
            Route("/duetime/dashboard/events", events, methods=["GET"],
                  include_in_schema=False)]
