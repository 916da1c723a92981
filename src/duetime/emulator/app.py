"""The emulator's HTTP face: vLLM's OpenAI-compatible API over an :class:`Emulator`.

| endpoint | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | SSE streaming (``data: {...}`` chunks, ``data: [DONE]``; behind an emulated API server, the tokens that reach a stream together share one chunk, as vLLM merges them; ``stream_options.continuous_usage_stats`` puts the tokens so far in every chunk) or one JSON body; ``max_tokens`` caps the output |
| ``GET /v1/models`` | the served model, then each LoRA adapter (``root``: its path, ``parent``: its base model) |
| ``POST /tokenize`` | ``{"count", "max_model_len", "tokens"}`` from the documented estimate (tokens are placeholders: one id per 4 characters, the same for the same characters) |
| ``GET /health`` | 200, or 503 when marked unhealthy |
| ``GET /metrics`` | Prometheus text with vLLM's metric names |
| ``GET /snapshot`` | the engine's snapshot JSON (``docs/engine.md``, "Snapshots"; ``?version=2``: with the prefix cache while prefix caching is on; version 3 with LoRA); header ``x-duetime-clock`` = the emulator's clock when it was taken |
| ``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter`` | vLLM's runtime LoRA updates, only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (or ``allow_runtime_lora_updating``) |
| ``GET/POST /emulator/faults`` | read / set failure injection ``{"rate", "kinds", "healthy"}`` (tests) |
| ``GET/POST /emulator/speed`` | read / set the speed ``{"speed": X}`` from the next step on (a drifting server, tests) |

The control routes (``/emulator/*``) need ``Authorization: Bearer TOKEN`` when the app is made
with an ``admin_token`` (``duetime serve`` gives each embedded emulator one; ``duetime emulate
--admin-token``), and answer 403 to everyone when made with ``control_open=False`` and no token.

Request ids: a request's ``x-request-id`` header (if unused) names it in the engine and the
snapshot; the response echoes the id. A request header ``x-emulator-fault: 5xx|timeout|disconnect|break``
forces that failure for one request (tests).

Prefix caching (on unless turned off): each request's prompt is keyed block by block
(:mod:`duetime.web.prefix_keys`: token ids exactly, text 64 characters per 16-token block),
so identical prefixes share cached blocks as in vLLM.

LoRA (the emulator made with ``max_loras``): a request whose ``model`` names a loaded adapter
runs on it (answers name it as their model, as vLLM's do); any other name but the served
model's is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from duetime.emulator.core import (
    BREAK_AFTER,
    FAULT_KINDS,
    AdapterError,
    Emulator,
    EmuRequest,
    Faults,
)
from duetime.web.access import bearer, same_secret
from duetime.web.asgi import (
    CompletionEndpoint,
    Disconnect,
    FastRoutes,
    Scope,
    Send,
    header,
    send_error,
    send_json,
)
from duetime.web.errors import ApiError, exception_handlers
from duetime.web.prefix_keys import chat_text, prompt_block_keys
from duetime.web.requests import CompletionRequest, parse_completion, parse_json, parse_tokenize
from duetime.web.sse import DONE, SSE_HEADERS
from duetime.web.tokens import CHARS_PER_TOKEN

TOKEN_TEXT = "tok "
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch of the two LoRA routes
PLACEHOLDER_VOCAB = 151_643  # /tokenize's placeholder ids are below this (Qwen3's vocabulary)


class InjectedDisconnect(Exception):
    """Raised after a response started to make the server drop the connection."""


class _QuietInjected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], InjectedDisconnect))


logging.getLogger("uvicorn.error").addFilter(_QuietInjected())


def placeholder_ids(body: dict[str, Any], count: int) -> list[int]:
    """``/tokenize``'s tokens: a prompt's own ids, else one id per 4 characters of its text
    (chat: :func:`~duetime.web.prefix_keys.chat_text`), a hash of them, so that the same
    text gives the same ids and different text mostly different ones (a client that builds
    prompts from them, as ``duetime calibrate`` does, gets distinct prompts that do not hit
    the prefix cache); cut or padded to ``count``."""
    if "messages" in body:
        text = chat_text(body["messages"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list):
            return list(prompt)[:count]
        text = prompt if isinstance(prompt, str) else ""
    ids = [int.from_bytes(hashlib.blake2b(text[i:i + CHARS_PER_TOKEN].encode(),
                                          digest_size=4).digest(), "little") % PLACEHOLDER_VOCAB
           for i in range(0, len(text), CHARS_PER_TOKEN)][:count]
    return ids + [0] * (count - len(ids))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


class _Chunks:
    """Pre-encoded SSE chunks of one streamed response (no JSON encoding per token)."""

    def __init__(self, chat: bool, rid: str, model: str, created: int) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = (f'{{"id":{json.dumps(rid)},"object":"{obj}","created":{created},'
                     f'"model":{json.dumps(model)},"choices":')
        if chat:
            tok = json.dumps({"content": TOKEN_TEXT}, separators=(",", ":"))
            self.token = (f'data: {self.head}[{{"index":0,"delta":{tok},"logprobs":null,'
                          f'"finish_reason":null}}]}}\n\n').encode()
            self.role = (f'data: {self.head}[{{"index":0,"delta":{{"role":"assistant",'
                         f'"content":""}},"logprobs":null,"finish_reason":null}}]}}\n\n').encode()
        else:
            self.token = (f'data: {self.head}[{{"index":0,"text":{json.dumps(TOKEN_TEXT)},'
                          f'"logprobs":null,"finish_reason":null,"stop_reason":null}}]}}\n\n'
                          ).encode()
            self.role = b""

    def last(self, reason: str) -> bytes:
        return self.token.replace(b'"finish_reason":null', f'"finish_reason":"{reason}"'.encode(),
                                  1)

    def tokens(self, first: int, n: int, *, merge: bool, usage: int | None,
               reason: str | None) -> list[bytes]:
        """The chunks of tokens ``first + 1 .. n`` (``reason``: the last ends the answer): one
        per token, or, ``merge``, one for them all with their text joined (vLLM's output
        collector merges what a lagging stream has not taken); with ``usage`` (the prompt's
        tokens) each chunk says the tokens so far, as vLLM's ``continuous_usage_stats``."""
        if n <= first:
            return []
        if not merge and usage is None:
            parts = [self.token] * (n - first)
            if reason is not None:
                parts[-1] = self.last(reason)
            return parts
        counts = [n] if merge else range(first + 1, n + 1)
        out, done = [], first
        for k in counts:
            chunk = self.token
            if k - done > 1:
                text = TOKEN_TEXT * (k - done)
                key = (b'"content":' if self.chat else b'"text":')
                chunk = chunk.replace(key + json.dumps(TOKEN_TEXT).encode(),
                                      key + json.dumps(text).encode(), 1)
            if reason is not None and k == n:
                chunk = chunk.replace(b'"finish_reason":null',
                                      f'"finish_reason":"{reason}"'.encode(), 1)
            if usage is not None:
                u = json.dumps(_usage(usage, k), separators=(",", ":")).encode()
                chunk = chunk[:-len(b"}\n\n")] + b',"usage":' + u + b"}\n\n"
            out.append(chunk)
            done = k
        return out

    def usage(self, prompt: int, completion: int) -> bytes:
        u = json.dumps(_usage(prompt, completion), separators=(",", ":"))
        return f'data: {self.head}[],"usage":{u}}}\n\n'.encode()


