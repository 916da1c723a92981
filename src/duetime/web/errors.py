"""OpenAI-style errors: one exception type, answered as ``{"error": {"message", "type",
"param", "code"}}`` by every server here (the gateway and the emulator), on every route
(:func:`exception_handlers` for Starlette's 404, 405 and 500).

Error hygiene: a message never carries more than :data:`MAX_MESSAGE` characters (messages that
quote a client's value are cut, marked ``...(truncated)``), so that a 1 MB header value is not
echoed back whole, nor logged whole; messages name no upstream host, port or library error
(those go to the log only).
"""

from __future__ import annotations

import http
import json
import math
from typing import Any

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 431: "invalid_request_error", 500: "server_error",
          502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}

MAX_MESSAGE = 300  # characters of an error message (the quoted client input in it: less)
TRUNCATED = "...(truncated)"


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text``, or its first ``limit`` characters marked as truncated."""
    return text if len(text) <= limit else text[:limit] + TRUNCATED


class ApiError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``,
    with ``headers`` added to the response (a 429's ``Retry-After``, a key's limits)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        message = clip(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else clip(param, 100)
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers: list[tuple[bytes, bytes]] = list(headers or ())

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()


def number_in(raw: str, lo: float, hi: float, *, param: str, code: str,
              what: str = "a number") -> float:
    """``raw`` as a finite number in [lo, hi]; else a 400 naming ``param``."""
    try:
        x = float(raw)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ApiError(400, f"{param} must be {what} in [{lo:g}, {hi:g}], got {raw[:40]!r}",
                       param=param, code=code)
    return x


def error_body(status: int, message: str, **kw: Any) -> bytes:
    return ApiError(status, message, **kw).encode()


def relayed_error(status: int, body: bytes) -> bytes:
    """An upstream server's client-error body as relayed to the client: its OpenAI
    ``error`` fields kept (type, code), the message and param clipped like ours; a body of any
    other shape (FastAPI's ``detail`` list, text) becomes one clipped message. Upstream
    validation errors may quote the request (pydantic's ``input``): never echoed whole."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        code, type_, param = err.get("code"), err.get("type"), err.get("param")
        return json.dumps({"error": {
            "message": clip(err["message"]),
            "type": type_ if isinstance(type_, str) else _TYPES.get(status,
                                                                    "invalid_request_error"),
            "param": clip(param, 100) if isinstance(param, str) else None,
            "code": code if isinstance(code, int | str) and len(str(code)) <= 100 else None,
        }}).encode()
    if isinstance(data, dict) and "detail" in data:
        text = json.dumps(data["detail"]) if not isinstance(data["detail"], str) else data["detail"]
    else:
        text = body.decode("utf-8", "replace")
    return error_body(status, text or _phrase(status) or f"status {status}")


def _phrase(status: int) -> str:
    """HTTP's reason phrase for ``status`` ("" for a code it does not know)."""
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def raw_response(err: ApiError) -> bytes:
    """A whole HTTP/1.1 response (``connection: close``) carrying ``err``: what a server's
    protocol writes itself when it rejects a request before any app sees it."""
    body = err.encode()
    return (f"HTTP/1.1 {err.status} {_phrase(err.status)}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def exception_handlers() -> dict[Any, Any]:
    """Starlette ``exception_handlers`` answering OpenAI JSON errors: its HTTP errors (404
    unknown path, 405 wrong method, ...) and, for any unhandled exception, a 500 that names
    nothing of it (the exception is logged by the server)."""
    from starlette.exceptions import HTTPException
    from starlette.responses import Response

    async def http_error(request: Any, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 404:
            message = f"no route {clip(request.url.path, 200)}"
        elif status == 405:
            message = f"method {request.method} is not allowed on {clip(request.url.path, 200)}"
        else:
            message = clip(str(exc.detail))
        err = ApiError(status, message, code=_HTTP_CODES.get(status))
        return Response(err.encode(), status_code=status, media_type="application/json",
                        headers=exc.headers)

    async def server_error(request: Any, exc: Exception) -> Response:
        err = ApiError(500, "internal server error", code="internal_error")
        return Response(err.encode(), status_code=500, media_type="application/json")

    return {HTTPException: http_error, Exception: server_error}
