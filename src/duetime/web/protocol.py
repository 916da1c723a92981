"""uvicorn's httptools HTTP/1.1 protocol with :class:`~duetime.web.limits.LimitsSpec`
enforced, and OpenAI JSON errors where uvicorn would answer text/plain.

What uvicorn (>= 0.29, read at 0.54) leaves open on this protocol, and what this adds:

- header size: llhttp (httptools) has no limit and uvicorn sets none (``h11_max_incomplete_
  event_size`` is for h11, the slower parser): bytes received while a request's headers are
  incomplete are counted, past ``max_header_bytes`` the answer is 431 and the connection closes;
- header read timeout: uvicorn arms its keep-alive timer only after a response, so a client
  that connects and sends nothing, or half a header, holds the connection forever: a timer
  from the connection's opening (or a later request's first byte) to the end of the headers;
- body read timeout: none in uvicorn: a timer from the end of the headers to the end of the
  body; past it 408 (if nothing was answered yet) and the connection closes, so the app's
  ``receive`` sees a disconnect;
- connection cap: uvicorn's ``limit_concurrency`` answers text/plain; here a request on a
  connection beyond ``max_connections`` gets a JSON 503 and ``connection: close``;
- malformed requests: uvicorn's text/plain 400 becomes JSON.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from duetime.web.errors import ApiError, raw_response
from duetime.web.limits import LimitsSpec

log = logging.getLogger("duetime.web")

LINGER_S = 2.0  # after a rejection, how long the rest of a request is read and dropped


async def over_capacity(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app of a connection beyond the cap: a JSON 503 that closes the connection."""
    body = ApiError(503, "too many open connections; retry later",
                    code="too_many_connections").encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


class NewConnections:
    """How many of a server's open connections have not sent a request yet. In a burst each
    new connection brings one: the requests coming before the server has read them (the
    gateway's own queue, :mod:`duetime.gateway.state.load`)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class LimitedProtocol(HttpToolsProtocol):
    """:class:`HttpToolsProtocol` with :attr:`limits` (see :func:`protocol_class`)."""

    limits: LimitsSpec = LimitsSpec()
    new_connections: NewConnections = NewConnections()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._fresh = True  # (no request read on it yet)
        self.new_connections.count += 1
        self._head_bytes = 0
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._lingering = False
        self._arm_head()
        if len(self.connections) > self.limits.max_connections:
            self.app = over_capacity  # (uvicorn's on_headers_complete runs self.app)

    def connection_lost(self, exc: Exception | None) -> None:
        self._not_fresh()
        self._cancel_timers()
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                    self._head_timed_out)

    # -- the parser's input and callbacks ----------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += len(data)
            self._arm_head()
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes \
                and not self._closed():
            self._reject_head()

    def _reject_head(self) -> None:
        self._reject(ApiError(431, f"request headers larger than "
                              f"{self.limits.max_header_bytes} bytes",
                              code="request_header_fields_too_large"))

    def on_body(self, body: bytes) -> None:
        if not self._closed():  # (nothing more of a rejected request)
            super().on_body(body)

    def _not_fresh(self) -> None:
        if self._fresh:
            self._fresh = False
            self.new_connections.count -= 1

    def on_headers_complete(self) -> None:
        self._not_fresh()
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
        if size > self.limits.max_header_bytes:  # (a head that arrived in one read)
            self._head_bytes = size
            self._reject_head()
            return
        super().on_headers_complete()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                    self._body_timed_out)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._in_head = True  # (the next request's head: its timer starts at its first byte)
        self._head_bytes = 0
        if not self._closed():
            super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._closed():
            self._reject(ApiError(400, msg, code="invalid_http"))

    # -- limits -------------------------------------------------------------------------------

    def _closed(self) -> bool:
        return self._lingering or self.transport.is_closing()

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _reject(self, err: ApiError, *, answer: bool = True) -> None:
        """Answer ``err`` (unless a response is under way, or ``answer`` is false) and close."""
        log.info("connection rejected", extra={"fields": {
            "event": "connection_rejected", "status": err.status, "code": err.code,
            "client": f"{self.client[0]}:{self.client[1]}" if self.client else None}})
        c = self.cycle
        self._cancel_timers()
        if answer and (c is None or not c.response_started or c.response_complete):
            self.transport.write(raw_response(err))
            if c is not None and not c.response_complete:  # (for the app the client is gone)
                c.disconnected = True
                c.message_event.set()
            if self.transport.can_write_eof():
                # a lingering close: closing with unread input would reset the connection
                # and the client might never read the answer; so stop writing, discard what
                # still comes (nothing is kept), and close when the client does, or soon
                self.transport.write_eof()
                self._lingering = True
                self._head_timer = self.loop.call_later(
                    min(LINGER_S, self.limits.header_timeout_s), self.transport.close)
                return
        self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._closed() or self._busy():
            return  # (headers done, or a pipelined request waits behind a response)
        self._reject(ApiError(408, f"request headers not received within "
                              f"{self.limits.header_timeout_s:g} s", code="request_timeout"),
                     answer=self._head_bytes > 0)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._closed():
            return
        self._reject(ApiError(408, f"request body not received within "
                              f"{self.limits.body_timeout_s:g} s", code="request_timeout"))


def protocol_class(limits: LimitsSpec, new_connections: NewConnections | None = None
                   ) -> type[LimitedProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits`` (and counting its
    connections that have not sent a request yet in ``new_connections``)."""
    return type("LimitedProtocol", (LimitedProtocol,), {
        "limits": limits, "new_connections": new_connections or NewConnections()})
