"""The completion routes of ``duetime serve`` (``/v1/chat/completions``, ``/v1/completions``):
one request through the pipeline — the intake (:mod:`duetime.gateway.intake.request`), the
relay's attempts (:mod:`duetime.gateway.relay.retries`), which the router decides — and every
error as an OpenAI error body (or, once streaming, a final error event)."""

from __future__ import annotations

import asyncio
import logging
import time

from duetime.gateway.intake.admission import Shed, shed_error
from duetime.gateway.intake.request import Intake, KeyCheck
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.relay.retries import Relay
from duetime.gateway.state.pollers import Pollers
from duetime.web.asgi import Disconnect, Scope, send_error
from duetime.web.errors import ApiError

log = logging.getLogger("duetime.gateway")


class CompletionHandler:
    """Answers completion requests (``guard.send`` is the response channel)."""

    def __init__(self, intake: Intake, relay: Relay, pollers: Pollers,
                 metrics: GatewayMetrics) -> None:
        self.intake = intake
        self.relay = relay
        self.pollers = pollers
        self.metrics = metrics

    async def __call__(self, scope: Scope, raw: bytes, guard: Disconnect, t0: float, *,
                       chat: bool) -> None:
        send = guard.send
        route = "chat" if chat else "completions"
        status = 500
        self.pollers.request_arrived(t0)
        try:
            ctx = await self.intake.take(raw, scope, arrival=t0, chat=chat, keys=KeyCheck.ADMIT)
            send = ctx.grant.wrap(send)
            status = await self.relay.run(ctx, send)
        except Shed as e:
            status = 429
            await send_error(send, shed_error(e))
        except ApiError as e:
            status = e.status
            await send_error(send, e)
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
            self.metrics.requests.labels(route, str(status)).inc()