class Completions:
    """``/v1/completions`` or ``/v1/chat/completions``, the handler of a raw-ASGI
    :class:`~duetime.web.asgi.CompletionEndpoint` (cancelled when the client disconnects,
    and then the request is aborted in the engine)."""

    def __init__(self, emu: Emulator, *, chat: bool) -> None:
        self.emu = emu
        self.chat = chat

    async def __call__(self, scope: Scope, raw: bytes, guard: Disconnect, t0: float) -> None:
        send = guard.send
        emu = self.emu
        try:
            req = parse_completion(raw, chat=self.chat)
            if not emu.faults.healthy:
                raise ApiError(503, "the engine is unhealthy (emulated)")
            served, adapter = emu.resolve(req.model)
            if not served:
                raise ApiError(404, f"The model `{req.model}` does not exist.", param="model",
                               code="model_not_found")
            why = emu.check(req.prompt_tokens, req.max_tokens)
            if why is not None:
                raise ApiError(400, why, param="messages" if self.chat else "prompt",
                               code="context_length_exceeded")
            forced = header(scope, b"x-emulator-fault")
            if forced is not None and forced not in FAULT_KINDS:
                raise ApiError(400, f"x-emulator-fault must be one of {', '.join(FAULT_KINDS)}")
        except ApiError as e:
            await send_error(send, e)
            return
        fault = forced or emu.draw_fault()
        if fault == "5xx":
            await send_error(send, ApiError(500, "injected failure (emulator)"))
            return
        if fault == "timeout":
            await asyncio.sleep(3600.0)  # until the client gives up (cancelled on disconnect)
            return
        if fault == "disconnect":
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            raise InjectedDisconnect("injected disconnect (emulator)")
        hashes = prompt_block_keys(req, emu.config.block_size) if emu.caching else ()
        r = emu.submit(req.prompt_tokens, max_tokens=req.max_tokens, ignore_eos=req.ignore_eos,
                       request_id=header(scope, b"x-request-id"), hashes=hashes,
                       adapter=adapter)
        try:
            if req.stream:
                await self._stream(r, req, send, broken=fault == "break")
            else:
                await self._whole(r, req, send)
        finally:
            if not r.done:
                emu.cancel(r)

    def _ids(self, r: EmuRequest) -> tuple[str, int]:
        return (f"chatcmpl-{r.id}" if self.chat else f"cmpl-{r.id}"), int(time.time())

    def _model(self, r: EmuRequest) -> str:
        """The answer's ``model``: the adapter's name for a request on one, as vLLM's."""
        return r.lora or self.emu.model_name

    async def _stream(self, r: EmuRequest, req: CompletionRequest, send: Send, *,
                      broken: bool = False) -> None:
        """Stream ``r`` as it is produced (``broken``: drop the connection after
        ``BREAK_AFTER`` tokens, or before ``[DONE]``)."""
        cid, created = self._ids(r)
        chunks = _Chunks(self.chat, cid, self._model(r), created)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, (b"x-request-id", r.id.encode())]})
        sent = 0
        # behind an emulated API server, the tokens that reach the stream together go out in
        # one chunk, as vLLM's do (without one the emulator's server never falls behind)
        merge = self.emu.frontend is not None
        while True:
            await r.event.wait()
            r.event.clear()
            if r.aborted:  # the server is shutting down
                await send({"type": "http.response.body", "body": b""})
                return
            n = r.produced
            if broken and (r.done or n >= BREAK_AFTER):
                ends = r.done and n <= BREAK_AFTER  # (all of it but its usage and [DONE])
                n = n if ends else BREAK_AFTER
                parts = [chunks.role] if sent == 0 and chunks.role else []
                parts += [chunks.token] * (n - sent - ends)
                if ends:
                    parts.append(chunks.last(r.finish_reason))
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"".join(parts)})
                raise InjectedDisconnect("injected break mid-stream (emulator)")
            if n > sent:
                parts = []
                if sent == 0 and chunks.role:
                    parts.append(chunks.role)
                parts += chunks.tokens(sent, n, merge=merge,
                                       usage=r.prompt_tokens if req.continuous_usage else None,
                                       reason=r.finish_reason if r.done else None)
                sent = n
                if r.done:
                    if req.include_usage:
                        parts.append(chunks.usage(r.prompt_tokens, n))
                    parts.append(DONE)
                    await send({"type": "http.response.body", "body": b"".join(parts)})
                    return
                await send({"type": "http.response.body", "body": b"".join(parts),
                            "more_body": True})

    async def _whole(self, r: EmuRequest, req: CompletionRequest, send: Send) -> None:
        while not r.done:
            await r.event.wait()
            r.event.clear()
        if r.aborted:
            await send_error(send, ApiError(503, "the server is shutting down"))
            return
        cid, created = self._ids(r)
        text = TOKEN_TEXT * r.produced
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": r.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": r.finish_reason, "stop_reason": None}
            obj = "text_completion"
        body = {"id": cid, "object": obj, "created": created, "model": self._model(r),
                "choices": [choice], "usage": _usage(r.prompt_tokens, r.produced)}
        await send_json(send, 200, json.dumps(body, separators=(",", ":")).encode(),
                        [(b"x-request-id", r.id.encode())])


