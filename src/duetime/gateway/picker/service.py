"""``duetime epp``: the endpoint picker of the Gateway API Inference Extension, as a gRPC
``envoy.service.ext_proc.v3.ExternalProcessor`` service over the gateway's live state (one
:class:`~duetime.gateway.picker.exchange.Exchange` per Envoy stream), with gRPC health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from duetime.gateway.intake.request import Intake
from duetime.gateway.picker.endpoints import RESOLVE_INTERVAL_S, Endpoints
from duetime.gateway.picker.exchange import Exchange
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.routing.router import Router
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.lifecycle import Lifecycle
from duetime.gateway.state.membership import Membership
from duetime.gateway.state.pollers import Pollers

log = logging.getLogger("duetime.gateway")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class Host(Protocol):
    """What the picker uses of the gateway it runs in (the composition root, ``gateway/app.py``,
    provides it: the same live state, intake, router and lifecycle as ``duetime serve``)."""

    instances: list[InstanceState]
    membership: Membership
    intake: Intake
    router: Router
    lifecycle: Lifecycle
    metrics: GatewayMetrics
    pollers: Pollers

    def started(self) -> bool:
        """Whether its live state is kept (its HTTP client and pollers started)."""
        ...


class Picker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service over a started gateway's parts (:class:`Host`); :meth:`start`
    serves it, with gRPC health checks, on ``host:port``. ``fallbacks``: how many endpoints
    of the same model follow the chosen one in the destination (the protocol's list, tried
    in order by the data plane)."""

    def __init__(self, host: Host, *, fallbacks: int = 0) -> None:
        self.host = host
        self.fallbacks = fallbacks
        self.endpoints = Endpoints(host.membership)
        self._rr = itertools.count()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._resolver: asyncio.Task[None] | None = None

    def ready(self) -> bool:
        """Serving: the gateway is started and some instance is in rotation."""
        return self.host.started() and any(s.healthy for s in self.host.instances)

    def any_endpoint(self, subset: list[str] | None) -> str | None:
        """Round robin over the instances in rotation (within ``subset``, if given)."""
        insts, _ = self.host.router.rotation(self.host.instances, set())
        eps = [e for e in (self.endpoints.of(s) for s in insts) if e is not None
               and (subset is None or e in subset)]
        return eps[next(self._rr) % len(eps)] if eps else None

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self)
        cancelled = True
        try:
            async for msg in request_iterator:
                for resp in await ex.on(msg):
                    yield resp
                    if resp.HasField("immediate_response"):
                        cancelled = False
                        return
            cancelled = False
        except Exception:
            log.exception("endpoint picker error", extra={"fields": {"event": "internal_error",
                                                                     "route": ex.route}})
            raise
        finally:
            ex.close(cancelled=cancelled)

    # -- serving ----------------------------------------------------------------------------------

    async def start(self, host: str = "0.0.0.0", port: int = 9002, *,
                    credentials: grpc.ServerCredentials | None = None) -> int:
        """Serve on ``host:port`` (0: an ephemeral port); returns the port."""
        await self.endpoints.resolve()
        self._resolver = asyncio.get_running_loop().create_task(self._resolve_loop())
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self, server)
        server.add_generic_rpc_handlers((health_handler(self),))
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = (server.add_secure_port(addr, credentials) if credentials is not None
                     else server.add_insecure_port(addr))
        await server.start()
        self.server = server
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resolver
            self._resolver = None
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(RESOLVE_INTERVAL_S)
            await self.endpoints.resolve()


# -- gRPC health checks (grpc.health.v1, the picker protocol's liveness / readiness) -----------

HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE)
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"  # HealthCheckResponse{status}, encoded


def _health_service(raw: bytes) -> str:
    """``HealthCheckRequest.service`` (field 1, a string) of an encoded request."""
    i = 0
    while i < len(raw):
        tag = raw[i]
        i += 1
        if tag & 7 != 2:  # (no other wire type in this message)
            return "?"
        n = shift = 0
        while True:
            byte = raw[i]
            i += 1
            n |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if tag >> 3 == 1:
            return raw[i:i + n].decode(errors="replace")
        i += n
    return ""


def health_handler(picker: Picker) -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health/Check``: ``liveness`` is SERVING while the process answers;
    ``readiness``, the ext_proc service and "" while :meth:`Picker.ready`; any other name
    NOT_FOUND (the health-checking protocol's rule)."""

    async def check(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        service = _health_service(raw)
        if service not in HEALTH_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return SERVING if service == "liveness" or picker.ready() else NOT_SERVING

    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(check)})
