"""``duetime epp``: the endpoint picker (:mod:`duetime.gateway.picker`) with the pool's embedded
instances, started and stopped in order, and its Prometheus / health routes over HTTP.

The picker keeps the same live state as ``duetime serve``: it builds a
:class:`~duetime.gateway.app.Gateway` from the same pool config (its intake, router, attempt
lifecycle, instances, pollers, KV-event subscriptions and shared-state backend) and starts it
without its HTTP app; Envoy does the relaying.
"""

from __future__ import annotations

import logging

from duetime.gateway.app import Gateway
from duetime.gateway.config import Pool
from duetime.service.runner import Service
from duetime.web.server import AppServer

log = logging.getLogger("duetime.gateway")


class PickerService:
    """``start``: the pool's emulated instances (if any), the gateway's live state, the
    picker's gRPC server on ``host:port`` and, unless ``metrics_port`` is None, ``/metrics``,
    ``/health`` and ``/duetime/instances`` over HTTP. ``stop``: the other way round."""

    def __init__(self, pool: Pool, *, host: str = "0.0.0.0", port: int = 9002,
                 metrics_port: int | None = None,
                 tls: tuple[bytes, bytes] | None = None, fallbacks: int = 0) -> None:
        """``tls``: a PEM key and certificate chain to serve gRPC over TLS (else plaintext);
        ``fallbacks``: endpoints returned after the chosen one (:class:`Picker`)."""
        self.instances = Service(pool)
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.tls = tls
        self.fallbacks = fallbacks
        self.gateway: Gateway | None = None
        self.picker = None  # the Picker, once started (grpc is imported on start)
        self.metrics_server: AppServer | None = None

    @property
    def pool(self) -> Pool:
        return self.instances.pool

    async def start(self) -> PickerService:
        import grpc

        from duetime.gateway.picker.service import Picker

        try:
            pool = await self.instances.start_instances()
            self.gateway = gw = Gateway(pool, host=self.host)
            await gw.start()
            self.picker = picker = Picker(gw, fallbacks=self.fallbacks)
            creds = None if self.tls is None else grpc.ssl_server_credentials([self.tls])
            self.port = await picker.start(self.host, self.port, credentials=creds)
            if self.metrics_port is not None:
                from starlette.applications import Starlette

                from duetime.gateway.observe.admin import admin_routes
                from duetime.web.errors import exception_handlers

                app = Starlette(routes=admin_routes(gw), exception_handlers=exception_handlers())
                app.state.gateway = gw
                self.metrics_server = await AppServer(app, host=self.host,
                                                      port=self.metrics_port).start()
        except BaseException:
            await self.stop(grace_s=0)
            raise
        return self

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Stop taking streams (those open get ``grace_s`` to finish), then the rest."""
        if self.picker is not None:
            await self.picker.stop(grace_s)
            self.picker = None
        if self.metrics_server is not None:
            await self.metrics_server.stop(force=True)
            self.metrics_server = None
        if self.gateway is not None:
            await self.gateway.close()
            self.gateway = None
        await self.instances.stop(force=True)
