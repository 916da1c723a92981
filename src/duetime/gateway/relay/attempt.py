"""One upstream attempt: send the request, wait for the first chunk, stream it to the client or
reassemble it, and publish what was seen to the attempt's lifecycle.

The upstream request is always a stream (``stream_options.include_usage``), so the first
token's time is observed even for a non-streaming client, whose response is reassembled.
Nothing reaches the client before the first upstream chunk: until then a connect error, a
timeout, a 5xx/429 or a broken stream is an :class:`AttemptFailed` (the relay retries it on
another candidate). Streamed chunks are passed through as bytes, split only at event boundaries
(to count tokens and drop the usage chunk the client did not ask for). An attempt that does
not finish (the client went away, the stream broke) closes its connection, which aborts the
request upstream.

The attempt's events (:mod:`duetime.gateway.state.lifecycle`): its first token once the
response's start and first bytes are on their way to the client, its token count as chunks
pass, and its end — :attr:`~Outcome.OK` (answered, or a client error relayed),
:attr:`~Outcome.FAILED` (nothing reached the client: retriable), :attr:`~Outcome.BROKEN` (the
stream broke after the client got bytes: :class:`StreamBroken`, which the relay continues on
another instance, :mod:`duetime.gateway.relay.resumption`) or :attr:`~Outcome.CANCELLED` —
always, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from duetime.gateway.config import Pool
from duetime.gateway.intake.request import RequestContext
from duetime.gateway.relay.reassembly import Reassembly
from duetime.gateway.relay.resumption import Continuation
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome
from duetime.gateway.upstream import Upstream, UpstreamError, chunks, finish, read_all
from duetime.web.asgi import Send, send_json
from duetime.web.sse import (
    SSE_HEADERS,
    Kind,
    chunk_of,
    classified,
    split_events,
    tokens_so_far,
    without_usage,
)

log = logging.getLogger("duetime.gateway")


class AttemptFailed(Exception):
    """An upstream attempt failed before the response reached the client (retriable)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StreamBroken(Exception):
    """A stream broke after the client got part of it (``error``: what broke it, an upstream
    error event or the gateway's words; ``kept``: a resumable stream's token and role events
    forwarded, else None; ``told``: the upstream's error event reached the client). The
    relay continues the answer elsewhere or ends the stream with the error."""

    def __init__(self, error: bytes, kept: list[bytes] | None, told: bool) -> None:
        super().__init__(error.decode(errors="replace"))
        self.error = error
        self.kept = kept
        self.told = told


