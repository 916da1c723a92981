"""Server-sent events as the OpenAI streaming API uses them: ``data: {...}`` events separated by
blank lines, ending with ``data: [DONE]``."""

from __future__ import annotations

from duetime.web.errors import ApiError

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]
DONE = b"data: [DONE]\n\n"


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (without their blank-line terminator) and the incomplete rest."""
    if b"\r\n" in buf:
        buf = buf.replace(b"\r\n", b"\n")
    parts = buf.split(b"\n\n")
    return [p for p in parts[:-1] if p], parts[-1]


def payload(ev: bytes) -> bytes | None:
    """The data of an SSE event (``data: ...``), None for comments and other fields."""
    for line in ev.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].lstrip()
    return None


def error_event(message: bytes) -> bytes:
    """A final ``data: {"error": ...}`` event: an upstream's JSON error as it is, or, for the
    gateway's own description of what broke (which may carry a library's error text, for the
    log only), a 502 ``upstream_broken`` error that names nothing of it."""
    if message.startswith(b"{"):
        return b"data: " + message + b"\n\n"
    err = ApiError(502, "the instance's stream ended before it was complete",
                   code="upstream_broken")
    return b"data: " + err.encode() + b"\n\n"
