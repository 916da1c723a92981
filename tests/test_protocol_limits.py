"""Protocol limits, error hygiene, JSON errors on every route, /openapi.json and the drain
timeout (issue 16). Loopback only; counts and waits bounded, waits derived from the configured
timeouts (never from the machine's speed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from duetime.gateway import ConfigError, pool_from_dict
from duetime.service import Service
from duetime.web.errors import MAX_MESSAGE, TRUNCATED, exception_handlers
from duetime.web.limits import LimitsSpec
from duetime.web.logs import JsonFormatter
from duetime.web.server import AppServer
from test_gateway import gateway, start_serve

PRICE = {"prompt": 0.1, "output": 0.3}
SLACK_S = 10.0  # how much longer than a configured timeout a test waits before it fails


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def config(limits: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "policy": "sfs",
        "quality": {"workload": None, "tasks": {"chat": {"big": 0.9}}},
        "instances": [{"name": "a", "model": "big", "profile": "qwen3-0.6b",
                       "emulate": {"speed": 4.0}, "price_usd_per_mtok": PRICE}],
        "health": {"interval_s": 5.0},
        "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0},
    }
    if limits is not None:
        d["limits"] = limits
    d.update(kw)
    return d




@contextlib.asynccontextmanager
async def plain_server(limits: LimitsSpec) -> AsyncIterator[AppServer]:
    """A one-route app (``POST /echo`` answers the body's length) under ``limits``."""
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])],
                    exception_handlers=exception_handlers())
    server = await AppServer(app, limits=limits).start()
    try:
        yield server
    finally:
        await server.stop()


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2, **kw}


def is_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the limits in the config -------------------------------------------------------------------

def test_limits_config_defaults_and_validation():
    pool = pool_from_dict(config(), "t")
    assert pool.limits == LimitsSpec()
    assert pool.limits.max_header_bytes == 64 * 1024 and pool.limits.max_json_depth == 128
    pool = pool_from_dict(config({"header_timeout_s": 2.5, "max_connections": 10}), "t")
    assert pool.limits.header_timeout_s == 2.5 and pool.limits.max_connections == 10
    with pytest.raises(ConfigError, match=r"limits\.max_header_byte: unknown field"):
        pool_from_dict(config({"max_header_byte": 1}), "t")
    with pytest.raises(ConfigError, match=r"limits\.header_timeout_s"):
        pool_from_dict(config({"header_timeout_s": 0}), "t")


# -- headers: size and read timeout ---------------------------------------------------------------

def test_oversized_headers_are_431_and_memory_stays_bounded():
    """20 clients each try to send a 10 MB header: each gets a JSON 431 and is closed long
    before it is sent, and the process's memory does not grow by what they sent."""
    limits = LimitsSpec(max_header_bytes=16 * 1024)
    n, size, piece = 20, 10 * 1024 * 1024, b"x" * (64 * 1024)

    async def one(port: int) -> tuple[bytes, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\nx-big: ")
        answer = asyncio.ensure_future(read_until_closed(reader, SLACK_S))
        sent = 0
        with contextlib.suppress(ConnectionError):
            while sent < size and not answer.done():  # (the answer ends with the server's EOF)
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
        data = await answer
        writer.close()
        return data, sent

    async def go() -> tuple[list[tuple[bytes, int]], int]:
        async with plain_server(limits) as server:
            before = rss_bytes()
            out = await asyncio.gather(*(one(server.port) for _ in range(n)))
            return out, rss_bytes() - before

    out, grown = run(go())
    for data, sent in out:
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), data[:200]
        assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
        assert sent < size  # closed while the header was still coming
    assert grown < 64 * 1024 * 1024, grown  # (20 x 10 MB unbounded would be 200 MB)


def test_header_in_one_read_over_the_limit_is_431():
    async def go() -> httpx.Response:
        async with plain_server(LimitsSpec(max_header_bytes=4096)) as server, \
                httpx.AsyncClient(base_url=server.url) as c:
            ok = await c.post("/echo", content=b"abc", headers={"x-a": "y" * 1000})
            assert ok.status_code == 200 and ok.json() == {"bytes": 3}
            return await c.post("/echo", content=b"abc", headers={"x-a": "y" * 5000})

    is_error(run(go()), 431, "request_header_fields_too_large")


