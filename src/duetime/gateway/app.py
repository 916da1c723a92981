"""The gateway: an OpenAI-compatible endpoint in front of a pool of model instances.

Per request: parse and validate, estimate the prompt's tokens, choose an instance with the
configured policy over the candidates' live state (:mod:`duetime.gateway.state`), and stream
from it. The upstream request is always a stream (``stream_options.include_usage``), so the
first token's time is observed even for a non-streaming client, whose response is reassembled.
Nothing reaches the client before the first upstream chunk: until then a connect error, a
timeout, a 5xx/429 or a broken stream is retried on another candidate (at most ``retries``
more attempts, never the same instance twice). Streamed chunks are passed through as bytes,
split only at event boundaries (to count tokens and drop the usage chunk the client did not ask
for). A client that disconnects cancels its upstream request (the connection is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duetime.engine.snapshot import Snapshot, SnapshotError
from duetime.engine.warmup import warm_up
from duetime.gateway.config import Pool
from duetime.gateway.metrics import GatewayMetrics
from duetime.gateway.state import Flight, InstanceState
from duetime.gateway.upstream import Upstream, UpstreamError, chunks, finish, read_all
from duetime.policy import make_policy
from duetime.policy.base import RoutingRequest
from duetime.serving.asgi import (
    CompletionEndpoint,
    Disconnect,
    FastRoutes,
    Scope,
    Send,
    header,
    send_error,
    send_json,
)
from duetime.serving.errors import ApiError
from duetime.serving.requests import CompletionRequest, parse_completion, prompt_texts
from duetime.serving.sse import SSE_HEADERS, error_event, payload, split_events

log = logging.getLogger("duetime.gateway")

IDLE_AFTER_S = 2.0  # no request for this long: poll instances at the idle interval
# which live state a policy reads: snapshots (polled from instances that publish them; the
# shadow replica otherwise) or the load gauges of /metrics (as llm-d scrapes them)
SNAPSHOT_POLICIES = {"sfs", "sfs-soft", "throughput", "lps", "laar", "ttca"}
METRICS_POLICIES = {"shortest-queue", "load-aware", "session-affinity"}


class _Failed(Exception):
    """An upstream attempt failed before the response reached the client (retriable)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Passthrough(Exception):
    """The upstream answered a client error (4xx): relay it as is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass(slots=True)
class _Controls:
    target_s: float
    attempted: frozenset[str]
    session: str | None
    task: str


_UNSET: Any = object()


@dataclass(slots=True)
class _Stream:
    """What the gateway learns from an upstream stream."""

    tokens: int = 0
    done: bool = False
    usage: dict[str, Any] | None = None
    error: bytes | None = None
    # reassembly (non-streaming clients)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = _UNSET  # vLLM's: the stop string or token id that ended the output
    id: str | None = None
    created: int | None = None
    model: str | None = None


class Gateway:
    """The gateway's state and behaviour; :meth:`app` is its ASGI app."""

    def __init__(self, pool: Pool) -> None:
        missing = [i.name for i in pool.instances if i.url is None]
        if missing:
            raise ValueError(f"instances without a URL (start their emulators first): {missing}")
        self.pool = pool
        self.metrics = GatewayMetrics()
        self.policy = make_policy(pool.policy, lam=pool.lam, seed=pool.seed, delta=pool.delta,
                                  alpha=pool.alpha)
        now = time.monotonic()
        self.instances = [InstanceState(i, pool, self.metrics, now) for i in pool.instances]
        self.by_model: dict[str, list[InstanceState]] = {}
        for s in self.instances:
            self.by_model.setdefault(s.model, []).append(s)
        tasks = list(pool.quality)
        self.tasks = tasks
        self.quality = {t: {m: pool.quality[t][m] for m in pool.models} for t in tasks}
        self.quality["*"] = {m: float(np.mean([pool.quality[t][m] for t in tasks]))
                             for m in pool.models}
        self.default_task = pool.default_task or "*"
        self.trained = None
        if pool.predictor is not None:
            from duetime.predict.quality_source import Trained
            self.trained = Trained(pool.predictor)
        self.tokenizer = None
        if pool.tokenizer is not None:
            from duetime.predict.tokens import HFTokenizer
            self.tokenizer = HFTokenizer(pool.tokenizer)
        # retry-aware policies read RoutingRequest.quality as the success probability
        self.wants_success = pool.policy in ("laar", "ttca")
        self.upstream: Upstream | None = None
        self._headers: dict[str, str] = {"content-type": "application/json"}
        self._bg: list[asyncio.Task[None]] = []
        self._ids = itertools.count(1)
        self._last_request = -math.inf
        self._active = asyncio.Event()  # set by the first request after an idle spell
        self._prefix = secrets.token_hex(3)
        self.scrape_snapshots = (pool.policy in SNAPSHOT_POLICIES
                                 and pool.state.source in ("auto", "published"))
        self.scrape_metrics = (pool.policy in METRICS_POLICIES
                               or pool.state.source == "metrics")

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.upstream is not None:
            return
        warm_up()
        t = self.pool.timeouts
        self.upstream = Upstream(connect_s=t.connect_s, read_s=t.read_s)
        await self.upstream.start()
        loop = asyncio.get_running_loop()
        for s in self.instances:
            if self.scrape_snapshots and s.publishes is not False:
                self._bg.append(loop.create_task(self._poll(s, "/snapshot")))
            if self.scrape_metrics:
                self._bg.append(loop.create_task(self._poll(s, "/metrics")))
        self._bg.append(loop.create_task(self._health_loop()))

    async def close(self) -> None:
        for task in self._bg:
            task.cancel()
        for task in self._bg:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._bg.clear()
        if self.upstream is not None:
            await self.upstream.close()
            self.upstream = None

    # -- background: scrapes and health ---------------------------------------------------------

    def _poll_interval(self) -> float:
        """Scrape at ``state.scrape_interval_s`` while requests come; slower when idle (no
        routing decision needs fresh state then, and a quiet gateway should stay quiet)."""
        st = self.pool.state
        if time.monotonic() - self._last_request < IDLE_AFTER_S:
            return st.scrape_interval_s
        return max(st.scrape_interval_s, st.idle_scrape_interval_s)

    async def _poll(self, s: InstanceState, path: str) -> None:
        """Poll ``/snapshot`` or ``/metrics`` of one instance until it answers 404."""
        timeout = max(0.25, 4 * self.pool.state.scrape_interval_s)
        url = s.url + path
        reported = ""
        while True:
            sent = time.monotonic()
            if s.healthy:
                try:
                    r = await self._http.get(url, timeout)
                    received = time.monotonic()
                    if r.status == 404:
                        log.info(f"instance does not serve {path}", extra={"fields": {
                            "instance": s.name}})
                        if path == "/snapshot":
                            s.publishes = False
                        else:
                            s.serves_metrics = False
                        return
                    if r.status == 200:
                        if path == "/snapshot":
                            clock = r.headers.get("x-duetime-clock")
                            if clock is None:
                                raise ValueError("no x-duetime-clock header")
                            s.set_published(Snapshot.from_dict(json.loads(r.body)),
                                            float(clock), sent, received)
                            s.publishes = True
                        else:
                            s.set_metrics(r.body.decode(errors="replace"), received)
                            s.serves_metrics = True
                        reported = ""
                except UpstreamError:
                    pass  # the health loop deals with unreachable instances
                except (ValueError, SnapshotError) as e:
                    if str(e) != reported:  # once per distinct problem, not every poll
                        reported = str(e)
                        log.warning(f"bad {path} answer", extra={"fields": {
                            "instance": s.name, "error": reported}})
            wait = self._poll_interval() - (time.monotonic() - sent)
            if wait > self.pool.state.scrape_interval_s:  # idle: a request ends the wait
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._active.wait(), wait)
            else:
                await asyncio.sleep(max(0.0, wait))

    async def _probe(self, s: InstanceState) -> None:
        try:
            r = await self._http.get(s.url + "/health", self.pool.health.timeout_s)
            ok = r.status == 200
            why = f"/health answered {r.status}"
        except UpstreamError as e:
            ok, why = False, str(e)
        if ok:
            if not s.healthy:
                s.readmit()
        elif s.healthy:
            s.report_failure("connect" if why.startswith("connect") else "probe", why)
        else:
            s.last_error = why

    async def _health_loop(self) -> None:
        interval = self.pool.health.interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._probe(s) for s in self.instances),
                                 return_exceptions=True)

    @property
    def _http(self) -> Upstream:
        if self.upstream is None:
            raise RuntimeError("the gateway is not started")
        return self.upstream

    # -- requests ---------------------------------------------------------------------------------

    def _controls(self, scope: Scope, prompt_tokens: int) -> _Controls:
        raw = header(scope, b"x-duetime-ttft-ms")
        if raw is None:
            target_ms = self.pool.target_ms(prompt_tokens)
        else:
            try:
                target_ms = float(raw)
            except ValueError:
                target_ms = math.nan
            if not (math.isfinite(target_ms) and 0 < target_ms <= 3.6e6):
                raise ApiError(400, f"x-duetime-ttft-ms must be a number of milliseconds in "
                               f"(0, 3600000], got {raw!r}", param="x-duetime-ttft-ms",
                               code="invalid_header")
        attempted: frozenset[str] = frozenset()
        raw = header(scope, b"x-duetime-attempted")
        if raw is not None and raw.strip():
            names = [n.strip() for n in raw.split(",")]
            if any(not n for n in names) or len(names) > 100:
                raise ApiError(400, f"x-duetime-attempted must be a comma-separated list of "
                               f"model names, got {raw!r}", param="x-duetime-attempted",
                               code="invalid_header")
            attempted = frozenset(names)
        session = header(scope, b"x-session-id")
        task = header(scope, b"x-duetime-task")
        if task is None:
            task = self.default_task
        elif task not in self.tasks:
            raise ApiError(400, f"x-duetime-task: unknown task {task!r}; known: "
                           f"{', '.join(self.tasks)}", param="x-duetime-task",
                           code="invalid_header")
        return _Controls(target_ms / 1000.0, attempted, session or None, task)

    def _pool_for(self, model: str | None) -> list[InstanceState]:
        if model is None or model in self.pool.aliases:
            return self.instances
        insts = self.by_model.get(model)
        if insts is None:
            raise ApiError(404, f"The model `{model}` does not exist. Models: "
                           f"{', '.join([*self.pool.aliases, *self.by_model])}",
                           param="model", code="model_not_found")
        return insts

    async def serve(self, scope: Scope, raw: bytes, chat: bool, guard: Disconnect,
                    t0: float) -> None:
        """Answer one completion request (``guard.send`` is the response channel)."""
        send = guard.send
        route = "chat" if chat else "completions"
        status = 500
        if t0 - self._last_request >= IDLE_AFTER_S:  # wake the idle pollers
            self._active.set()
            self._active.clear()
        self._last_request = t0
        try:
            req = parse_completion(raw, chat=chat)
            if self.tokenizer is not None:
                req.prompt_tokens = self._count_tokens(req)
            ctl = self._controls(scope, req.prompt_tokens)
            insts = self._pool_for(req.model)
            status = await self._route(req, ctl, insts, chat, send, t0)
        except ApiError as e:
            status = e.status
            await send_error(send, e)
            log.info("request", extra={"fields": {
                "event": "request", "status": status, "route": route, "error": e.message,
                "e2e_ms": round((time.monotonic() - t0) * 1000, 2)}})
        except asyncio.CancelledError:
            status = 499
            self.metrics.cancelled.inc()
            raise
        except Exception as e:  # a bug: say so in the logs, answer 500 if still possible
            status = 500
            log.exception("internal error", extra={"fields": {"event": "internal_error",
                                                              "route": route}})
            if not guard.started:
                await send_error(send, ApiError(500, f"internal error in the gateway: "
                                                f"{type(e).__name__}", code="internal_error"))
        finally:
            self.metrics.requests.labels(route, str(status)).inc()

    def _count_tokens(self, req: CompletionRequest) -> int:
        """Prompt tokens with the pool's tokenizer: a completion's prompt exactly (token ids
        are counted as given); chat as 3 + Σ (4 + tokens(content)), the chat template's
        per-message markers estimated as in the emulator."""
        tok = self.tokenizer
        assert tok is not None
        if req.chat:
            return 3 + sum(4 + (tok.count(t) if t else 0) for t in prompt_texts(req))
        prompt = req.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return tok.count(prompt) if isinstance(prompt, str) else req.prompt_tokens

    def _predict(self, req: CompletionRequest, ctl: _Controls,
                 table: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Per model: predicted quality (or success probability, for retry-aware policies)
        and median output length, from the trained predictors."""
        from duetime.predict.quality_source import Query

        text = "\n".join(prompt_texts(req))
        models = self.pool.models
        preds = self.trained.predict(Query(text, None if ctl.task == "*" else ctl.task,
                                           tokens=req.prompt_tokens), models)
        head = preds.success if self.wants_success else preds.quality
        quality = (table if head is None else
                   {m: float(v) for m, v in zip(models, head.tolist(), strict=True)})
        lengths = ({} if preds.length_median is None else
                   {m: float(v) for m, v in zip(models, preds.length_median.tolist(),
                                                strict=True)})
        return quality, lengths

    async def _route(self, req: CompletionRequest, ctl: _Controls, insts: list[InstanceState],
                     chat: bool, send: Send, t0: float) -> int:
        pool = self.pool
        rid = f"dt-{self._prefix}-{next(self._ids):x}"
        predicted = (min(req.max_tokens, pool.default_output_tokens) if req.max_tokens
                     else pool.default_output_tokens)
        body = dict(req.body)
        body["stream"] = True
        # usage is always asked for upstream (the gateway counts tokens with it); the client's
        # other stream options (vLLM's continuous_usage_stats) go along
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                  "include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        quality = self.quality[ctl.task]
        lengths: dict[str, float] = {}
        if self.trained is not None:
            quality, lengths = self._predict(req, ctl, quality)
        tried: set[str] = set()
        errors: list[str] = []
        attempt = 0
        while True:
            cands = [s for s in insts if s.healthy and s.name not in tried]
            if not cands or attempt > pool.retries:
                what = "any model" if insts is self.instances else f"model `{insts[0].model}`"
                if not errors:
                    raise ApiError(503, f"no healthy instance serves {what}",
                                   code="no_healthy_instance")
                raise ApiError(502, f"upstream failed after {len(errors)} attempt(s): "
                               + "; ".join(errors), code="upstream_failed")
            now = time.monotonic()
            rr = RoutingRequest(rid, req.prompt_tokens,
                                np.array([quality[c.model] for c in cands]),
                                np.array([max(1, min(predicted if req.max_tokens else 1 << 30,
                                                     round(lengths.get(c.model, predicted))))
                                          for c in cands]),
                                max(0.0, ctl.target_s - (now - t0)), ctl.task, ctl.session,
                                ctl.attempted)
            decision = self.policy.choose(rr, [c.candidate for c in cands], now)
            inst = cands[decision.index]
            tried.add(inst.name)
            attempt += 1
            if attempt > 1:
                self.metrics.retries.inc()
            self.metrics.decisions.labels(inst.name, inst.model).inc()
            self.metrics.state_source.labels(inst.name, inst.last_source).inc()
            body["model"] = inst.spec.served_model
            fid = f"{rid}-{attempt}"
            flight = inst.dispatch(fid, req.prompt_tokens, predicted, time.monotonic(),
                                   decision.forecast)
            if attempt == 1:
                self.metrics.overhead.observe(time.monotonic() - t0)
            try:
                return await self._attempt(inst, flight, path, json.dumps(body).encode(), req,
                                           ctl, chat, send, t0, rid, attempt)
            except _Failed as e:
                inst.report_failure(e.kind, str(e))
                self.metrics.upstream_errors.labels(inst.name, e.kind).inc()
                errors.append(f"{inst.name}: {e}")
                log.warning("upstream attempt failed", extra={"fields": {
                    "event": "upstream_error", "id": rid, "instance": inst.name,
                    "kind": e.kind, "error": str(e), "attempt": attempt}})
            except _Passthrough as e:
                await send_json(send, e.status, e.body, [(b"x-duetime-instance",
                                                          inst.name.encode())])
                return e.status

    async def _attempt(self, inst: InstanceState, flight: Flight, path: str, payload: bytes,
                       req: CompletionRequest, ctl: _Controls, chat: bool, send: Send,
                       t0: float, rid: str, attempt: int) -> int:
        upstream = self._http
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
                            raise _Failed(f"status_{'5xx' if status >= 500 else '429'}",
                                          f"upstream answered {status}: {_brief(data)}")
                        raise _Passthrough(status, data)
                    stream = chunks(resp)
                    buf = b""
                    events: list[bytes] = []
                    while not events:
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            raise _Failed("broken", "upstream closed the stream before its "
                                          "first chunk") from None
                        buf += chunk
                        events, buf = split_events(buf)
            except UpstreamError as e:
                raise _Failed(e.kind, str(e)) from None
            except TimeoutError:
                raise _Failed("timeout", f"no first token within "
                              f"{self.pool.timeouts.first_token_s:g} s") from None
            t_first = time.monotonic()
            headers = [(b"x-duetime-model", inst.model.encode()),
                       (b"x-duetime-instance", inst.name.encode()),
                       (b"x-duetime-ttft-target-ms", f"{ctl.target_s * 1000:.1f}".encode()),
                       (b"x-duetime-attempts", str(attempt).encode()),
                       (b"x-request-id", rid.encode())]
            if flight.forecast is not None and math.isfinite(flight.forecast):
                headers.append((b"x-duetime-forecast-ttft-ms",
                                f"{flight.forecast * 1000:.1f}".encode()))
            if req.stream:
                out = self._scan(events, st, req, collect=False, flight=flight)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*SSE_HEADERS, *headers]})
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                # the bookkeeping of the first token after it is on its way to the client
                self._first(inst, flight, t_first, t0, ctl)
                async for out in self._relay(stream, buf, st, req, flight, collect=False):
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
                self._first(inst, flight, t_first, t0, ctl)
                self._scan(events, st, req, collect=True, flight=flight)
                async for _ in self._relay(stream, buf, st, req, flight, collect=True):
                    pass
                if not st.done:
                    raise _Failed("broken", (st.error or b"upstream stream ended early")
                                  .decode(errors="replace"))
                await finish(resp)
                finished = True
                body = _reassemble(st, chat, inst.model)
                await send_json(send, 200, body, headers)
            output_tokens = (st.usage or {}).get("completion_tokens", st.tokens)
            self._log(rid, inst, flight, t0, 200, attempt, output_tokens, ctl,
                      None if st.done else (st.error or b"stream ended early"))
            return 200
        finally:
            if resp is not None and not finished:
                resp.close()  # an unfinished stream: closing the connection aborts it upstream
            inst.complete(flight, time.monotonic(), output_tokens=output_tokens)

    async def _relay(self, chunks: AsyncIterator[bytes], buf: bytes, st: _Stream,
                     req: CompletionRequest, flight: Flight, *,
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
                yield self._scan(events, st, req, collect=collect, flight=flight)

    def _scan(self, events: list[bytes], st: _Stream, req: CompletionRequest, *, collect: bool,
              flight: Flight) -> bytes:
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
                with contextlib.suppress(ValueError):
                    st.usage = json.loads(data).get("usage")
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
                _collect(st, data)
            else:
                out.append(ev + b"\n\n")
        flight.tokens = st.tokens
        return b"".join(out)

    def _first(self, inst: InstanceState, flight: Flight, t_first: float, t0: float,
               ctl: _Controls) -> None:
        """An attempt got its first token: the instance is healthy, the shadow replica learns
        when the request's prefill ended, and the metrics record TTFT and the forecast error."""
        inst.report_success()
        inst.first_token(flight, t_first)
        m = self.metrics
        ttft = t_first - t0
        m.ttft.labels(inst.name).observe(ttft)
        m.target.labels(inst.name, "on_time" if ttft <= ctl.target_s else "late").inc()
        if flight.forecast is not None and math.isfinite(flight.forecast):
            observed = t_first - flight.dispatched
            m.forecast_error.labels(inst.name).observe(observed - flight.forecast)
            m.forecast_error_sum.labels(inst.name).inc(observed - flight.forecast)
            if flight.forecast > 0:
                m.forecast_ratio.labels(inst.name).observe(observed / flight.forecast)

    def _log(self, rid: str, inst: InstanceState, flight: Flight, t0: float, status: int,
             attempt: int, output_tokens: int | None, ctl: _Controls,
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
            "e2e_ms": round((time.monotonic() - t0) * 1000, 2),
            **({} if error is None else {"error": error.decode(errors="replace")[:300]})}})

    # -- the app ----------------------------------------------------------------------------------

    def app(self) -> FastRoutes:
        gw = self

        async def models(request: Request) -> Response:
            created = int(time.time())
            data = [{"id": a, "object": "model", "created": created, "owned_by": "duetime"}
                    for a in gw.pool.aliases]
            data += [{"id": m, "object": "model", "created": created, "owned_by": "duetime",
                      "instances": [s.name for s in gw.by_model[m]]} for m in gw.by_model]
            return JSONResponse({"object": "list", "data": data})

        async def health(request: Request) -> Response:
            n = sum(s.healthy for s in gw.instances)
            return JSONResponse({"status": "ok" if n else "unavailable",
                                 "healthy_instances": n, "instances": len(gw.instances)},
                                status_code=200 if n else 503)

        async def metrics(request: Request) -> Response:
            return Response(generate_latest(gw.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        async def instances(request: Request) -> Response:
            return JSONResponse({"policy": gw.pool.policy,
                                 "instances": [s.describe() for s in gw.instances]})

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await gw.start()
            try:
                yield
            finally:
                await gw.close()

        chat = CompletionEndpoint(lambda scope, raw, guard, t0: gw.serve(scope, raw, True,
                                                                         guard, t0))
        completions = CompletionEndpoint(lambda scope, raw, guard, t0: gw.serve(
            scope, raw, False, guard, t0))
        routes = [
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/duetime/instances", instances, methods=["GET"]),
        ]
        app = Starlette(routes=routes, lifespan=lifespan)
        app.state.gateway = gw
        return FastRoutes(app, {"/v1/chat/completions": chat, "/v1/completions": completions})


def _brief(data: bytes, limit: int = 200) -> str:
    text = data.decode(errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        text = json.loads(text)["error"]["message"]
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _collect(st: _Stream, data: bytes) -> None:
    try:
        d = json.loads(data)
    except ValueError:
        return
    st.id = st.id or d.get("id")
    st.created = st.created or d.get("created")
    st.model = st.model or d.get("model")
    for ch in d.get("choices") or ():
        delta = ch.get("delta")
        piece = (delta or {}).get("content") if delta is not None else ch.get("text")
        if piece:
            st.text.append(piece)
        if ch.get("finish_reason"):
            st.finish_reason = ch["finish_reason"]
        if "stop_reason" in ch and (ch["stop_reason"] is not None or st.stop_reason is _UNSET):
            st.stop_reason = ch["stop_reason"]
    if d.get("usage"):
        st.usage = d["usage"]


def _reassemble(st: _Stream, chat: bool, model: str) -> bytes:
    text = "".join(st.text)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": st.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": st.finish_reason}
        obj = "text_completion"
    if st.stop_reason is not _UNSET:  # an upstream that reports it (vLLM) gets it relayed
        choice["stop_reason"] = st.stop_reason
    body = {"id": st.id, "object": obj, "created": st.created or int(time.time()),
            "model": st.model or model, "choices": [choice], "usage": st.usage}
    return json.dumps(body, separators=(",", ":")).encode()
