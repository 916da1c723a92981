"""``duetime epp``: the endpoint picker of the Gateway API Inference Extension, over a
:class:`~duetime.gateway.app.Gateway`'s live state.

Envoy opens one ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` stream per HTTP
request and sends its phases: request headers, body (chunks), trailers, then the response's
headers, body chunks and trailers. The picker answers as the inference extension's protocol
says (docs/kubernetes.md cites it):

- a completion request (``/v1/chat/completions``, ``/v1/completions``) is routed once its body
  is complete, by the gateway's own :class:`~duetime.gateway.routing.Router` (``plan``,
  ``pick``, ``dispatch``: the same decision and bookkeeping as ``duetime serve``), and the
  chosen instance's ``ip:port`` goes back as the ``x-gateway-destination-endpoint`` header
  and ``envoy.lb`` dynamic metadata; ``model: "auto"`` (an alias) is rewritten to the model
  the instance serves. Any other request (no body, another path) goes round-robin to an
  instance in rotation;
- the response phases feed the shadow replica as the relay does: dispatch at the decision,
  first token at the first response body byte, token progress by counting SSE events, and
  completion at the end of the body, at the trailers, or when the stream closes or is
  cancelled (the request then leaves the replica: forecasts stay live);
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

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from duetime.gateway import extproc
from duetime.gateway.admission import Shed
from duetime.gateway.app import Gateway
from duetime.gateway.inflight import Flight
from duetime.gateway.instance import InstanceState
from duetime.gateway.relay import Controls
from duetime.gateway.routing import Choice, Plan
from duetime.web.errors import ApiError
from duetime.web.requests import parse_completion
from duetime.web.sse import payload, split_events

log = logging.getLogger("duetime.gateway")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RESOLVE_INTERVAL_S = 10.0  # instance host names are looked up again this often
MAX_BODY = 64 << 20  # a request body past this is a 413 (the gateway's limit)
MAX_JSON_RESPONSE = 1 << 20  # a non-streamed response is kept up to this size for its usage


def endpoint_address(url: str) -> tuple[str, int]:
    """Host and port of an instance URL (the scheme's default port when none is given)."""
    u = urlsplit(url)
    if u.hostname is None:
        raise ValueError(f"instance URL without a host: {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def join(host: str, port: int) -> str:
    """``ip:port`` (an IPv6 address in brackets, as Go's ``net.JoinHostPort``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoints:
    """Each instance's ``ip:port``: its URL's host if that is an address, else the host's
    address looked up (at start, then every :data:`RESOLVE_INTERVAL_S`: a pod that comes
    back has a new IP under its stable DNS name)."""

    def __init__(self, instances: list[InstanceState]) -> None:
        self.instances = instances
        self.by_name: dict[str, str] = {}
        self.by_endpoint: dict[str, InstanceState] = {}
        for s in instances:
            host, port = endpoint_address(s.url)
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(host)
                self._set(s, join(host, port))

    def _set(self, s: InstanceState, endpoint: str) -> None:
        old = self.by_name.get(s.name)
        if old is not None and self.by_endpoint.get(old) is s:
            del self.by_endpoint[old]
        self.by_name[s.name] = endpoint
        self.by_endpoint[endpoint] = s

    async def resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for s in self.instances:
            host, port = endpoint_address(s.url)
            try:
                ipaddress.ip_address(host)
                continue
            except ValueError:
                pass
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("instance host not resolved", extra={"fields": {
                    "instance": s.name, "host": host, "error": str(e)}})
                continue
            if infos:
                self._set(s, join(str(infos[0][4][0]), port))

    def of(self, s: InstanceState) -> str | None:
        return self.by_name.get(s.name)


class SseTally:
    """What a streamed completion tells the shadow replica: output tokens so far (one per
    content event, as the relay counts them), the usage's count at the end, and ``[DONE]``."""

    __slots__ = ("buf", "done", "tokens", "usage_tokens")

    def __init__(self) -> None:
        self.buf = b""
        self.tokens = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, chunk: bytes) -> None:
        events, self.buf = split_events(self.buf + chunk)
        for ev in events:
            data = payload(ev)
            if data is None:
                continue
            if data == b"[DONE]":
                self.done = True
            elif b'"usage"' in data and (b'"choices":[]' in data or b'"choices": []' in data):
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    self.usage_tokens = int(json.loads(data)["usage"]["completion_tokens"])
            elif data.startswith(b'{"error"') or data.startswith(b'{"object":"error"'):
                continue
            elif not (b'"role"' in data and b'"content":""' in data):
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
        self.request_mode = extproc.FULL_DUPLEX
        self.response_mode = extproc.FULL_DUPLEX
        self.modes_known = False
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.t0 = time.monotonic()  # the request's arrival (its headers)
        self.t_body = self.t0  # when its body's last byte came
        self.route = "other"
        self.decided = False
        self.endpoint: str | None = None
        self.subset: list[str] | None = None
        # the routed completion
        self.inst: InstanceState | None = None
        self.flight: Flight | None = None
        self.plan: Plan | None = None
        self.ctl: Controls | None = None
        # its response
        self.status = 0  # HTTP status of the response (0: not seen), or of our own answer
        self.streaming = False
        self.first = False
        self.tally = SseTally()
        self.response = bytearray()
        self.done = False  # the flight was completed

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
            self.complete()
            return [extproc.response_trailers_continue()]
        return []

    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.t0 = time.monotonic()
        self.picker.gateway.pollers.request_arrived(self.t0)
        self.headers = extproc.headers_of(msg.request_headers)
        self.subset = extproc.subset_hint(msg)
        path = self.headers.get(":path", "").split("?", 1)[0].rstrip("/")
        self.route = ("chat" if path.endswith("/chat/completions") else
                      "completions" if path.endswith("/completions") else "other")
        if msg.request_headers.end_of_stream:  # no body: nothing to route on
            return self._answer_round_robin(in_body=False)
        if self.request_mode == extproc.BUFFERED:
            return [extproc.request_headers_continue()]  # (the destination rides on the body)
        if self.request_mode != extproc.FULL_DUPLEX:  # the body comes after the headers went
            return self._answer_round_robin(in_body=False)
        return []

    async def _request_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.decided:  # (a mode that does not wait for us: let it through)
            return [extproc.request_body_continue()]
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
            return [extproc.request_trailers_continue()]
        out = await self._decide(end=False)  # (the body ended with the trailers)
        if self.decided:
            out.append(extproc.request_trailers_continue())
        return out

    # -- the decision -----------------------------------------------------------------------------

    async def _decide(self, *, end: bool) -> list[pb.ProcessingResponse]:
        """Route the request now that its body is complete; the answers that carry the
        destination (and, in full-duplex mode, the body back)."""
        if self.route == "other":
            return self._answer_round_robin(in_body=True, end=end)
        picker = self.picker
        gw = picker.gateway
        router = gw.router
        raw = bytes(self.body)
        try:
            req = parse_completion(raw, chat=self.route == "chat")
            req.prompt_tokens = router.count_tokens(req)
            ctl = router.controls(self._scope(), req.prompt_tokens)
            router = router.variant(ctl)  # (x-duetime-policy / x-duetime-lambda)
            insts = router.candidates(req.model, req.prompt_tokens, req.max_tokens,
                                      param="messages" if req.chat else "prompt")
            if self.subset is not None:
                allowed = set(self.subset)
                insts = [s for s in insts if picker.endpoints.of(s) in allowed]
                if not insts:
                    raise ApiError(503, "none of the endpoints the gateway allows for this "
                                   "request (its subset hint) can serve it",
                                   code="no_healthy_instance")
            plan = router.plan(req, ctl)
            choice = await router.pick(plan, ctl, insts, self.t0)
            endpoint = picker.endpoints.of(choice.inst)
            if endpoint is None:
                raise ApiError(503, f"instance {choice.inst.name}'s address is not known yet",
                               code="no_healthy_instance")
        except Shed as e:
            return self._error(ApiError(
                429, f"no instance can meet this sheddable request's TTFT target now "
                f"(target {e.target_s * 1000:.1f} ms, best forecast "
                f"{e.forecast_s * 1000:.1f} ms); retry later", code="overloaded",
                type_="rate_limit_error"),
                [("retry-after", str(max(1, math.ceil(e.retry_after_s))))])
        except ApiError as e:
            return self._error(e)
        self._dispatch(plan, choice, ctl, endpoint)
        served = choice.inst.instance.served_model
        if req.model != served:  # (an alias: the instance knows its own name only)
            body = dict(req.body)
            body["model"] = served
            raw = json.dumps(body, separators=(",", ":")).encode()
            return self._destination(raw, end=end, rewritten=True)
        return self._destination(raw, end=end, rewritten=False)

    def _dispatch(self, plan: Plan, choice: Choice, ctl: Controls, endpoint: str) -> None:
        gw = self.picker.gateway
        self.flight = gw.router.dispatch(plan, choice, 1)
        # (the picker's own time: from the body's end, which the client's upload decides)
        gw.metrics.overhead.observe(time.monotonic() - self.t_body)
        self.inst, self.plan, self.ctl, self.endpoint = choice.inst, plan, ctl, endpoint
        self.decided = True

    def _scope(self) -> dict:
        """The request's headers as the router reads them (an ASGI scope's)."""
        h = self.headers
        client = (h.get("x-forwarded-for") or "").split(",", 1)[0].strip()
        return {"headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()],
                "client": (client,)}

    def _destination(self, raw: bytes, *, end: bool,
                     rewritten: bool) -> list[pb.ProcessingResponse]:
        assert self.endpoint is not None
        if self.request_mode == extproc.BUFFERED:
            return [extproc.destination(self.endpoint, in_body_response=True,
                                        body_length=len(raw) if rewritten else None,
                                        body=raw if rewritten else None)]
        return [extproc.destination(self.endpoint, body_length=len(raw)),
                *extproc.streamed_body(raw, end=end, request=True)]

    def _answer_round_robin(self, *, in_body: bool,
                            end: bool = True) -> list[pb.ProcessingResponse]:
        endpoint = self.picker.any_endpoint(self.subset)
        if endpoint is None:
            return self._error(ApiError(503, "no healthy instance", code="no_healthy_instance"))
        self.endpoint = endpoint
        self.decided = True
        if not in_body:
            return [extproc.destination(endpoint)]
        raw = bytes(self.body)
        if self.request_mode == extproc.BUFFERED:
            return [extproc.destination(endpoint, in_body_response=True)]
        return [extproc.destination(endpoint, body_length=len(raw)),
                *extproc.streamed_body(raw, end=end, request=True)]

    def _error(self, e: ApiError,
               headers: list[tuple[str, str]] | None = None) -> list[pb.ProcessingResponse]:
        self.status = e.status
        self.decided = True
        return [extproc.immediate(e.status, e.encode(), details=f"duetime_epp_{e.code or 'error'}",
                                  headers=headers)]

    # -- the response -----------------------------------------------------------------------------

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        h = extproc.headers_of(msg.response_headers)
        with contextlib.suppress(ValueError):
            self.status = int(h.get(":status", "0"))
        self.streaming = "text/event-stream" in h.get("content-type", "")
        served = extproc.served_endpoint(msg)
        if served is not None and served != self.endpoint and self.flight is not None:
            self._moved(served)
        extra: list[tuple[str, str]] = []
        inst, flight = self.inst, self.flight
        if inst is not None and flight is not None:
            extra = [("x-duetime-instance", inst.name), ("x-duetime-model", inst.model)]
            if flight.forecast is not None and math.isfinite(flight.forecast):
                extra.append(("x-duetime-forecast-ttft-ms", f"{flight.forecast * 1000:.1f}"))
            if self.status != 200 and self.status:
                kind = ("status_5xx" if self.status >= 500 else
                        "status_429" if self.status == 429 else None)
                if kind is not None:  # (a 4xx is the client's)
                    inst.health.report_failure(kind, f"upstream answered {self.status}")
                    self.picker.gateway.metrics.upstream_errors.labels(inst.name, kind).inc()
                self.complete()
        return [extproc.response_headers(extra)]

    def _moved(self, served: str) -> None:
        """The data plane served the request elsewhere (its own retry or fallback): the
        flight moves to that instance's ledger and replica."""
        other = self.picker.endpoints.by_endpoint.get(served)
        inst, f, plan = self.inst, self.flight, self.plan
        if other is None or inst is None or f is None or plan is None or other is inst:
            return
        now = time.monotonic()
        inst.complete(f, now)
        cfg = other.instance.config
        self.flight = other.dispatch(f"{f.id}-served", f.prompt_tokens, f.predicted, now, None,
                                     plan.keys(cfg.block_size) if cfg.enable_prefix_caching
                                     else None)
        self.inst, self.endpoint = other, served

    def _response_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        inst, flight, chunk = self.inst, self.flight, b.body
        if inst is not None and flight is not None and not self.done:
            if chunk and not self.first:
                self.first = True
                assert self.ctl is not None
                self.picker.gateway.relay.first_token(inst, flight, time.monotonic(), self.t0,
                                                      self.ctl)
            if self.streaming:
                self.tally.feed(chunk)
                inst.progress(flight, self.tally.tokens)
            elif len(self.response) + len(chunk) <= MAX_JSON_RESPONSE:
                self.response += chunk
            if b.end_of_stream:
                self.complete()
        if self.response_mode == extproc.FULL_DUPLEX:
            return list(extproc.streamed_body(chunk, end=b.end_of_stream, request=False))
        return [extproc.response_body_continue()]

    def complete(self) -> None:
        """The request ended (its body's end, trailers, the stream closed or cancelled): it
        leaves the instance's ledger and replica once."""
        inst, flight = self.inst, self.flight
        if self.done or inst is None or flight is None:
            return
        self.done = True
        out: int | None = None
        if self.status in (0, 200) and self.first:
            out = (self.tally.usage_tokens if self.tally.usage_tokens is not None
                   else self.tally.tokens) if self.streaming else _usage_tokens(
                bytes(self.response))
        inst.complete(flight, time.monotonic(), output_tokens=out)

    def close(self, *, cancelled: bool) -> None:
        """The stream is over: complete what is still in flight and count the request."""
        if cancelled and self.flight is not None and not self.done:
            self.picker.gateway.metrics.cancelled.inc()
        self.complete()
        if self.route != "other" and self.decided:
            status = self.status or (499 if cancelled else 200)
            self.picker.gateway.metrics.requests.labels(self.route, str(status)).inc()


class Picker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service over a started :class:`Gateway` (its router, instances, metrics
    and pollers); :meth:`start` serves it, with gRPC health checks, on ``host:port``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.endpoints = Endpoints(gateway.instances)
        self._rr = itertools.count()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._resolver: asyncio.Task[None] | None = None

    def ready(self) -> bool:
        """Serving: the gateway is started and some instance is in rotation."""
        return self.gateway.upstream is not None and any(
            s.healthy for s in self.gateway.instances)

    def any_endpoint(self, subset: list[str] | None) -> str | None:
        """Round robin over the instances in rotation (within ``subset``, if given)."""
        insts, _ = self.gateway.router.rotation(self.gateway.instances, set())
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
