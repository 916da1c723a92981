"""The gateway's plain routes: ``/v1/models`` and ``/v1/models/{id}``, ``/health``, ``/metrics``,
``/duetime/instances``, ``/duetime/route`` (a dry run), ``/duetime/policies``,
``/duetime/replicas`` (the desired replicas per model) and the
dashboard's ``/duetime/dashboard`` and ``/duetime/dashboard/events``
(:mod:`~duetime.gateway.observe.dashboard`). The completion routes are raw ASGI
(:mod:`duetime.gateway.relay.handler`)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duetime.gateway.intake.request import KeyCheck
from duetime.gateway.observe.dashboard import dashboard_routes
from duetime.gateway.observe.view import GatewayView
from duetime.policy import policy_class, policy_names
from duetime.web.errors import ApiError


def model_objects(gw: GatewayView) -> list[dict[str, Any]]:
    """The pool's models as OpenAI model objects: its aliases, each model it serves, then
    each LoRA adapter (``parent``: the models of the instances serving it, as vLLM names an
    adapter's base model)."""
    created = int(time.time())
    data: list[dict[str, Any]] = [
        {"id": a, "object": "model", "created": created, "owned_by": "duetime"}
        for a in gw.pool.aliases]
    data += [{"id": m, "object": "model", "created": created, "owned_by": "duetime",
              "instances": [s.name for s in insts]}
             for m, insts in gw.intake.by_model.items()]
    for name in gw.intake.adapter_ids:
        insts = [s for s in gw.intake.instances if name in s.adapters]
        parents = list(dict.fromkeys(s.model for s in insts))
        data.append({"id": name, "object": "model", "created": created, "owned_by": "duetime",
                     "parent": parents[0] if len(parents) == 1 else parents,
                     "instances": [s.name for s in insts]})
    return data


def admin_routes(gw: GatewayView) -> list[Route]:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": model_objects(gw)})

    async def model(request: Request) -> Response:
        """OpenAI's retrieve-model: the list's object for a known id (an alias included)."""
        wanted = request.path_params["model"]
        found = next((m for m in model_objects(gw) if m["id"] == wanted), None)
        if found is not None:
            return JSONResponse(found)
        err = ApiError(404, f"The model {wanted!r} does not exist", param="model",
                       code="model_not_found")
        return JSONResponse(err.body(), status_code=err.status)

    async def health(request: Request) -> Response:
        # in rotation and answering its probes (the ejection budget keeps some instance in
        # rotation however it fails: a pool whose every instance fails its probe is down)
        n = sum(s.serving and s.healthy and s.health.probe_ok for s in gw.instances)
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
        if not gw.auth.reveals_urls(request):  # names only (duetime.gateway.intake.auth)
            described = [{**d, "url": None, "last_error": d["last_error"] and "(hidden)"}
                         for d in described]
        return JSONResponse({"policy": gw.pool.policy, "store": gw.describe_store(),
                             "membership": gw.membership.describe(), "instances": described})

    async def dry_run(request: Request) -> Response:
        """``POST /duetime/route``: a chat or text completion's body and headers, routed
        without being sent (:meth:`Router.dry_run`); the answer explains the choice. Chat if
        the body has ``messages``; the key is identified (401) but nothing is spent."""
        t0 = time.monotonic()
        raw = await request.body()
        try:
            ctx = await gw.intake.take(raw, request.scope, arrival=t0, chat=None,
                                       keys=KeyCheck.IDENTIFY)
            out = gw.router.dry_run(ctx)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(out)

    async def policies(request: Request) -> Response:
        """What a request may ask for (the playground's choices): the policies
        (``x-duetime-policy``), the pool's default policy and lambda (``x-duetime-lambda``),
        its tasks (``x-duetime-task``) and the default TTFT target."""
        pool = gw.pool
        return JSONResponse({
            "default": pool.policy, "lambda": pool.lam, "tasks": list(pool.quality),
            "default_task": pool.default_task,
            "policies": [{"name": n, "summary": policy_class(n).summary,
                          "params": [p.name for p in policy_class(n).params]}
                         for n in policy_names()]})

    async def replicas(request: Request) -> Response:
        """The desired replicas per model (:mod:`duetime.gateway.observe.replicas`): the
        autoscaler, its settings and its last tick (null before the first)."""
        return JSONResponse(gw.replicas.describe())

    return gw.auth.protect([
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/duetime/instances", instances, methods=["GET"]),
        Route("/duetime/route", dry_run, methods=["POST"]),
        Route("/duetime/policies", policies, methods=["GET"]),
        Route("/duetime/replicas", replicas, methods=["GET"]),
        *dashboard_routes(gw),
    ])
