"""The gateway's plain routes: ``/v1/models``, ``/health``, ``/metrics`` and
``/duetime/instances`` (the completion routes are raw ASGI, see :mod:`duetime.gateway.app`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from duetime.gateway.app import Gateway


def admin_routes(gw: Gateway) -> list[Route]:
    async def models(request: Request) -> Response:
        created = int(time.time())
        data = [{"id": a, "object": "model", "created": created, "owned_by": "duetime"}
                for a in gw.pool.aliases]
        data += [{"id": m, "object": "model", "created": created, "owned_by": "duetime",
                  "instances": [s.name for s in insts]}
                 for m, insts in gw.router.by_model.items()]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        # in rotation and answering its probes (the ejection budget keeps some instance in
        # rotation however it fails: a pool whose every instance fails its probe is down)
        n = sum(s.healthy and s.health.probe_ok for s in gw.instances)
        return JSONResponse({"status": "ok" if n else "unavailable",
                             "healthy_instances": n, "instances": len(gw.instances)},
                            status_code=200 if n else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def instances(request: Request) -> Response:
        now = time.monotonic()
        for s in gw.instances:
            s.refresh(now)
        described = [s.describe() for s in gw.instances]
        if not gw.auth.reveals_urls(request):  # names only (duetime.gateway.auth)
            described = [{**d, "url": None, "last_error": d["last_error"] and "(hidden)"}
                         for d in described]
        return JSONResponse({"policy": gw.pool.policy, "instances": described})

    return gw.auth.protect([
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/duetime/instances", instances, methods=["GET"]),
    ])
