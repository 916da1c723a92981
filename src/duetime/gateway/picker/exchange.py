"""One Envoy ``ext_proc`` stream (one HTTP request and its response), phase by phase.

Envoy sends the request's headers, body (chunks) and trailers, then the response's headers,
body chunks and trailers. The picker answers as the inference extension's protocol says
(docs/kubernetes.md cites it):

- a completion request (``/v1/chat/completions``, ``/v1/completions``) is routed once its body
  is complete — through the gateway's one intake path (:mod:`duetime.gateway.intake.request`,
  with no key checks: Envoy's side authenticates; within the data plane's subset hint) and its
  router (``pick``, ``dispatch``: the same decision and bookkeeping as ``duetime serve``) — and
  the chosen instance's ``ip:port`` goes back as the ``x-gateway-destination-endpoint`` header
  and ``envoy.lb`` dynamic metadata; ``model: "auto"`` (an alias) is rewritten to the model
  the instance serves. Any other request (no body, another path) goes round-robin to an
  instance in rotation;
- the response phases publish the attempt's lifecycle as the relay does
  (:mod:`duetime.gateway.state.lifecycle`): dispatch at the decision, first token at the first
  response body byte, token progress by counting SSE events, and the end at the end of the
  body, at the trailers, or when the stream closes or is cancelled (the request then leaves
  the replica: forecasts stay live);
- bad input is an ``ImmediateResponse`` with the gateway's OpenAI error body (400, 404), no
  instance in rotation a 503, a shed request a 429.

Body modes (the filter's ``processing_mode``, told in each request's ``protocol_config``):
``FULL_DUPLEX_STREAMED`` (the extension's; the default when not told) — the headers answer
waits for the body's end and the body is sent back as ``streamed_response`` chunks;
``BUFFERED`` — the headers are let through at once and the destination rides on the body
answer. With ``STREAMED`` or ``NONE`` the body is not seen before the headers go upstream, so
such requests go round-robin.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from duetime.gateway.intake.admission import Shed, shed_error
from duetime.gateway.intake.request import Allowed, KeyCheck, RequestContext
from duetime.gateway.picker import messages
from duetime.gateway.routing.router import Choice
from duetime.gateway.state.lifecycle import Attempt, Outcome
from duetime.web.errors import ApiError
from duetime.web.sse import Kind, classified, split_events

if TYPE_CHECKING:  # (the picker creates exchanges; annotations only)
    from duetime.gateway.picker.service import Picker

MAX_BODY = 64 << 20  # a request body past this is a 413 (the gateway's limit)
MAX_JSON_RESPONSE = 1 << 20  # a non-streamed response is kept up to this size for its usage
SUBSET_REFUSAL = ("none of the endpoints the gateway allows for this request (its subset "
                  "hint) can serve it")


class SseTally:
    """What a streamed completion tells the shadow replica: output tokens so far (one per
    token event, as the relay counts them: :func:`~duetime.web.sse.event_kind`), the usage's
    count at the end, and whether its ``[DONE]`` came."""

    __slots__ = ("buf", "complete", "tokens", "usage_tokens")

    def __init__(self) -> None:
        self.buf = b""
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.complete = False

    def feed(self, chunk: bytes) -> None:
        events, self.buf = split_events(self.buf + chunk)
        for _, data, kind in classified(events):
            if kind == Kind.DONE:
                self.complete = True
            elif kind == Kind.USAGE and b'"usage"' in data:
                with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                    self.usage_tokens = int(json.loads(data)["usage"]["completion_tokens"])
            elif kind == Kind.TOKEN:
                self.tokens += 1


def _usage_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of a non-streamed completion body, if it has one."""
    try:
        return int(json.loads(body)["usage"]["completion_tokens"])
    except (ValueError, TypeError, KeyError):
        return None


