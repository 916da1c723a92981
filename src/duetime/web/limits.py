"""Protocol limits of duetime's HTTP servers (the gateway's ``limits:`` config section; the
emulator runs with the defaults).

Why each exists (measured on the gateway before they did, issue 16): uvicorn's httptools
protocol buffers a request's header section without bound and waits for it forever, so 50
unfinished 10 MB headers took the gateway from 233 to 751 MB and 3,000 half-open connections
stayed open for a minute; Python's ``json`` raises ``RecursionError`` past ~1,000 nesting
levels, which answered 500. uvicorn bounds none of these on the httptools protocol
(``h11_max_incomplete_event_size`` is h11's only; ``limit_concurrency`` answers a text/plain
503), so :mod:`duetime.web.protocol` enforces them and answers OpenAI JSON errors.
"""

from __future__ import annotations

import contextvars
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from duetime.web.errors import ApiError


class LimitsSpec(BaseModel):
    """The limits (all have safe defaults; a pool config may set any of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the request line and headers together: past it, 431 and the connection closes (memory
    # per connection stays bounded by about this plus one socket read)
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # from a connection's first byte (or its opening) to the end of the headers: past it the
    # connection closes (408 if some of a request had arrived) -- slow or half-open clients
    header_timeout_s: float = Field(10.0, gt=0)
    # from the end of the headers to the end of the body: past it, 408 and close
    body_timeout_s: float = Field(60.0, gt=0)
    # JSON nesting of a request body: deeper is a 400 (never Python's RecursionError, a 500)
    max_json_depth: int = Field(128, ge=2, le=900)
    # open client connections: a request on a connection beyond it gets a 503 and the
    # connection closes (file descriptors and per-connection memory stay bounded)
    max_connections: int = Field(4096, ge=1)
    # how long an idle keep-alive connection is held: longer than clients hold theirs (httpx
    # and so the OpenAI SDK: 5 s, uvicorn's own default too), so that the client closes
    # first; at equal timeouts a client reusing a connection as the server closes it saw a
    # bare connection reset (2 of a burst of 500 through the demo pool)
    keep_alive_s: float = Field(75.0, gt=0)


DEFAULT_LIMITS = LimitsSpec()

# how long duetime's own clients of an instance (the gateway's upstream pool, `duetime
# calibrate`, `duetime validate`) keep an idle connection: shorter than vLLM's keep-alive (its
# API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so
# that the client closes first. A request written on a connection as the server closes it
# gets a bare connection reset: seen once in 60 requests of `duetime validate` against vLLM in
# CI, whose session held idle connections for aiohttp's default 15 s
INSTANCE_KEEP_ALIVE_S = 4.0

# the JSON depth limit of the request being parsed: set by the server's completion endpoint
# for its own task (each server may have its own limits); parse_json reads it
json_depth_limit: contextvars.ContextVar[int] = contextvars.ContextVar(
    "json_depth_limit", default=DEFAULT_LIMITS.max_json_depth)


def too_deep(max_depth: int) -> ApiError:
    return ApiError(400, f"request body is nested deeper than {max_depth} levels",
                    code="json_too_deep")


def check_json_depth(value: Any, raw: bytes, max_depth: int | None = None) -> None:
    """Raise a 400 :class:`ApiError` if the parsed ``value`` (of ``raw``) nests containers
    deeper than ``max_depth`` (default: :data:`json_depth_limit`). The walk runs only when
    ``raw`` has more brackets than the limit (a C-speed count), so ordinary bodies cost
    nothing; it never recurses."""
    limit = json_depth_limit.get() if max_depth is None else max_depth
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is not dict and t is not list:
            continue
        if depth > limit:
            raise too_deep(limit)
        for x in (v.values() if t is dict else v):
            tx = type(x)
            if tx is dict or tx is list:
                stack.append((x, depth + 1))
