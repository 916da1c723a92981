"""Server-sent events as the OpenAI streaming API uses them: ``data: {...}`` events separated by
blank lines, ending with ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

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


_SO_FAR = b'"completion_tokens":'
_USAGE = b',"usage":{'


def tokens_so_far(data: bytes) -> int | None:
    """The output tokens a token chunk says were made so far (its ``usage.completion_tokens``,
    which vLLM puts in every chunk with ``stream_options.continuous_usage_stats``), or None
    where it says nothing. Why: an API server that falls behind merges the tokens its stream
    has not taken yet into one chunk (vLLM's per-request output collector), so one chunk is
    not always one token. A byte search, not a JSON parse: it runs for every chunk relayed."""
    k = data.find(_SO_FAR)
    if k < 0:
        return None
    k += len(_SO_FAR)
    end = k
    n = len(data)
    while end < n and data[end] == 0x20:  # (a space after the colon: other servers' JSON)
        end += 1
        k += 1
    while end < n and 0x30 <= data[end] <= 0x39:
        end += 1
    return int(data[k:end]) if end > k else None


def without_usage(ev: bytes) -> bytes:
    """A token event without the ``"usage"`` object vLLM's continuous usage stats add to it
    (for a client that did not ask for them: the gateway asks on its own behalf); the event
    as it is where it has none or it cannot be cut cleanly."""
    k = ev.find(_USAGE)
    if k < 0:
        return ev
    depth, j, n = 0, k + len(_USAGE) - 1, len(ev)
    while j < n:
        c = ev[j]
        if c == 0x7B:  # {
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return ev[:k] + ev[j + 1:]
        elif c == 0x22:  # (no strings in a usage object but its keys: skip them whole)
            j = ev.find(b'"', j + 1)
            if j < 0:
                return ev
        j += 1
    return ev


class Kind:
    """What a streamed completion's event is, for whoever counts its tokens
    (:func:`event_kind`)."""

    DONE = "done"    # ``[DONE]``: the stream is complete
    USAGE = "usage"  # a chunk with no choices (the usage chunk; vLLM may add its fingerprint)
    ERROR = "error"  # an error object in place of a chunk
    ROLE = "role"    # the first chunk of a chat: the role and empty content, no token
    TOKEN = "token"  # a chunk that carries output: one token (as vLLM streams them)


def event_kind(data: bytes) -> str:
    """The :class:`Kind` of an event's data (its ``payload``): the gateway's relay and the
    endpoint picker count a completion's output tokens by it, one per ``TOKEN`` event."""
    if data == b"[DONE]":
        return Kind.DONE
    if b'"choices":[]' in data or b'"choices": []' in data:
        return Kind.USAGE
    if data.startswith(b'{"error"') or data.startswith(b'{"object":"error"'):
        return Kind.ERROR
    if b'"role"' in data and b'"content":""' in data:
        return Kind.ROLE
    return Kind.TOKEN


def classified(events: list[bytes]) -> Iterator[tuple[bytes, bytes, str]]:
    """Each event that carries data, with its data and :func:`event_kind`."""
    for ev in events:
        data = payload(ev)
        if data is not None:
            yield ev, data, event_kind(data)


def chunk_of(data: bytes) -> dict[str, Any]:
    """An event's data as its JSON object; an undecodable one (or not an object) is empty:
    whoever counted its tokens by :func:`event_kind` already has."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return {}
    return chunk if isinstance(chunk, dict) else {}


def error_event(message: bytes) -> bytes:
    """A final ``data: {"error": ...}`` event: an upstream's JSON error as it is, or, for the
    gateway's own description of what broke (which may carry a library's error text, for the
    log only), a 502 ``upstream_broken`` error that names nothing of it."""
    if message.startswith(b"{"):
        return b"data: " + message + b"\n\n"
    err = ApiError(502, "the instance's stream ended before it was complete",
                   code="upstream_broken")
    return b"data: " + err.encode() + b"\n\n"