def test_slow_and_silent_clients_are_closed_within_the_header_timeout():
    timeout = 0.5
    limits = LimitsSpec(header_timeout_s=timeout)

    async def half_header(port: int) -> tuple[bytes, float]:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\nx-slow: ab")
        await writer.drain()
        data = await read_until_closed(reader, timeout + SLACK_S)
        writer.close()
        return data, time.monotonic() - t0

    async def silent(port: int) -> tuple[bytes, float]:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = await read_until_closed(reader, timeout + SLACK_S)
        writer.close()
        return data, time.monotonic() - t0

    async def go() -> tuple[list[tuple[bytes, float]], list[tuple[bytes, float]], int]:
        async with plain_server(limits) as server:
            halves = await asyncio.gather(*(half_header(server.port) for _ in range(50)))
            silents = await asyncio.gather(*(silent(server.port) for _ in range(50)))
            left = len(server.server.server_state.connections)
            return halves, silents, left

    halves, silents, left = run(go())
    for data, elapsed in halves:
        assert elapsed >= timeout * 0.9
        assert data.startswith(b"HTTP/1.1 408 ")
        body = json.loads(data.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_timeout"
    for data, elapsed in silents:
        assert elapsed >= timeout * 0.9 and data == b""  # (closed without a word)
    assert left == 0


def test_idle_keep_alive_connections_are_held_longer_than_clients_hold_theirs():
    """The server closes an idle keep-alive connection after ``keep_alive_s`` (75 s by
    default: longer than httpx's and so the OpenAI SDK's 5 s, so the client closes first; at
    equal timeouts a burst through the gateway saw bare connection resets), and not before."""
    assert LimitsSpec().keep_alive_s > httpx.Limits().keepalive_expiry
    keep = 0.5

    async def go() -> tuple[float, float, int]:
        async with plain_server(LimitsSpec(keep_alive_s=keep)) as server:
            assert server.config.timeout_keep_alive == keep
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\nab")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
            await reader.readexactly(length)
            t0 = time.monotonic()
            rest = await read_until_closed(reader, keep + SLACK_S)
            writer.close()
            return time.monotonic() - t0, len(rest), len(server.server.server_state.connections)

    held, rest, left = run(go())
    assert keep * 0.9 <= held <= keep + SLACK_S and rest == 0 and left == 0


def test_a_stalled_body_is_408_and_closed_within_the_body_timeout():
    timeout = 0.5

    async def go() -> tuple[bytes, float]:
        async with plain_server(LimitsSpec(body_timeout_s=timeout)) as server:
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n{")
            await writer.drain()
            data = await read_until_closed(reader, timeout + SLACK_S)
            writer.close()
            return data, time.monotonic() - t0

    data, elapsed = run(go())
    assert elapsed >= timeout * 0.9
    assert data.startswith(b"HTTP/1.1 408 ")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


def test_connections_beyond_the_cap_get_a_json_503():
    cap = 4

    async def go() -> tuple[bytes, httpx.Response]:
        async with plain_server(LimitsSpec(max_connections=cap)) as server:
            idle = [await asyncio.open_connection("127.0.0.1", server.port)
                    for _ in range(cap)]
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            data = await read_until_closed(reader, SLACK_S)
            writer.close()
            for _, w in idle:
                w.close()
            t_end = time.monotonic() + SLACK_S  # the idle ones gone: served again
            while server.server.server_state.connections and time.monotonic() < t_end:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=server.url) as c:
                return data, await c.post("/echo", content=b"ab")

    data, after = run(go())
    assert data.startswith(b"HTTP/1.1 503 ")
    assert b"connection: close" in data.lower()
    body = json.loads(data.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "too_many_connections"
    assert after.status_code == 200


def test_malformed_http_is_a_json_400():
    async def go() -> bytes:
        async with plain_server(LimitsSpec()) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            data = await read_until_closed(reader, SLACK_S)
            writer.close()
            return data

    data = run(go())
    assert data.startswith(b"HTTP/1.1 400 ")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"


def test_unhandled_exceptions_are_a_json_500_naming_nothing_of_them():
    from duetime.web.asgi import CompletionEndpoint, FastRoutes

    async def boom(request: Request) -> JSONResponse:
        raise RuntimeError("secret 10.0.0.7:8000")

    async def fast_boom(scope: Any, raw: bytes, guard: Any, t0: float) -> None:
        raise RuntimeError("secret 10.0.0.7:8000")

    async def go() -> list[httpx.Response]:
        app = Starlette(routes=[Route("/boom", boom)], exception_handlers=exception_handlers())
        server = await AppServer(FastRoutes(app, {"/fast": CompletionEndpoint(fast_boom)})
                                 ).start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as c:
                return [await c.get("/boom"), await c.post("/fast", content=b"{}")]
        finally:
            await server.stop()

    logging.getLogger("uvicorn.error").disabled = True  # (the expected tracebacks)
    try:
        for r in run(go()):
            is_error(r, 500, "internal_error")
            assert b"secret" not in r.content and b"10.0.0.7" not in r.content
    finally:
        logging.getLogger("uvicorn.error").disabled = False


# -- the gateway: bodies, error hygiene, routes -----------------------------------------------------

def test_deep_json_is_400_not_500_and_ordinary_nesting_passes():
    def nested(depth: int) -> bytes:
        return (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, '
                b'"extra": ' + b"[" * depth + b"]" * depth + b"}")

    async def go() -> list[httpx.Response]:
        async with gateway(config()) as (_svc, c):
            return [await c.post("/v1/chat/completions", content=nested(d),
                                 headers={"content-type": "application/json"})
                    for d in (5000, 1000, 200, 100)]

    deep5000, deep1000, deep200, ok = run(go())
    for r in (deep5000, deep1000, deep200):
        is_error(r, 400, "json_too_deep")
    assert ok.status_code == 200


def test_json_depth_limit_is_configurable():
    body = chat(extra=[[[[[[[[1]]]]]]]])

    async def go() -> httpx.Response:
        async with gateway(config({"max_json_depth": 4})) as (_svc, c):
            return await c.post("/v1/chat/completions", json=body)

    err = is_error(run(go()), 400, "json_too_deep")
    assert "4 levels" in err["message"]


def test_a_megabyte_header_value_is_not_echoed_whole(caplog):
    big = "9" * (1024 * 1024)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with gateway(config({"max_header_bytes": 2 * 1024 * 1024})) as (_svc, c):
            r = await c.post("/v1/chat/completions", json=chat(),
                             headers={"x-duetime-ttft-ms": big + "x"})
        async with gateway(config()) as (_svc, c):  # (the default limit: 431)
            r431 = await c.post("/v1/chat/completions", json=chat(),
                                headers={"x-duetime-ttft-ms": big})
        return r, r431

    with caplog.at_level(logging.INFO, logger="duetime"):
        r, r431 = run(go())
    err = is_error(r, 400)
    assert err["param"] == "x-duetime-ttft-ms"
    assert len(err["message"]) <= MAX_MESSAGE + len(TRUNCATED)
    assert len(r.content) < 1000
    is_error(r431, 431, "request_header_fields_too_large")
    lines = [JsonFormatter().format(rec) for rec in caplog.records]
    assert lines and max(len(line) for line in lines) < 2000


def test_error_messages_are_clipped_and_marked():
    from duetime.web.errors import ApiError

    err = ApiError(400, "got " + "z" * 10_000, param="p" * 1000)
    assert err.message.endswith(TRUNCATED) and len(err.message) == MAX_MESSAGE + len(TRUNCATED)
    assert len(err.encode()) < 600
    assert ApiError(400, "short").message == "short"


def test_failing_upstream_502_names_no_host_port_nor_library_error():
    async def go() -> httpx.Response:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = config()
        cfg["instances"][0].update({"url": f"http://127.0.0.1:{port}", "emulate": None})
        async with gateway(cfg) as (_svc, c):
            r = await c.post("/v1/chat/completions", json=chat())
            return r, port

    r, port = run(go())
    err = is_error(r, 502, "upstream_failed")
    for leak in ("127.0.0.1", str(port), "Cannot connect", "Errno", "aiohttp", "Connector"):
        assert leak not in err["message"], err["message"]


def test_upstream_client_errors_are_relayed_clipped():
    """An instance's 4xx is the client's answer, but its message is clipped like ours: a
    FastAPI validation error quoting a 100 KB input, and an OpenAI error with a long message
    (its type and code kept)."""
    big = "x" * 100_000
    answers = {
        "detail": (422, {"detail": [{"type": "string_type", "msg": "bad", "input": big}]}),
        "openai": (400, {"error": {"message": "too long: " + big, "type": "BadRequestError",
                                   "param": "messages", "code": 400}}),
    }

    async def upstream_app(which: str) -> Starlette:
        async def health(request: Request) -> JSONResponse:
            return JSONResponse({})

        async def complete(request: Request) -> JSONResponse:
            await request.body()
            status, body = answers[which]
            return JSONResponse(body, status_code=status)

        return Starlette(routes=[Route("/health", health),
                                 Route("/v1/chat/completions", complete, methods=["POST"])])

    async def go(which: str) -> httpx.Response:
        server = await AppServer(await upstream_app(which)).start()
        try:
            cfg = config()
            cfg["instances"][0].update({"url": server.url, "emulate": None})
            async with gateway(cfg) as (_svc, c):
                return await c.post("/v1/chat/completions", json=chat())
        finally:
            await server.stop()

    r = run(go("detail"))
    err = is_error(r, 422, None)
    assert len(err["message"]) <= MAX_MESSAGE + len(TRUNCATED) and "string_type" in err["message"]
    assert len(r.content) < 1000
    r = run(go("openai"))
    err = is_error(r, 400, 400)
    assert err["message"].startswith("too long: x") and err["message"].endswith(TRUNCATED)
    assert err["type"] == "BadRequestError" and err["param"] == "messages"
    assert len(r.content) < 1000


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/nowhere", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
    ("DELETE", "/health", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
])
def test_errors_outside_the_completion_routes_are_openai_json(method, path, status, code):
    async def go() -> httpx.Response:
        async with gateway(config()) as (_svc, c):
            return await c.request(method, path)

    is_error(run(go()), status, code)


def test_emulator_errors_are_openai_json_too():
    from duetime.emulator import create_app, emulator_from_profile

    async def go() -> list[httpx.Response]:
        emu = emulator_from_profile("qwen3-0.6b", speed=8.0)
        server = await AppServer(create_app(emu)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as c:
                return [await c.get("/nowhere"), await c.get("/v1/completions"),
                        await c.post("/v1/completions",
                                     content=b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}")]
        finally:
            await server.stop()

    missing, wrong, deep = run(go())
    is_error(missing, 404, "not_found")
    is_error(wrong, 405, "method_not_allowed")
    is_error(deep, 400, "json_too_deep")


# -- /openapi.json --------------------------------------------------------------------------------

def test_openapi_document_describes_every_route_and_is_valid():
    async def go() -> httpx.Response:
        async with gateway(config()) as (_svc, c):
            return await c.get("/openapi.json")

    r = run(go())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for p in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
              "/duetime/instances", "/openapi.json"):
        assert p in paths, p
    assert set(paths["/v1/chat/completions"]) == {"post"}
    assert set(paths["/health"]) == {"get"}
    chat_op = paths["/v1/chat/completions"]["post"]
    assert {"200", "400", "502", "503"} <= set(chat_op["responses"])

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [v for k, v in node.items() if k == "$ref"] + \
                [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):  # every reference resolves
        assert ref.startswith("#/components/schemas/")
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"], ref


def test_openapi_document_passes_openapi_spec_validator():
    """(openapi-spec-validator: a test dependency, pyproject's ``test`` extra)."""
    import openapi_spec_validator as validator

    from duetime.gateway.observe.openapi import openapi_document

    async def go() -> dict[str, Any]:
        async with gateway(config()) as (_svc, c):
            return (await c.get("/openapi.json")).json()

    doc = run(go())
    validator.validate(doc)
    assert openapi_document([])["paths"] == {}


def test_openapi_paths_are_exactly_the_apps_routes():
    from duetime.gateway.observe.openapi import openapi_document

    async def go() -> tuple[set[str], set[str]]:
        async with gateway(config()) as (svc, c):
            doc = (await c.get("/openapi.json")).json()
            app = svc.server.config.app  # the FastRoutes app; its Starlette app's routes
            # (every API route; pages and event streams are left out of the document)
            routes = {r.path for r in app.app.router.routes
                      if getattr(r, "include_in_schema", False)}
            assert {"/dashboard", "/playground", "/static"} <= {
                r.path for r in app.app.router.routes} - routes
            return set(doc["paths"]), {re.sub(r"{([^}:]+)(?::[^}]*)?}", r"{\1}", p)
                                       for p in routes}

    documented, routes = run(go())
    assert documented == routes
    # a route not described still gets an entry; a path parameter is declared
    from starlette.routing import Route as R

    async def h(request: Request) -> JSONResponse:
        return JSONResponse({})

    doc = openapi_document([R("/x/{name}", h, methods=["GET"])])
    op = doc["paths"]["/x/{name}"]["get"]
    assert op["parameters"][0] == {"name": "name", "in": "path", "required": True,
                                   "schema": {"type": "string"}}


# -- the drain timeout ----------------------------------------------------------------------------

def test_drain_timeout_ends_open_streams_with_an_error_event_and_exits_non_zero(tmp_path):
    """``duetime serve`` with a slow instance: a stream still open at the drain timeout gets a
    final error event, and the process exits 3."""
    drain = 1.0
    pool = tmp_path / "pool.yaml"
    pool.write_text(json.dumps(config(instances=[{
        "name": "a", "model": "big", "profile": "qwen3-0.6b", "emulate": {"speed": 0.02},
        "price_usd_per_mtok": PRICE}])))
    proc, url = start_serve(["--config", str(pool), "--drain-timeout", str(drain),
                             "--log-level", "warning"], timeout_s=120)
    try:
        events: list[bytes] = []
        with httpx.Client(timeout=drain + 30) as c, c.stream(
                "POST", f"{url}/v1/chat/completions",
                json=chat(max_tokens=2000, stream=True)) as r:
            assert r.status_code == 200
            buf = b""
            signalled = False
            for chunk in r.iter_bytes():
                buf += chunk
                *done, buf = buf.split(b"\n\n")
                events.extend(done)
                if events and not signalled:  # the stream is under way: stop the server
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
        out, err = proc.communicate(timeout=drain + 30)
        assert proc.returncode == 3, err
        assert "cut" in out and "Traceback" not in err
        last = json.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["code"] == "server_shutdown"
        assert b"[DONE]" not in b"".join(events)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_drain_that_finishes_in_time_cuts_nothing():
    async def go() -> tuple[int, httpx.Response]:
        svc = await Service(pool_from_dict(config(), "t"), drain_timeout_s=5.0).start()
        async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
            r = await c.post("/v1/chat/completions", json=chat())
        return await svc.stop(), r

    cut, r = run(go())
    assert r.status_code == 200 and cut == 0


def test_a_stream_cut_at_the_drain_timeout_is_counted_as_a_503_not_a_disconnect():
    """In-process: a stream still open at the drain timeout ends with the server_shutdown
    event and is counted under status 503; no client disconnect is counted."""
    drain = 0.5
    cfg = config(instances=[{"name": "a", "model": "big", "profile": "qwen3-0.6b",
                             "emulate": {"speed": 0.02}, "price_usd_per_mtok": PRICE}])

    async def go() -> tuple[int, list[bytes], Any]:
        svc = await Service(pool_from_dict(cfg, "t"), drain_timeout_s=drain).start()
        metrics = svc.gateway.metrics
        events: list[bytes] = []
        async with httpx.AsyncClient(base_url=svc.url, timeout=drain + 30) as c, c.stream(
                "POST", "/v1/chat/completions", json=chat(max_tokens=2000, stream=True)) as r:
            stopping = None
            buf = b""
            async for chunk in r.aiter_bytes():
                buf += chunk
                *done, buf = buf.split(b"\n\n")
                events.extend(done)
                if events and stopping is None:
                    stopping = asyncio.create_task(svc.stop())
        return await stopping, events, metrics

    cut, events, metrics = run(go())
    assert cut == 1
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "server_shutdown"
    value = metrics.registry.get_sample_value
    assert value("duetime_requests_total", {"route": "chat", "status": "503"}) == 1
    assert value("duetime_requests_total", {"route": "chat", "status": "499"}) is None
    assert value("duetime_client_disconnects_total") == 0
