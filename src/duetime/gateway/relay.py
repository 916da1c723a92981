"""One upstream attempt: send the request, wait for the first chunk, stream it to the client or
reassemble it, and record what was seen.

The upstream request is always a stream (``stream_options.include_usage``), so the first
token's time is observed even for a non-streaming client, whose response is reassembled.
Nothing reaches the client before the first upstream chunk: until then a connect error, a
timeout, a 5xx/429 or a broken stream is an :class:`AttemptFailed` (the router retries it on
another candidate). Streamed chunks are passed through as bytes, split only at event boundaries
(to count tokens and drop the usage chunk the client did not ask for). An attempt that does
not finish (the client went away, the stream broke) closes its connection, which aborts the
request upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from duetime.gateway.config import Pool
from duetime.gateway.inflight import Flight
from duetime.gateway.instance import InstanceState
from duetime.gateway.metrics import GatewayMetrics
from duetime.gateway.observatory import Observatory
from duetime.gateway.reassembly import Reassembly
from duetime.gateway.upstream import Upstream, UpstreamError, chunks, finish, read_all
from duetime.web.asgi import Send, send_json
from duetime.web.requests import CompletionRequest
from duetime.web.sse import SSE_HEADERS, error_event, payload, split_events

log = logging.getLogger("duetime.gateway")


class AttemptFailed(Exception):
    """An upstream attempt failed before the response reached the client (retriable)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Passthrough(Exception):
    """The upstream answered a client error (4xx): relay it (its message clipped:
    :func:`~duetime.web.errors.relayed_error`)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass(slots=True)
class Controls:
    """The client's per-request controls (headers): TTFT target, models already attempted,
    session, task; its priority, time-per-output-token target and who it is (for fairness
    among queued requests)."""

    target_s: float
    attempted: frozenset[str]
    session: str | None
    task: str
    priority: str = "standard"
    tpot_target_s: float | None = None
    client: str = ""
    explain: bool = False  # x-duetime-explain: the decision's explanation in a header
    policy: str | None = None  # x-duetime-policy: another registered policy for this one
    lam: float | None = None  # x-duetime-lambda: its lambda


@dataclass(slots=True)
class _Stream:
    """What the gateway learns from an upstream stream."""

    tokens: int = 0
    done: bool = False
    usage: dict[str, Any] | None = None
    error: bytes | None = None
    # the chunks merged, for a non-streaming client
    answer: Reassembly = field(default_factory=Reassembly)


class Relay:
    """Runs attempts against the upstream client (``upstream()`` gives the started one)."""

    def __init__(self, pool: Pool, metrics: GatewayMetrics, upstream,
                 observatory: Observatory | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.observatory = observatory
        self._upstream = upstream
        self._headers: dict[str, str] = {"content-type": "application/json"}

    async def attempt(self, inst: InstanceState, flight: Flight, path: str, payload: bytes,
                      req: CompletionRequest, ctl: Controls, chat: bool, send: Send,
                      t0: float, rid: str, attempt: int,
                      extra: Sequence[tuple[bytes, bytes]] = ()) -> int:
        """Run one attempt to its end; returns the HTTP status answered (200). Raises
        :class:`AttemptFailed` (retriable) or :class:`Passthrough` (a 4xx to relay).
        ``extra``: more response headers (the decision's explanation)."""
        upstream: Upstream = self._upstream()
        st = _Stream()
        resp: aiohttp.ClientResponse | None = None
        output_tokens: int | None = None
        finished = False
        try:
            headers = {**self._headers, "x-request-id": flight.id}
            try:
                async with asyncio.timeout(self.pool.timeouts.first_token_s):
                    resp = await upstream.post_stream(inst.url + path, payload, headers)
                    if resp.status != 200:
                        status = resp.status
                        data = await read_all(resp)
                        if status >= 500 or status == 429:
                            raise AttemptFailed(f"status_{'5xx' if status >= 500 else '429'}",
                                                f"upstream answered {status}: {_brief(data)}")
                        raise Passthrough(status, data)
                    stream = chunks(resp)
                    buf = b""
                    events: list[bytes] = []
                    while not events:
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            raise AttemptFailed("broken", "upstream closed the stream before "
                                                "its first chunk") from None
                        buf += chunk
                        events, buf = split_events(buf)
            except UpstreamError as e:
                raise AttemptFailed(e.kind, str(e)) from None
            except TimeoutError:
                raise AttemptFailed("timeout", f"no first token within "
                                    f"{self.pool.timeouts.first_token_s:g} s") from None
            t_first = time.monotonic()
            headers = [(b"x-duetime-model", inst.model.encode()),
                       (b"x-duetime-instance", inst.name.encode()),
                       (b"x-duetime-ttft-target-ms", f"{ctl.target_s * 1000:.1f}".encode()),
                       (b"x-duetime-attempts", str(attempt).encode()),
                       (b"x-request-id", rid.encode()), *extra]
            if flight.forecast is not None and math.isfinite(flight.forecast):
                headers.append((b"x-duetime-forecast-ttft-ms",
                                f"{flight.forecast * 1000:.1f}".encode()))
            if inst.prefix_index is not None:
                headers.append((b"x-duetime-cached-tokens", str(flight.cached_tokens).encode()))
            if req.stream:
                out = self._scan(events, st, req, collect=False, inst=inst, flight=flight)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*SSE_HEADERS, *headers]})
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                # the bookkeeping of the first token after it is on its way to the client
                self.first_token(inst, flight, t_first, t0, ctl)
                async for out in self._relay(stream, buf, st, req, inst, flight, collect=False):
                    if out:
                        await send({"type": "http.response.body", "body": out,
                                    "more_body": True})
                tail = b"" if st.done else error_event(
                    st.error or b"upstream stream ended without [DONE]")
                await send({"type": "http.response.body", "body": tail})
                if st.done:
                    await finish(resp)
                    finished = True
            else:
                self.first_token(inst, flight, t_first, t0, ctl)
                self._scan(events, st, req, collect=True, inst=inst, flight=flight)
                async for _ in self._relay(stream, buf, st, req, inst, flight, collect=True):
                    pass
                if not st.done:
                    raise AttemptFailed("broken", (st.error or b"upstream stream ended early")
                                        .decode(errors="replace"))
                await finish(resp)
                finished = True
                body = _reassemble(st, req, chat, inst.model)
                await send_json(send, 200, body, headers)
            output_tokens = (st.usage or {}).get("completion_tokens", st.tokens)
            self.log_request(rid, inst, flight, t0, 200, attempt, output_tokens, ctl,
                             None if st.done else (st.error or b"stream ended early"))
            return 200
        finally:
            if resp is not None and not finished:
                resp.close()  # an unfinished stream: closing the connection aborts it upstream
            inst.complete(flight, time.monotonic(), output_tokens=output_tokens)

    async def _relay(self, chunks: AsyncIterator[bytes], buf: bytes, st: _Stream,
                     req: CompletionRequest, inst: InstanceState, flight: Flight, *,
                     collect: bool) -> AsyncIterator[bytes]:
        """The rest of an upstream stream, as bytes to forward (empty when collecting)."""
        while not st.done:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except UpstreamError as e:
                st.error = f"upstream stream broke: {e}".encode()
                return
            buf += chunk
            events, buf = split_events(buf)
            if events:
                yield self._scan(events, st, req, collect=collect, inst=inst, flight=flight)

    def _scan(self, events: list[bytes], st: _Stream, req: CompletionRequest, *, collect: bool,
              inst: InstanceState, flight: Flight) -> bytes:
        """Account for upstream events; return the bytes to forward to a streaming client."""
        out: list[bytes] = []
        for ev in events:
            data = payload(ev)
            if data is None:
                continue
            if data == b"[DONE]":
                st.done = True
                out.append(ev + b"\n\n")
                continue
            if b'"choices":[]' in data or b'"choices": []' in data:
                chunk = _decode(data)
                st.usage = chunk.get("usage") or st.usage
                if collect:  # (it may carry more: vLLM's system_fingerprint)
                    st.answer.add(chunk)
                if req.include_usage and req.stream:
                    out.append(ev + b"\n\n")
                continue
            if data.startswith(b'{"error"') or data.startswith(b'{"object":"error"'):
                st.error = data
                out.append(ev + b"\n\n")
                continue
            if not (b'"role"' in data and b'"content":""' in data):
                st.tokens += 1
            if collect:
                st.answer.add(_decode(data))
            else:
                out.append(ev + b"\n\n")
        inst.progress(flight, st.tokens)
        return b"".join(out)

    def first_token(self, inst: InstanceState, flight: Flight, t_first: float, t0: float,
               ctl: Controls) -> None:
        """An attempt got its first token: the instance is healthy, the shadow replica learns
        when the request's prefill ended, and the metrics record TTFT and the forecast error."""
        inst.health.report_success()
        inst.first_token(flight, t_first)
        m = self.metrics
        ttft = t_first - t0
        m.ttft.labels(inst.name).observe(ttft)
        m.target.labels(inst.name, "on_time" if ttft <= ctl.target_s else "late").inc()
        forecast = (flight.forecast if flight.forecast is not None
                    and math.isfinite(flight.forecast) else None)
        if self.observatory is not None:
            self.observatory.first_token(flight.id, inst.name, ttft, ctl.target_s, forecast,
                                         t_first - flight.dispatched, t_first)
        if flight.forecast is not None and math.isfinite(flight.forecast):
            observed = t_first - flight.dispatched
            m.forecast_error.labels(inst.name).observe(observed - flight.forecast)
            m.forecast_error_sum.labels(inst.name).inc(observed - flight.forecast)
            if flight.forecast > 0:
                m.forecast_ratio.labels(inst.name).observe(observed / flight.forecast)

    def log_request(self, rid: str, inst: InstanceState, flight: Flight, t0: float, status: int,
                    attempt: int, output_tokens: int | None, ctl: Controls,
                    error: bytes | None) -> None:
        if not log.isEnabledFor(logging.INFO if error is None else logging.WARNING):
            return
        ft = flight.first_token
        log.log(logging.INFO if error is None else logging.WARNING, "request", extra={"fields": {
            "event": "request", "id": rid, "status": status, "instance": inst.name,
            "model": inst.model, "attempts": attempt, "prompt_tokens": flight.prompt_tokens,
            "output_tokens": output_tokens,
            "ttft_ms": None if ft is None else round((ft - t0) * 1000, 2),
            "forecast_ms": None if flight.forecast is None or not math.isfinite(flight.forecast)
            else round(flight.forecast * 1000, 2),
            "target_ms": round(ctl.target_s * 1000, 1),
            **({} if inst.prefix_index is None else {"cached_tokens": flight.cached_tokens}),
            "e2e_ms": round((time.monotonic() - t0) * 1000, 2),
            **({} if error is None else {"error": error.decode(errors="replace")[:300]})}})


def _brief(data: bytes, limit: int = 200) -> str:
    text = data.decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        text = json.loads(text)["error"]["message"]
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _decode(data: bytes) -> dict[str, Any]:
    """An event's JSON object; an undecodable one counts as empty (its tokens were counted)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return {}
    return chunk if isinstance(chunk, dict) else {}


def _reassemble(st: _Stream, req: CompletionRequest, chat: bool, model: str) -> bytes:
    """The non-streaming body of what the stream carried (see :mod:`duetime.gateway.reassembly`)."""
    body = st.answer.body(chat=chat, model=model, tool_choice=req.body.get("tool_choice"))
    return json.dumps(body, separators=(",", ":")).encode()