class Passthrough(Exception):
    """The upstream answered a client error (4xx): relay it (its message clipped:
    :func:`~duetime.web.errors.relayed_error`)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass(slots=True)
class _Stream:
    """What the gateway learns from an upstream stream."""

    resp: aiohttp.ClientResponse
    chunks: AsyncIterator[bytes]
    buf: bytes = b""
    tokens: int = 0
    complete: bool = False  # its ``[DONE]`` came
    usage: dict[str, Any] | None = None
    error: bytes | None = None
    broken: bool = False  # an error event ended a resumable stream
    told: bool = False  # an upstream error event was forwarded to the client
    # the chunks merged, for a non-streaming client
    answer: Reassembly = field(default_factory=Reassembly)
    # a resumable stream's forwarded token and role events (None: not resumable)
    kept: list[bytes] | None = None
    # a continuation's: its events as the first answer's (:class:`Continuation`)
    rewrite: Callable[[list[bytes]], list[bytes]] | None = None
    # the token events carry usage the gateway asked for and the client did not: cut it
    strip_usage: bool = False


class AttemptRunner:
    """Runs attempts against the upstream client (``upstream()`` gives the started one),
    publishing their events to ``lifecycle``."""

    def __init__(self, pool: Pool, upstream: Callable[[], Upstream],
                 lifecycle: Lifecycle) -> None:
        self.pool = pool
        self.lifecycle = lifecycle
        self._upstream = upstream
        self._headers: dict[str, str] = {"content-type": "application/json"}

    async def run(self, a: Attempt, ctx: RequestContext, path: str, body: bytes, send: Send,
                  extra: Sequence[tuple[bytes, bytes]] = (), *, resumable: bool = False,
                  continuation: Continuation | None = None) -> int:
        """Run attempt ``a`` to its end; returns the HTTP status answered (200). Raises
        :class:`AttemptFailed` (retriable), :class:`Passthrough` (a 4xx to relay) or
        :class:`StreamBroken` (with the events to continue it where ``resumable``).
        ``extra``: more response headers (the decision's explanation); ``continuation``: the
        attempt continues a broken answer (the response has started)."""
        st: _Stream | None = None
        outcome, failure, output_tokens = Outcome.CANCELLED, None, None
        try:
            try:
                st, events = await self._open(a, path, body)
            except Passthrough:
                outcome = Outcome.OK  # (the instance answered: a client error, relayed)
                raise
            if resumable:
                st.kept = []
            st.strip_usage = self.pool.state.continuous_usage and not ctx.req.continuous_usage
            if continuation is not None:
                st.rewrite = continuation.rewrite
            t_first = time.monotonic()
            headers = self._response_headers(a, ctx, extra)
            if ctx.req.stream:
                await self._stream(a, ctx, st, events, headers, t_first, send)
                outcome = Outcome.OK if st.complete else Outcome.BROKEN
            else:
                await self._collect(a, ctx, st, events, headers, t_first, send)
                outcome = Outcome.OK
            output_tokens = (st.usage or {}).get("completion_tokens", st.tokens)
            self.log_request(ctx, a, 200, output_tokens,
                             None if st.complete else (st.error or b"stream ended early"))
            return 200
        except AttemptFailed as e:
            outcome, failure = Outcome.FAILED, (e.kind, str(e))
            raise
        except StreamBroken as e:
            outcome, output_tokens = Outcome.BROKEN, st.tokens if st is not None else None
            self.log_request(ctx, a, 200, output_tokens, e.error)
            raise
        finally:
            if st is not None and not (outcome is Outcome.OK and st.complete):
                st.resp.close()  # an unfinished stream: closing the connection aborts it upstream
            self.lifecycle.end(a, time.monotonic(), outcome, output_tokens=output_tokens,
                               failure=failure)

    async def _open(self, a: Attempt, path: str, body: bytes) -> tuple[_Stream, list[bytes]]:
        """Send the request and wait for its first events (within ``first_token_s``)."""
        headers = {**self._headers, "x-request-id": a.flight.id}
        resp: aiohttp.ClientResponse | None = None
        opened = False
        try:
            async with asyncio.timeout(self.pool.timeouts.first_token_s):
                resp = await self._upstream().post_stream(a.inst.url + path, body, headers)
                if resp.status != 200:
                    status = resp.status
                    data = await read_all(resp)
                    if status >= 500 or status == 429:
                        raise AttemptFailed(f"status_{'5xx' if status >= 500 else '429'}",
                                            f"upstream answered {status}: {_brief(data)}")
                    raise Passthrough(status, data)
                st = _Stream(resp, chunks(resp))
                events: list[bytes] = []
                while not events:
                    try:
                        chunk = await anext(st.chunks)
                    except StopAsyncIteration:
                        raise AttemptFailed("broken", "upstream closed the stream before its "
                                            "first chunk") from None
                    events, st.buf = split_events(st.buf + chunk)
                opened = True
                return st, events
        except UpstreamError as e:
            raise AttemptFailed(e.kind, str(e)) from None
        except TimeoutError:
            raise AttemptFailed("timeout", f"no first token within "
                                f"{self.pool.timeouts.first_token_s:g} s") from None
        finally:
            if resp is not None and not opened:
                resp.close()  # (closing the connection aborts the request upstream)

    def _response_headers(self, a: Attempt, ctx: RequestContext,
                          extra: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The ``x-duetime-*`` headers of the response."""
        inst, f = a.inst, a.flight
        headers = [(b"x-duetime-model", inst.model.encode()),
                   (b"x-duetime-instance", inst.name.encode()),
                   (b"x-duetime-ttft-target-ms", f"{ctx.controls.target_s * 1000:.1f}".encode()),
                   (b"x-duetime-attempts", str(a.number).encode()),
                   (b"x-request-id", ctx.rid.encode()), *extra]
        if f.forecast is not None and math.isfinite(f.forecast):
            headers.append((b"x-duetime-forecast-ttft-ms", f"{f.forecast * 1000:.1f}".encode()))
        if inst.prefix_index is not None:
            headers.append((b"x-duetime-cached-tokens", str(f.cached_tokens).encode()))
        return headers

    async def _stream(self, a: Attempt, ctx: RequestContext, st: _Stream, events: list[bytes],
                      headers: list[tuple[bytes, bytes]], t_first: float, send: Send) -> None:
        """Stream the response to a streaming client: its start (unless it continues a broken
        answer) and first events, then the rest as it comes; :class:`StreamBroken` if the
        stream breaks (the relay continues it or ends it with an error event)."""
        out = self._scan(a, ctx, events, st, collect=False)
        if st.rewrite is None:  # (a continuation's response has started)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*SSE_HEADERS, *headers]})
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        # the first token's bookkeeping after it is on its way to the client
        self.lifecycle.record_first_token(a, t_first, st.tokens)
        async for out in self._rest(a, ctx, st, collect=False):
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        if not st.complete:
            raise StreamBroken(st.error or b"upstream stream ended without [DONE]", st.kept,
                               st.told)
        await send({"type": "http.response.body", "body": b""})
        await finish(st.resp)

    async def _collect(self, a: Attempt, ctx: RequestContext, st: _Stream,
                       events: list[bytes], headers: list[tuple[bytes, bytes]],
                       t_first: float, send: Send) -> None:
        """Reassemble the stream into one response for a non-streaming client (a stream that
        breaks before its end fails the attempt: the client has nothing yet)."""
        self.lifecycle.record_first_token(a, t_first)
        self._scan(a, ctx, events, st, collect=True)
        async for _ in self._rest(a, ctx, st, collect=True):
            pass
        if not st.complete:
            raise AttemptFailed("broken", (st.error or b"upstream stream ended early")
                                .decode(errors="replace"))
        await finish(st.resp)
        body = st.answer.body(chat=ctx.chat, model=a.inst.model,
                              tool_choice=ctx.req.body.get("tool_choice"))
        await send_json(send, 200, json.dumps(body, separators=(",", ":")).encode(), headers)

    async def _rest(self, a: Attempt, ctx: RequestContext, st: _Stream, *,
                    collect: bool) -> AsyncIterator[bytes]:
        """The rest of an upstream stream, as bytes to forward (empty when collecting)."""
        while not (st.complete or st.broken):
            try:
                chunk = await anext(st.chunks)
            except StopAsyncIteration:
                return
            except UpstreamError as e:
                st.error = f"upstream stream broke: {e}".encode()
                return
            events, st.buf = split_events(st.buf + chunk)
            if events:
                yield self._scan(a, ctx, events, st, collect=collect)

    def _scan(self, a: Attempt, ctx: RequestContext, events: list[bytes], st: _Stream, *,
              collect: bool) -> bytes:
        """Account for upstream events; return the bytes to forward to a streaming client."""
        out: list[bytes] = []
        req = ctx.req
        if st.rewrite is not None:
            events = st.rewrite(events)
        for ev, data, kind in classified(events):
            if kind == Kind.DONE:
                st.complete = True
                out.append(ev + b"\n\n")
            elif kind == Kind.USAGE:
                chunk = chunk_of(data)
                st.usage = chunk.get("usage") or st.usage
                if collect:  # (it may carry more: vLLM's system_fingerprint)
                    st.answer.add(chunk)
                if req.include_usage and req.stream:
                    out.append(ev + b"\n\n")
            elif kind == Kind.ERROR:
                st.error = data
                if st.kept is not None:  # (resumable: the relay decides what the client sees)
                    st.broken = True
                    break
                st.told = True
                out.append(ev + b"\n\n")
            else:
                if kind == Kind.TOKEN:  # (a lagging server merges tokens: count its own count)
                    so_far = tokens_so_far(data)
                    st.tokens = st.tokens + 1 if so_far is None else so_far
                if collect:
                    st.answer.add(chunk_of(data))
                else:
                    out.append((without_usage(ev) if st.strip_usage else ev) + b"\n\n")
                    if st.kept is not None:
                        st.kept.append(ev)
        self.lifecycle.record_progress(a, st.tokens)
        return b"".join(out)

    def log_request(self, ctx: RequestContext, a: Attempt, status: int,
                    output_tokens: int | None, error: bytes | None) -> None:
        """One JSON line per answered request."""
        if not log.isEnabledFor(logging.INFO if error is None else logging.WARNING):
            return
        f, inst = a.flight, a.inst
        ft = f.first_token
        log.log(logging.INFO if error is None else logging.WARNING, "request", extra={"fields": {
            "event": "request", "id": ctx.rid, "status": status, "instance": inst.name,
            "model": inst.model, "attempts": a.number, "prompt_tokens": f.prompt_tokens,
            "output_tokens": output_tokens,
            "ttft_ms": None if ft is None else round((ft - ctx.arrival) * 1000, 2),
            "forecast_ms": None if f.forecast is None or not math.isfinite(f.forecast)
            else round(f.forecast * 1000, 2),
            "target_ms": round(ctx.controls.target_s * 1000, 1),
            **({} if inst.prefix_index is None else {"cached_tokens": f.cached_tokens}),
            "e2e_ms": round((time.monotonic() - ctx.arrival) * 1000, 2),
            **({} if error is None else {"error": error.decode(errors="replace")[:300]})}})


def _brief(data: bytes, limit: int = 200) -> str:
    text = data.decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        text = json.loads(text)["error"]["message"]
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."

