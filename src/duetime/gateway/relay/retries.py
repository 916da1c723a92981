"""A request's attempts: the first on the instance the router picked (admitted by priority), the
next ones — after an attempt failed before the client got anything — on the candidates in
rotation not tried yet, up to the pool's ``retries``."""

from __future__ import annotations

import json
import logging
import time

from duetime.gateway.config import Pool
from duetime.gateway.intake.request import RequestContext
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.relay.attempt import AttemptFailed, AttemptRunner, Passthrough
from duetime.gateway.routing.explain_header import explain_header
from duetime.gateway.routing.router import Choice, Router
from duetime.web.asgi import Send, send_json
from duetime.web.errors import relayed_error

log = logging.getLogger("duetime.gateway")


class Relay:
    """Runs a request's attempts until one answers (through ``attempts``)."""

    def __init__(self, pool: Pool, router: Router, attempts: AttemptRunner,
                 metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.router = router
        self.attempts = attempts
        self.metrics = metrics

    @staticmethod
    def upstream_body(ctx: RequestContext) -> dict:
        """The body sent upstream: always a stream, with its usage (the gateway counts tokens
        with it); the client's other stream options (vLLM's continuous_usage_stats) go
        along."""
        body = dict(ctx.req.body)
        body["stream"] = True
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                  "include_usage": True}
        return body

    def _next(self, ctx: RequestContext, made: int, tried: set[str],
              errors: list[str]) -> Choice:
        """The instance of the attempt after ``made`` attempts failed (raises the 502 when
        none is left)."""
        cands, failing_open = (self.router.rotation(ctx.candidates, tried)
                               if made <= self.pool.retries else ([], False))
        if not cands:
            raise self.router.exhausted(ctx, errors)
        choice = self.router.choose(ctx, cands, explain=ctx.controls.explain)
        choice.failing_open = failing_open
        return choice

    async def run(self, ctx: RequestContext, send: Send) -> int:
        """Choose, attempt, retry; returns the status answered (raises ApiError for
        502/503)."""
        body = self.upstream_body(ctx)
        path = "/v1/chat/completions" if ctx.chat else "/v1/completions"
        tried: set[str] = set()
        errors: list[str] = []
        number = 0
        while True:
            choice = (await self.router.pick(ctx) if number == 0
                      else self._next(ctx, number, tried, errors))
            inst = choice.inst
            tried.add(inst.name)
            number += 1
            body["model"] = inst.instance.served_model
            a = self.router.dispatch(ctx, choice, number)
            if number == 1:
                self.metrics.overhead.observe(time.monotonic() - ctx.arrival)
            extra = (explain_header(choice.explanation)
                     if ctx.controls.explain and choice.explanation is not None else ())
            try:
                return await self.attempts.run(a, ctx, path, json.dumps(body).encode(), send,
                                               extra)
            except AttemptFailed as e:
                errors.append(f"{inst.name}: {e}")
                log.warning("upstream attempt failed", extra={"fields": {
                    "event": "upstream_error", "id": ctx.rid, "instance": inst.name,
                    "kind": e.kind, "error": str(e), "attempt": number}})
            except Passthrough as e:
                await send_json(send, e.status, relayed_error(e.status, e.body),
                                [(b"x-duetime-instance", inst.name.encode())])
                return e.status
