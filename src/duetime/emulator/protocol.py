"""The OpenAI HTTP protocol as the emulator and the gateway speak it.

Request parsing and validation (one error type, rendered as OpenAI's error body), the prompt
token estimate both use, and small raw-ASGI helpers: reading a body, sending JSON, and running a
handler that is cancelled when its client disconnects.

Token estimate. Neither the emulator nor the gateway loads a tokenizer: a prompt's length in
tokens is estimated as ``ceil(characters / 4)`` (at least 1) for text, the list's length for
token ids, and for chat ``3 + Σ (4 + tokens(content))`` over the messages (role and template
overhead, as OpenAI's cookbook counts it). It is cheap (no round trip, no model files) and the
two sides agree, so the gateway's shadow state sees the same prompt lengths as the emulator.
Against a real vLLM the estimate is off by the tokenizer's ratio (English prose is ~4
characters per token for Qwen3); the gateway documents this trade-off in docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CHARS_PER_TOKEN = 4


# -- errors -------------------------------------------------------------------------------------

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 500: "server_error",
          502: "upstream_error", 503: "service_unavailable", 504: "upstream_timeout"}


class ApiError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def encode(self) -> bytes:
        return json.dumps(self.body()).encode()


def error_body(status: int, message: str, **kw: Any) -> bytes:
    return ApiError(status, message, **kw).encode()


# -- token estimate -----------------------------------------------------------------------------

def text_tokens(text: str) -> int:
    """Estimated tokens of a text: ceil(characters / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def content_text(content: Any) -> str:
    """A chat message's text: the string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # a list of parts: [{"type": "text", "text": ...}, {"type": "image_url", ...}]
    return "".join(p.get("text", "") for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))


def chat_tokens(messages: list[dict[str, Any]]) -> int:
    """Estimated prompt tokens of chat messages: 3 + Σ (4 + tokens(content))."""
    total = 3
    for m in messages:
        text = content_text(m.get("content"))
        total += 4 + (math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0)
    return total


# -- requests -----------------------------------------------------------------------------------

@dataclass(slots=True)
class CompletionRequest:
    """What the emulator and the gateway need from a (chat) completion request."""

    chat: bool
    model: str | None
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    ignore_eos: bool = False
    body: dict[str, Any] = field(default_factory=dict)


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def _opt_int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ApiError(400, f"{key} must be an integer >= {lo}, got {v!r}", param=key,
                       code="invalid_value")
    return v


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {v!r}", param=key,
                       code="invalid_type")
    return v


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return _prompt_tokens(prompt[0])
        raise ApiError(400, "only one prompt per request is supported (a string or a list of "
                       "token ids)", param="prompt", code="invalid_value")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids",
                   param="prompt", code="invalid_value")


def parse_completion(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", param="model",
                       code="invalid_type")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages is required", param="messages",
                           code="missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages",
                           code="invalid_value")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string role",
                               param=f"messages[{i}]", code="invalid_value")
            c = m.get("content")
            if c is not None and not isinstance(c, str | list):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of "
                               "parts", param=f"messages[{i}].content", code="invalid_type")
        prompt_tokens = chat_tokens(messages)
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt",
                           code="missing_required_parameter")
        prompt_tokens = _prompt_tokens(body["prompt"])
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "only n = 1 is supported", param="n", code="invalid_value")
    max_tokens = _opt_int(body, "max_tokens", 1)
    if chat:
        mct = _opt_int(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else max_tokens
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options",
                           code="invalid_type")
        include_usage = _opt_bool(opts, "include_usage")
    return CompletionRequest(chat, model, prompt_tokens, stream, include_usage, max_tokens,
                             _opt_bool(body, "ignore_eos"), body)


def parse_tokenize(raw: bytes) -> int:
    """Prompt tokens of a vLLM ``/tokenize`` body (``prompt`` or chat ``messages``)."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_type")
    if "messages" in body:
        return parse_completion(raw, chat=True).prompt_tokens
    if "prompt" in body:
        return _prompt_tokens(body["prompt"])
    raise ApiError(400, "prompt or messages is required", param="prompt",
                   code="missing_required_parameter")


# -- raw ASGI helpers ---------------------------------------------------------------------------

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
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, err: ApiError,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, err.status, err.encode(), headers)


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (``name`` in lower case), or None."""
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


class Disconnect:
    """Runs an ASGI handler in the current task and cancels it if the client disconnects.

    ``send`` (the wrapper) records when the response is complete, so that the
    ``http.disconnect`` a server reports after a finished response is not mistaken for the
    client going away. ``gone`` says whether the handler was cancelled for that reason.
    """

    __slots__ = ("_send", "complete", "gone", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.complete = False
        self.started = False
        self.gone = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

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
                raise
            task.uncancel()
        finally:
            self.complete = True
            watcher.cancel()
