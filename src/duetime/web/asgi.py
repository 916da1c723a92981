"""Raw-ASGI helpers shared by the servers here, and the completion endpoint they both use.

The completion routes are raw ASGI apps rather than Starlette endpoints: a handler runs in the
request's own task and is cancelled when its client disconnects (:class:`Disconnect`), and
:class:`FastRoutes` sends them past Starlette's middleware stack (three wrappers around every
``send``; with a message per token that was ~15% of the gateway's time per request, py-spy on
``benchmarks/gateway_overhead.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from duetime.web.errors import ApiError
from duetime.web.limits import DEFAULT_LIMITS, LimitsSpec, json_depth_limit

log = logging.getLogger("duetime.web")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY = 64 * 1024 * 1024


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        if chunk:
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


JSON_HEADERS = [(b"content-type", b"application/json")]


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: ApiError,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """The error as an OpenAI error body, with its headers (and ``extra`` ones)."""
    await send_json(send, err.status, err.encode(), [*err.headers, *(extra or ())])


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (``name`` in lower case), or None."""
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


SHUTDOWN = ApiError(503, "the server shut down before the response was complete (its drain "
                    "timeout is past)", code="server_shutdown")


class Disconnect:
    """Runs an ASGI handler in the current task and cancels it if the client disconnects.

    ``send`` (the wrapper) records when the response is complete, so that the
    ``http.disconnect`` a server reports after a finished response is not mistaken for the
    client going away. ``gone`` says whether the handler was cancelled for that reason.

    A handler cancelled otherwise was cut by its server (shutting down, past its drain
    timeout: :meth:`~duetime.web.server.AppServer.stop`): the client is told rather than
    left with a stream that just ends -- a final ``data: {"error": ...}`` event on an SSE
    stream, a JSON 503 if nothing was answered yet.
    """

    __slots__ = ("_send", "complete", "gone", "sse", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.complete = False
        self.started = False
        self.sse = False
        self.gone = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def _cut(self) -> None:
        """End the response with an error (the server cut the request), within a second."""
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(1.0):
                if not self.started:
                    await send_error(self._send, SHUTDOWN, [(b"connection", b"close")])
                elif self.sse:
                    await self._send({"type": "http.response.body", "more_body": False,
                                      "body": b"data: " + SHUTDOWN.encode() + b"\n\n"})

    async def run(self, receive: Receive, handler: Awaitable[None]) -> None:
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not self.complete:
                        self.gone = True
                        task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not self.gone:
                if self.complete:
                    raise
                await self._cut()  # (a non-SSE response under way is closed by the server)
                self.complete = True
            task.uncancel()
        finally:
            self.complete = True
            watcher.cancel()


Handler = Callable[[Scope, bytes, "Disconnect", float], Awaitable[None]]


class CompletionEndpoint:
    """A completion route as a raw ASGI app: read the body (413 past ``MAX_BODY``), then run
    ``handler(scope, body, guard, t0)`` under a :class:`Disconnect` guard, so that a client
    that goes away cancels it. ``guard.send`` is the response channel; ``t0`` the arrival.
    ``limits``: the server's (the JSON depth limit applies to this request's parsing); an
    exception the handler lets out is logged and answered as a JSON 500 naming nothing of it."""

    def __init__(self, handler: Handler, limits: LimitsSpec = DEFAULT_LIMITS) -> None:
        self.handler = handler
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.monotonic()
        try:
            raw = await read_body(receive)
        except ApiError as e:
            await send_error(send, e, [(b"connection", b"close")])  # (the body is unread)
            return
        if raw is None:
            return
        json_depth_limit.set(self.limits.max_json_depth)  # (this request's task only)
        guard = Disconnect(send)
        try:
            await guard.run(receive, self.handler(scope, raw, guard, t0))
        except Exception:
            if guard.started:  # (the server logs it and drops the connection)
                raise
            log.exception("internal error", extra={"fields": {
                "event": "internal_error", "route": scope.get("path")}})
            await send_error(send, ApiError(500, "internal server error", code="internal_error"))


class FastRoutes:
    """POSTs to the given paths go straight to their raw-ASGI handlers; everything else to
    ``app`` (a Starlette app, whose ``state`` this exposes). The handlers answer their own
    errors, so the middleware stack adds nothing on these routes; a GET there still gets
    Starlette's 405."""

    def __init__(self, app: Any, fast: dict[str, Callable[[Scope, Receive, Send],
                                                        Awaitable[None]]]) -> None:
        self.app = app
        self.fast = fast
        self.state = app.state
        # requests on the other routes under way (a dashboard's event stream lasts as long as
        # the page is open: the gateway's own load counts only what is not one of these)
        self.others_in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.others_in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.others_in_progress -= 1