class Exchange:
    """One Envoy stream (one HTTP request and its response), phase by phase."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.host = picker.host
        self.request_mode = messages.FULL_DUPLEX
        self.response_mode = messages.FULL_DUPLEX
        self.modes_known = False
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.t0 = time.monotonic()  # the request's arrival (its headers)
        self.t_body = self.t0  # when its body's last byte came
        self.route = "other"
        self.decided = False
        self.endpoint: str | None = None
        self.destination = ""  # what goes back: the endpoint, then its fallbacks (a list)
        self.subset: list[str] | None = None
        # the routed completion and its attempt
        self.ctx: RequestContext | None = None
        self.attempt: Attempt | None = None
        # its response
        self.status = 0  # HTTP status of the response (0: not seen), or of our own answer
        self.streaming = False
        self.first = False
        self.tally = SseTally()
        self.response = bytearray()

    @property
    def in_flight(self) -> bool:
        """The routed attempt has not ended."""
        return self.attempt is not None and self.attempt.outcome is None

    # -- the phases -------------------------------------------------------------------------------

    async def on(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message from Envoy (none while the body is still coming)."""
        if not self.modes_known and msg.HasField("protocol_config"):
            self.modes_known = True
            self.request_mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(msg)
        if kind == "request_body":
            return await self._request_body(msg.request_body)
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_headers":
            return self._response_headers(msg)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            self.end()
            return [messages.response_trailers_continue()]
        return []

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.t0 = time.monotonic()
        self.host.pollers.request_arrived(self.t0)
        self.headers = messages.headers_of(msg.request_headers)
        self.subset = messages.subset_hint(msg)
        path = self.headers.get(":path", "").split("?", 1)[0].rstrip("/")
        self.route = ("chat" if path.endswith("/chat/completions") else
                      "completions" if path.endswith("/completions") else "other")
        if msg.request_headers.end_of_stream:  # no body: nothing to route on
            return self._answer_round_robin(in_body=False)
        if self.request_mode == messages.BUFFERED:
            return [messages.request_headers_continue()]  # (the destination rides on the body)
        if self.request_mode != messages.FULL_DUPLEX:  # the body comes after the headers went
            return self._answer_round_robin(in_body=False)
        return []

    async def _request_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decided:  # (a mode that does not wait for us: let it through)
            return [messages.request_body_continue()]
        if len(self.body) + len(b.body) > MAX_BODY:
            return self._error(ApiError(413, f"request body larger than {MAX_BODY} bytes",
                                        code="request_too_large"))
        self.body += b.body
        self.t_body = time.monotonic()
        if not b.end_of_stream:
            return []  # (full duplex: nothing is answered before the body's end)
        return await self._decide(end=True)

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        if self.decided:
            return [messages.request_trailers_continue()]
        out = await self._decide(end=False)  # (the body ended with the trailers)
        if self.decided:
            out.append(messages.request_trailers_continue())
        return out

    # -- the decision -----------------------------------------------------------------------------

    def _allowed(self) -> Allowed | None:
        """The data plane's subset hint, as the intake's filter (None: every instance)."""
        if self.subset is None:
            return None
        allowed, endpoints = set(self.subset), self.picker.endpoints
        return Allowed(lambda s: endpoints.of(s) in allowed, SUBSET_REFUSAL)

    async def _decide(self, *, end: bool) -> list[pb.ProcessingResponse]:
        """Route the request now that its body is complete; the answers that carry the
        destination (and, in full-duplex mode, the body back)."""
        if self.route == "other":
            return self._answer_round_robin(in_body=True, end=end)
        raw = bytes(self.body)
        try:
            ctx = await self.host.intake.take(raw, self._scope(), arrival=self.t0,
                                              chat=self.route == "chat", keys=KeyCheck.NONE,
                                              allowed=self._allowed())
            choice = await self.host.router.pick(ctx)
            endpoint = self.picker.endpoints.of(choice.inst)
            if endpoint is None:
                raise ApiError(503, f"instance {choice.inst.name}'s address is not known yet",
                               code="no_healthy_instance")
        except Shed as e:
            return self._error(shed_error(e))
        except ApiError as e:
            return self._error(e)
        self._dispatch(ctx, choice, endpoint)
        self.destination = ",".join([endpoint, *self._fallbacks(ctx, choice)])
        served = ctx.adapter or choice.inst.instance.served_model  # (an adapter: its name)
        if ctx.req.model != served:  # (an alias: the instance knows its own name only)
            body = dict(ctx.req.body)
            body["model"] = served
            raw = json.dumps(body, separators=(",", ":")).encode()
            return self._destination(raw, end=end, rewritten=True)
        return self._destination(raw, end=end, rewritten=False)

    def _fallbacks(self, ctx: RequestContext, choice: Choice) -> list[str]:
        """The endpoints to try after the chosen one (``Picker.fallbacks`` of them)."""
        k = self.picker.fallbacks
        if k <= 0:
            return []
        eps = (self.picker.endpoints.of(s) for s in self.host.router.fallbacks(ctx, choice, k))
        return [e for e in eps if e is not None]

    def _dispatch(self, ctx: RequestContext, choice: Choice, endpoint: str) -> None:
        self.attempt = self.host.router.dispatch(ctx, choice, 1)
        # (the picker's own time: from the body's end, which the client's upload decides)
        self.host.metrics.overhead.observe(time.monotonic() - self.t_body)
        self.ctx, self.endpoint = ctx, endpoint
        self.decided = True

    def _scope(self) -> dict:
        """The request's headers as the intake reads them (an ASGI scope's)."""
        h = self.headers
        client = (h.get("x-forwarded-for") or "").split(",", 1)[0].strip()
        return {"headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()],
                "client": (client,)}

    def _destination(self, raw: bytes, *, end: bool,
                     rewritten: bool) -> list[pb.ProcessingResponse]:
        dest = self.destination
        if self.request_mode == messages.BUFFERED:
            return [messages.destination(dest, in_body_response=True,
                                         body_length=len(raw) if rewritten else None,
                                         body=raw if rewritten else None)]
        return [messages.destination(dest, body_length=len(raw)),
                *messages.streamed_body(raw, end=end, request=True)]

    def _answer_round_robin(self, *, in_body: bool,
                            end: bool = True) -> list[pb.ProcessingResponse]:
        endpoint = self.picker.any_endpoint(self.subset)
        if endpoint is None:
            return self._error(ApiError(503, "no healthy instance", code="no_healthy_instance"))
        self.endpoint = endpoint
        self.decided = True
        if not in_body:
            return [messages.destination(endpoint)]
        raw = bytes(self.body)
        if self.request_mode == messages.BUFFERED:
            return [messages.destination(endpoint, in_body_response=True)]
        return [messages.destination(endpoint, body_length=len(raw)),
                *messages.streamed_body(raw, end=end, request=True)]

    def _error(self, e: ApiError) -> list[pb.ProcessingResponse]:
        self.status = e.status
        self.decided = True
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in e.headers]
        return [messages.immediate(e.status, e.encode(),
                                   details=f"duetime_epp_{e.code or 'error'}",
                                   headers=headers or None)]

    # -- the response -----------------------------------------------------------------------------

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        h = messages.headers_of(msg.response_headers)
        with contextlib.suppress(ValueError):
            self.status = int(h.get(":status", "0"))
        self.streaming = "text/event-stream" in h.get("content-type", "")
        served = messages.served_endpoint(msg, h)
        if served is not None and served != self.endpoint and self.attempt is not None:
            self._moved(served)
        extra: list[tuple[str, str]] = []
        a = self.attempt
        if a is not None:
            extra = [("x-duetime-instance", a.inst.name), ("x-duetime-model", a.inst.model)]
            forecast = a.flight.forecast
            if forecast is not None and math.isfinite(forecast):
                extra.append(("x-duetime-forecast-ttft-ms", f"{forecast * 1000:.1f}"))
            if self.status != 200 and self.status:
                kind = ("status_5xx" if self.status >= 500 else
                        "status_429" if self.status == 429 else None)
                if kind is None:  # (a 4xx is the client's: the instance answered)
                    self.end()
                elif self.in_flight:
                    self.host.lifecycle.end(a, time.monotonic(), Outcome.FAILED, failure=(
                        kind, f"upstream answered {self.status}"))
        return [messages.response_headers(extra)]

    def _moved(self, served: str) -> None:
        """The data plane served the request elsewhere (its own retry or fallback): the attempt
        ends on the instance the picker chose, and another starts on the one that served it
        (the data plane's choice: no forecast)."""
        other = self.picker.endpoints.by_endpoint.get(served)
        a, ctx = self.attempt, self.ctx
        if other is None or a is None or ctx is None or other is a.inst or not self.in_flight:
            return
        now = time.monotonic()
        lifecycle = self.host.lifecycle
        lifecycle.end(a, now, Outcome.CANCELLED)
        cfg = other.instance.config
        f = a.flight
        flight = other.new_flight(f"{f.id}-served", f.prompt_tokens, f.predicted, now, None,
                                  ctx.keys(cfg.block_size) if cfg.enable_prefix_caching
                                  else None)
        self.attempt = lifecycle.dispatch(Attempt(
            flight, other, a.number + 1, a.arrival, a.target_s, "(data plane)", other.source(),
            a.tpot_target_s, key=a.key, client=a.client))
        self.endpoint = served

    def _response_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        a, chunk = self.attempt, b.body
        if a is not None and self.in_flight:
            lifecycle = self.host.lifecycle
            if chunk and not self.first:
                self.first = True
                lifecycle.record_first_token(a, time.monotonic())
            if self.streaming:
                self.tally.feed(chunk)
                lifecycle.record_progress(a, self.tally.tokens)
            elif len(self.response) + len(chunk) <= MAX_JSON_RESPONSE:
                self.response += chunk
            if b.end_of_stream:
                self.end()
        if self.response_mode == messages.FULL_DUPLEX:
            return list(messages.streamed_body(chunk, end=b.end_of_stream, request=False))
        return [messages.response_body_continue()]

    def end(self, outcome: Outcome = Outcome.OK) -> None:
        """The request ended (its body's end, trailers, the stream closed or cancelled): its
        attempt ends, once."""
        a = self.attempt
        if a is None or not self.in_flight:
            return
        out: int | None = None
        if self.status in (0, 200) and self.first:
            out = (self.tally.usage_tokens if self.tally.usage_tokens is not None
                   else self.tally.tokens) if self.streaming else _usage_tokens(
                bytes(self.response))
        self.host.lifecycle.end(a, time.monotonic(), outcome, output_tokens=out)

    def close(self, *, cancelled: bool) -> None:
        """The stream is over: end what is still in flight and count the request."""
        if cancelled and self.in_flight:
            self.host.metrics.cancelled.inc()
            self.end(Outcome.CANCELLED)
        self.end()
        if self.route != "other" and self.decided:
            status = self.status or (499 if cancelled else 200)
            self.host.metrics.requests.labels(self.route, str(status)).inc()
