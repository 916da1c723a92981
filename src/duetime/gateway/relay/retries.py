"""A request's attempts: the first on the instance the router picked (admitted by priority), the
next ones — after an attempt failed before the client got anything — on the candidates in
rotation not tried yet, up to the pool's ``retries``; and, when a stream breaks after the
client got part of it, the attempts that continue it on the model's other instances
(:mod:`duetime.gateway.relay.resumption`), within the same ``retries``."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from duetime.gateway.config import Pool
from duetime.gateway.intake.request import RequestContext
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.relay.attempt import (
    AttemptFailed,
    AttemptRunner,
    Passthrough,
    StreamBroken,
)
from duetime.gateway.relay.resumption import Continuation, Sent, closing, not_resumable
from duetime.gateway.routing.explain_header import explain_header
from duetime.gateway.routing.router import Choice, Router
from duetime.gateway.state.instance import InstanceState
from duetime.web.asgi import Send, send_json
from duetime.web.errors import ApiError, relayed_error
from duetime.web.sse import error_event

log = logging.getLogger("duetime.gateway")


class Relay:
    """Runs a request's attempts until one answers (through ``attempts``)."""

    def __init__(self, pool: Pool, router: Router, attempts: AttemptRunner,
                 metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.router = router
        self.attempts = attempts
        self.metrics = metrics

    def upstream_body(self, ctx: RequestContext) -> dict:
        """The body sent upstream: always a stream, with its usage (the gateway counts tokens
        with it) -- in every chunk where ``state.continuous_usage`` says so (vLLM's
        ``continuous_usage_stats``: a lagging server merges tokens into fewer chunks); the
        client's other stream options go along."""
        body = dict(ctx.req.body)
        body["stream"] = True
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                  "include_usage": True}
        if self.pool.state.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
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
        """Choose, attempt, retry — and continue a stream that broke mid-way; returns the
        status answered (raises ApiError for 502/503 before the response started)."""
        r = _Request(ctx, self.upstream_body(ctx), sent=Sent() if not_resumable(ctx) is None
                     else None)
        while True:
            try:
                choice = (await self.router.pick(ctx) if r.number == 0
                          else self._next(r.ctx, r.number, r.tried, r.errors))
            except ApiError as e:
                if r.continuation is None:
                    raise
                self.metrics.stream_breaks.labels("exhausted").inc()
                return await self._end_broken(r, send, e.message)
            inst = choice.inst
            if r.unplaced:  # (a break's continuation has an instance: counted once)
                r.unplaced = False
                self.metrics.stream_breaks.labels("continued").inc()
            r.tried.add(inst.name)
            r.number += 1
            # (a LoRA adapter is asked for by its name: the instance serves it under it)
            r.body["model"] = r.ctx.adapter or inst.instance.served_model
            a = self.router.dispatch(r.ctx, choice, r.number)
            if r.number == 1:
                self.metrics.overhead.observe(time.monotonic() - ctx.arrival)
            extra = (explain_header(choice.explanation)
                     if ctx.controls.explain and choice.explanation is not None else ())
            try:
                return await self.attempts.run(
                    a, r.ctx, r.path, json.dumps(r.body).encode(), send, extra,
                    resumable=r.sent is not None, continuation=r.continuation)
            except AttemptFailed as e:
                r.errors.append(f"{inst.name}: {e}")
                log.warning("upstream attempt failed", extra={"fields": {
                    "event": "upstream_error", "id": ctx.rid, "instance": inst.name,
                    "kind": e.kind, "error": str(e), "attempt": r.number}})
            except Passthrough as e:
                if r.continuation is not None:  # (the client's answer has started)
                    self.metrics.stream_breaks.labels("exhausted").inc()
                    return await self._end_broken(r, send, relayed_error(e.status, e.body))
                await send_json(send, e.status, relayed_error(e.status, e.body),
                                [(b"x-duetime-instance", inst.name.encode())])
                return e.status
            except StreamBroken as e:
                if not self._continue(r, inst, e):
                    if r.sent is not None and r.sent.ended:  # (nothing left to continue)
                        await send({"type": "http.response.body",
                                    "body": closing(r.first, r.sent)})
                        return 200
                    return await self._end_broken(r, send, b"" if e.told else e.error)

    def _continue(self, r: _Request, inst: InstanceState, e: StreamBroken) -> bool:
        """After a stream broke on ``inst``: whether the answer can continue elsewhere (then
        ``r`` holds the continuation: its context, on the same model, and body)."""
        if r.sent is None or e.kept is None:
            why = not_resumable(r.first)
        else:
            r.sent.add(e.kept, chat=r.ctx.chat)
            why = ("the answer had ended" if r.sent.ended else r.sent.why_not or (
                None if Continuation(r.first, r.sent).room() else "the answer reached max_tokens"))
        r.errors.append(f"{inst.name}: stream broke")
        log.warning("upstream stream broke", extra={"fields": {
            "event": "stream_broken", "id": r.ctx.rid, "instance": inst.name,
            "tokens_sent": r.sent.tokens if r.sent else None, "attempt": r.number,
            "error": e.error.decode(errors="replace")[:300],
            **({"not_resumed": why} if why else {})}})
        if why is not None:
            ended = r.sent is not None and r.sent.ended
            self.metrics.stream_breaks.labels("ended" if ended else "not_resumable").inc()
            return False
        r.unplaced = True
        r.continuation = cont = Continuation(r.first, r.sent)
        ctx = cont.context()
        ctx.arrival = time.monotonic()  # (the continuation's first token counts from here)
        ctx.candidates = [s for s in ctx.candidates if s.model == inst.model]
        r.ctx, r.body = ctx, self.upstream_body(ctx)
        return True

    async def _end_broken(self, r: _Request, send: Send, error: bytes | str) -> int:
        """End a started stream that cannot continue with an error event (the client got
        part of the answer: its status stays 200)."""
        msg = error if isinstance(error, bytes) else error.encode()
        log.warning("stream not resumed", extra={"fields": {
            "event": "stream_ended_broken", "id": r.ctx.rid, "attempts": r.number,
            "errors": r.errors[-3:]}})
        await send({"type": "http.response.body", "body": error_event(msg) if msg else b""})
        return 200


@dataclass(slots=True)
class _Request:
    """One client request's way through its attempts."""

    first: RequestContext  # as it came in
    body: dict             # the next attempt's upstream body
    sent: Sent | None      # what the client got of a resumable stream (None: not resumable)
    ctx: RequestContext = field(init=False)  # the next attempt's (a continuation's, once broken)
    path: str = field(init=False)
    continuation: Continuation | None = None
    unplaced: bool = False  # a stream broke and its continuation has no instance yet
    number: int = 0
    tried: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ctx = self.first
        self.path = "/v1/chat/completions" if self.first.chat else "/v1/completions"