def _error(e: ApiError) -> Response:
    return Response(e.encode(), status_code=e.status, media_type="application/json")


def _lora_error(e: AdapterError) -> Response:
    """vLLM's error body for a refused LoRA load or unload (its ``code`` is the status)."""
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": None,
                                   "code": e.status}}, status_code=e.status)


def runtime_lora_allowed() -> bool:
    """vLLM's reading of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: "1" or "true"."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


async def _lora_body(request: Request, fields: dict[str, type]) -> dict[str, Any]:
    """A LoRA route's JSON body with ``fields`` of those types (a wrong one: vLLM's 400)."""
    try:
        d = parse_json(await request.body())
    except ApiError as e:
        raise AdapterError(400, "BadRequestError", e.message) from None
    if not isinstance(d, dict):
        raise AdapterError(400, "BadRequestError", "body must be a JSON object")
    for name, kind in fields.items():
        if name in d and d[name] is not None and not isinstance(d[name], kind):
            raise AdapterError(400, "BadRequestError",
                               f"{name}: must be of type {kind.__name__}")
    return d


def _lora_routes(emu: Emulator) -> list[Route]:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: plain-text success,
    an error body otherwise."""
    async def load(request: Request) -> Response:
        try:
            d = await _lora_body(request, {"lora_name": str, "lora_path": str,
                                           "load_inplace": bool})
            a = emu.load_adapter(d.get("lora_name") or "", d.get("lora_path") or "",
                                 inplace=bool(d.get("load_inplace")))
        except AdapterError as e:
            return _lora_error(e)
        return PlainTextResponse(f"Success: LoRA adapter '{a.name}' added successfully.")

    async def unload(request: Request) -> Response:
        try:
            d = await _lora_body(request, {"lora_name": str, "lora_int_id": int})
            a = emu.unload_adapter(d.get("lora_name") or "")
        except AdapterError as e:
            return _lora_error(e)
        return PlainTextResponse(f"Success: LoRA adapter '{a.name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]


def _model_cards(emu: Emulator) -> list[dict[str, Any]]:
    """``/v1/models``' entries: the served model, then each adapter as vLLM lists it (its
    path as ``root``, its base model as ``parent``)."""
    created = int(time.time())
    cards = [{"id": emu.model_name, "object": "model", "created": created,
              "owned_by": "duetime-emulator", "root": emu.model_name, "parent": None,
              "max_model_len": emu.config.max_model_len}]
    for a in emu.adapters or ():
        cards.append({"id": a.name, "object": "model", "created": created,
                      "owned_by": "duetime-emulator", "root": a.path,
                      "parent": a.base_model_name or emu.model_name, "max_model_len": None})
    return cards


def _control_guard(admin_token: str | None, control_open: bool) -> Any:
    """The check of the control routes: None when they are open, else a function that returns
    the error response for a request without the token (None for one with it)."""
    if admin_token is None and control_open:
        return None

    def refuse(request: Request) -> Response | None:
        if admin_token is None:
            return _error(ApiError(403, "the emulator's control routes are closed (it listens "
                                   "beyond loopback; start it with --admin-token)",
                                   code="control_closed"))
        if same_secret(bearer(request.headers.get("authorization")), admin_token):
            return None
        return _error(ApiError(401, "the emulator's control routes need its admin token: "
                               "Authorization: Bearer TOKEN", code="invalid_api_key",
                               type_="invalid_request_error"))
    return refuse


def create_app(emu: Emulator, *, admin_token: str | None = None,
               control_open: bool = True,
               allow_runtime_lora_updating: bool | None = None) -> FastRoutes:
    """The emulator's ASGI app (the engine's driver starts with the first request).
    ``admin_token``: the bearer token its control routes (``/emulator/*``) need;
    ``control_open=False`` without a token closes them. ``allow_runtime_lora_updating``
    (None: ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM reads it at start): serve the LoRA
    load and unload routes (absent otherwise, as in vLLM)."""
    guard = _control_guard(admin_token, control_open)
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_allowed()

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": _model_cards(emu)})

    async def tokenize(request: Request) -> Response:
        raw = await request.body()
        try:
            count = parse_tokenize(raw)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"count": count, "max_model_len": emu.config.max_model_len,
                             "tokens": placeholder_ids(json.loads(raw), count),
                             "token_strs": None})

    async def health(request: Request) -> Response:
        return Response(status_code=200 if emu.faults.healthy else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(emu.registry), media_type=CONTENT_TYPE_LATEST)

    async def snapshot(request: Request) -> Response:
        clock = time.monotonic()
        # version 1 unless asked: with prefix caching, version 2 lists the whole cache (most
        # of a megabyte, tens of ms to parse at every 50 ms poll; docs/gateway.md)
        # (with LoRA, either form is of version 3; ?version=3 asks for the full one too)
        full = request.query_params.get("version") in ("2", "3")
        body = json.dumps(emu.snapshot_dict(full=full), separators=(",", ":"))
        return Response(body, media_type="application/json",
                        headers={"x-duetime-clock": repr(clock)})

    async def faults(request: Request) -> Response:
        if guard is not None and (refused := guard(request)) is not None:
            return refused
        if request.method == "POST":
            try:
                d = parse_json(await request.body())
                if not isinstance(d, dict):
                    raise ApiError(400, "body must be a JSON object")
                f = emu.faults
                kinds = d.get("kinds", list(f.kinds))
                if isinstance(kinds, str):
                    kinds = kinds.split(",")
                emu.faults = Faults(float(d.get("rate", f.rate)), tuple(kinds),
                                    bool(d.get("healthy", f.healthy)))
            except (TypeError, ValueError) as e:
                return _error(ApiError(400, str(e)))
            except ApiError as e:
                return _error(e)
        f = emu.faults
        return JSONResponse({"rate": f.rate, "kinds": list(f.kinds), "healthy": f.healthy})

    async def speed(request: Request) -> Response:
        if guard is not None and (refused := guard(request)) is not None:
            return refused
        if request.method == "POST":
            try:
                d = parse_json(await request.body())
                if not isinstance(d, dict) or "speed" not in d:
                    raise ApiError(400, 'body must be a JSON object {"speed": X}')
                emu.set_speed(float(d["speed"]))
            except (TypeError, ValueError) as e:
                return _error(ApiError(400, str(e)))
            except ApiError as e:
                return _error(e)
        return JSONResponse({"speed": emu.speed})

    async def version(request: Request) -> Response:
        import duetime
        return JSONResponse({"version": f"duetime-emulator {duetime.__version__}"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await emu.close()

    chat = CompletionEndpoint(Completions(emu, chat=True))
    completions = CompletionEndpoint(Completions(emu, chat=False))
    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/snapshot", snapshot, methods=["GET"]),
        Route("/emulator/faults", faults, methods=["GET", "POST"]),
        Route("/emulator/speed", speed, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
    ]
    if allow_runtime_lora_updating:
        routes += _lora_routes(emu)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers())
    app.state.emulator = emu
    return FastRoutes(app, {"/v1/chat/completions": chat, "/v1/completions": completions})
