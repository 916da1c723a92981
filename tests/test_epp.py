"""``duetime epp``: the endpoint picker's ext_proc protocol, with a grpcio client playing
Envoy's side of the stream against a picker started in-process over emulated instances.

Each test starts a :class:`~duetime.service.epp.PickerService` (the gateway's live state, the
embedded emulators on loopback, the gRPC server on an ephemeral port) inside ``asyncio.run``
with an overall timeout. Instances: ``a`` serves model ``big`` (higher accuracy: preferred by
utility), ``b`` serves ``small`` (faster). Nothing here assumes the machine's speed: waits are
polls with generous limits, and no duration is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc  # (the test extra installs it: a missing grpcio fails here, it is not skipped)
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from duetime.gateway import pool_from_dict
from duetime.gateway.picker.messages import CHUNK_BYTES
from duetime.service import Service
from duetime.service.epp import PickerService
from test_gateway import long_streams

MODE = processing_mode_pb2.ProcessingMode
PRICE = {"prompt": 0.1, "output": 0.3}
DEST = "x-gateway-destination-endpoint"


def run(coro: Awaitable[Any], timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def config(**kw: Any) -> dict[str, Any]:
    a = {"name": "a", "model": "big", "profile": "qwen3-8b", "emulate": {"speed": 2.0},
         "price_usd_per_mtok": PRICE}
    b = {"name": "b", "model": "small", "profile": "qwen3-0.6b",
         "emulate": {"speed": 2.0, "seed": 1}, "price_usd_per_mtok": PRICE}
    d: dict[str, Any] = {
        "policy": "sfs",
        "quality": {"workload": None, "tasks": {"chat": {"big": 0.9, "small": 0.5}}},
        "instances": [a, b],
        "health": {"interval_s": 0.2},
        "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0},
    }
    d.update(kw)
    return d


@contextlib.asynccontextmanager
async def picker(cfg: dict[str, Any] | None = None, fallbacks: int = 0
                 ) -> AsyncIterator[tuple[PickerService, pb_grpc.ExternalProcessorStub]]:
    svc = await PickerService(pool_from_dict(cfg or config(), "test"), host="127.0.0.1",
                              port=0, fallbacks=fallbacks).start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            yield svc, pb_grpc.ExternalProcessorStub(ch)
    finally:
        await svc.stop(0)


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **kw}


def request_headers(path: str = "/v1/chat/completions", *, eos: bool = False,
                    extra: dict[str, str] | None = None, mode: int | None = None,
                    subset: list[str] | None = None) -> pb.ProcessingRequest:
    hs = {":method": "POST" if not eos else "GET", ":path": path, ":authority": "gw",
          "content-type": "application/json", **(extra or {})}
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in hs.items()]),
        end_of_stream=eos))
    m = MODE.FULL_DUPLEX_STREAMED if mode is None else mode
    msg.protocol_config.request_body_mode = m
    msg.protocol_config.response_body_mode = m
    if subset is not None:
        hint = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
    return msg


def body(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def response_headers(status: int = 200, ctype: str = "text/event-stream",
                     served: str | None = None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                 base_pb2.HeaderValue(key="content-type", raw_value=ctype.encode())])))
    if served is not None:
        lb = msg.metadata_context.filter_metadata["envoy.lb"]
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
    return msg


def response_body(data: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=eos))


def set_headers(resp: pb.ProcessingResponse, phase: str = "request_headers") -> dict[str, str]:
    common = getattr(resp, phase).response
    return {h.header.key: h.header.raw_value.decode()
            for h in common.header_mutation.set_headers}


def metadata_endpoint(resp: pb.ProcessingResponse) -> str:
    lb: struct_pb2.Struct = resp.dynamic_metadata.fields["envoy.lb"].struct_value
    return lb.fields[DEST].string_value


def endpoints(svc: PickerService) -> dict[str, str]:
    """Instance name -> ip:port, from the instance URLs (what the picker must answer)."""
    return {i.name: i.url.removeprefix("http://").rstrip("/") for i in svc.pool.instances}


async def read(call: Any, n: int) -> list[pb.ProcessingResponse]:
    return [await call.read() for _ in range(n)]


async def wait_for(cond, timeout: float = 10.0) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def route(stub, payload: bytes, *, chunks: int = 1, **kw: Any
                ) -> tuple[Any, list[pb.ProcessingResponse]]:
    """Send request headers and the body (in ``chunks`` pieces): the call and the picker's
    answers up to the body's end (headers answer, then the body back)."""
    call = stub.Process()
    await call.write(request_headers(**kw))
    step = max(1, -(-len(payload) // chunks))
    pieces = [payload[i:i + step] for i in range(0, len(payload), step)]
    for i, piece in enumerate(pieces):
        await call.write(body(piece, eos=i == len(pieces) - 1))
    first = await call.read()
    if first.HasField("immediate_response"):
        return call, [first]
    out = [first]
    while True:  # the body comes back, up to its end of stream
        r = await call.read()
        out.append(r)
        if r.request_body.response.body_mutation.streamed_response.end_of_stream:
            return call, out


# -- routing ----------------------------------------------------------------------------------


def test_completion_routed_then_response_phases_feed_the_replica():
    async def go():
        async with picker() as (svc, stub):
            eps = endpoints(svc)
            raw = json.dumps(chat(stream=True)).encode()
            call, out = await route(stub, raw)
            hdr, back = out[0], out[1:]
            assert hdr.HasField("request_headers")
            sets = set_headers(hdr)
            ep = sets[DEST]
            assert ep in eps.values()
            assert metadata_endpoint(hdr) == ep  # the same value both ways
            assert hdr.request_headers.response.clear_route_cache
            name = next(n for n, e in eps.items() if e == ep)
            inst = next(s for s in svc.gateway.instances if s.name == name)
            # the body goes back to Envoy, its model the one the instance serves
            sent = b"".join(r.request_body.response.body_mutation.streamed_response.body
                            for r in back)
            assert json.loads(sent)["model"] == inst.instance.served_model
            assert int(sets["content-length"]) == len(sent)
            # in flight: in the ledger and the shadow replica
            assert len(inst.flights) == 1 and not inst.shadow.idle
            flight = next(iter(inst.flights.values()))
            assert flight.first_token is None

            # play the upstream: the real instance's stream, relayed through the picker
            await call.write(response_headers())
            rh = await call.read()
            assert set_headers(rh, "response_headers")["x-duetime-instance"] == name
            async with httpx.AsyncClient(timeout=20) as c, c.stream(
                    "POST", f"http://{ep}/v1/chat/completions", content=sent,
                    headers={"content-type": "application/json"}) as r:
                got = b""
                async for chunk in r.aiter_raw():
                    await call.write(response_body(chunk))
                    echo = await call.read()
                    sr = echo.response_body.response.body_mutation.streamed_response
                    assert sr.body == chunk and not sr.end_of_stream
                    got += chunk
                    assert flight.first_token is not None  # (from the first chunk)
            assert got.rstrip().endswith(b"data: [DONE]")
            assert flight.tokens >= 1
            assert len(inst.flights) == 1  # (the end of stream has not come yet)
            await call.write(response_body(b"", eos=True))
            last = await call.read()
            assert last.response_body.response.body_mutation.streamed_response.end_of_stream
            assert not inst.flights and inst.shadow.idle
            await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
            assert (await call.read()).HasField("response_trailers")
            await call.done_writing()
            stats = inst.ledger.stats(time.monotonic())
            assert stats.e2e_count == 1 and stats.output_tokens_sum == 4  # (usage-free: SSE)

    run(go())


def test_body_in_several_chunks_and_large_bodies_come_back_whole():
    async def go():
        async with picker() as (svc, stub):
            raw = json.dumps(chat("several chunks " * 20)).encode()
            _, out = await route(stub, raw, chunks=4)
            assert out[0].HasField("request_headers") and len(out) == 2
            # a named model is not rewritten: the body comes back byte for byte, in chunks
            # of at most CHUNK_BYTES, only the last one ending the stream
            padded = json.dumps({**chat(), "model": "small"}).encode() + b" " * (
                2 * CHUNK_BYTES + 10)
            _, out = await route(stub, padded, chunks=5)
            back = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
            assert b"".join(s.body for s in back) == padded
            assert len(back) == 3 and all(len(s.body) <= CHUNK_BYTES for s in back)
            assert [s.end_of_stream for s in back] == [False, False, True]
            assert set_headers(out[0])[DEST] == endpoints(svc)["b"]

    run(go())


@pytest.mark.parametrize("target_ms", [None, "1"])
def test_choice_matches_the_gateway(target_ms):
    """The picker and ``duetime serve`` over the same idle pool choose the same instance (a
    loose target: the better model; an impossible one: the fastest forecast)."""
    extra = {} if target_ms is None else {"x-duetime-ttft-ms": target_ms}

    async def go():
        svc = await Service(pool_from_dict(config(), "test")).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                r = await c.post("/v1/chat/completions", json=chat(), headers=extra)
                assert r.status_code == 200
                by_gateway = r.headers["x-duetime-instance"]
        finally:
            await svc.stop()
        async with picker() as (psvc, stub):
            call, out = await route(stub, json.dumps(chat()).encode(), extra=extra)
            ep = set_headers(out[0])[DEST]
            assert ep == endpoints(psvc)[by_gateway]
            call.cancel()

    run(go())


def test_fallbacks_follow_the_choice_and_serve_the_same_model():
    """With --fallbacks, the destination is the protocol's list: the chosen endpoint, then the
    other instances of its model (never another model's: the body names the model); when the
    data plane reports it served a fallback, the attempt moves there."""
    cfg = config()
    cfg["instances"].append({**cfg["instances"][0], "name": "c",
                             "emulate": {"speed": 2.0, "seed": 2}})

    async def go():
        async with picker(cfg, fallbacks=2) as (svc, stub):
            eps = endpoints(svc)
            call, out = await route(stub, json.dumps(chat(model="big")).encode())
            dest = set_headers(out[0])[DEST]
            assert metadata_endpoint(out[0]) == dest
            first, *rest = dest.split(",")
            assert {first, *rest} == {eps["a"], eps["c"]} and len(rest) == 1
            chosen = next(s for s in svc.gateway.instances if eps[s.name] == first)
            other = next(s for s in svc.gateway.instances if eps[s.name] == rest[0])
            assert len(chosen.flights) == 1 and not other.flights
            await call.write(response_headers(served=rest[0]))
            await call.read()
            moved = await wait_for(lambda: len(other.flights) == 1 and not chosen.flights)
            call.cancel()
            # model auto: the fallbacks serve the chosen instance's model, and no other
            call, out = await route(stub, json.dumps(chat()).encode())
            first, *rest = set_headers(out[0])[DEST].split(",")
            call.cancel()
            return moved, first, rest, eps

    moved, first, rest, eps = run(go())
    assert moved
    same = {"a": [eps["c"]], "c": [eps["a"]], "b": []}
    assert rest == same[next(n for n, e in eps.items() if e == first)]


def test_headers_only_requests_go_round_robin():
    async def go():
        async with picker() as (svc, stub):
            seen = set()
            for _ in range(4):
                call = stub.Process()
                await call.write(request_headers("/v1/models", eos=True))
                r = await call.read()
                ep = set_headers(r)[DEST]
                assert metadata_endpoint(r) == ep
                seen.add(ep)
                await call.done_writing()
            assert seen == set(endpoints(svc).values())
            assert all(not s.flights for s in svc.gateway.instances)

    run(go())


def test_buffered_mode_answers_headers_then_routes_on_the_body():
    async def go():
        async with picker() as (svc, stub):
            call = stub.Process()
            await call.write(request_headers(mode=MODE.BUFFERED))
            first = await call.read()
            assert first.HasField("request_headers")
            assert not first.request_headers.response.header_mutation.set_headers
            raw = json.dumps(chat()).encode()
            await call.write(body(raw))
            r = await call.read()
            assert r.HasField("request_body")
            ep = set_headers(r, "request_body")[DEST]
            assert ep in endpoints(svc).values() and metadata_endpoint(r) == ep
            new = r.request_body.response.body_mutation.body
            assert json.loads(new)["model"] in ("big", "small")
            call.cancel()

    run(go())


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "status", "code"), [
    (b"not json", 400, None),
    (json.dumps({"model": "auto"}).encode(), 400, None),
    (json.dumps({**chat(), "model": "nope"}).encode(), 404, "model_not_found"),
])
def test_bad_requests_get_an_immediate_openai_error(raw, status, code):
    async def go():
        async with picker() as (svc, stub):
            _, out = await route(stub, raw)
            ir = out[0].immediate_response
            assert out[0].HasField("immediate_response") and ir.status.code == status
            err = json.loads(ir.body)["error"]
            assert set(err) == {"message", "type", "param", "code"}
            if code is not None:
                assert err["code"] == code
            hs = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
            assert hs["content-type"] == b"application/json"
            assert all(not s.flights for s in svc.gateway.instances)

    run(go())


def test_no_healthy_endpoint_is_a_503():
    cfg = config(health={"interval_s": 60, "fail_open": False})

    async def go():
        async with picker(cfg) as (svc, stub):
            # a subset hint naming no instance of the pool
            _, out = await route(stub, json.dumps(chat()).encode(), subset=["10.9.9.9:1"])
            assert out[0].immediate_response.status.code == 503
            call = stub.Process()
            await call.write(request_headers("/v1/models", eos=True, subset=["10.9.9.9:1"]))
            assert (await call.read()).immediate_response.status.code == 503
            # a subset hint naming one: the choice stays in it
            b = endpoints(svc)["b"]
            call, out = await route(stub, json.dumps(chat()).encode(), subset=[b])
            assert set_headers(out[0])[DEST] == b
            call.cancel()
            # the only instance of the model asked for is out of rotation (the pool never
            # empties: at most half of it is ejected)
            next(s for s in svc.gateway.instances if s.name == "b").health.eject("test")
            _, out = await route(stub, json.dumps({**chat(), "model": "small"}).encode())
            ir = out[0].immediate_response
            assert ir.status.code == 503
            assert json.loads(ir.body)["error"]["code"] == "no_healthy_instance"
            assert all(not s.flights for s in svc.gateway.instances)

    run(go())


def test_a_cancelled_stream_leaves_the_replica():
    async def go():
        async with picker() as (svc, stub):
            call, out = await route(stub, json.dumps(chat()).encode())
            ep = set_headers(out[0])[DEST]
            name = next(n for n, e in endpoints(svc).items() if e == ep)
            inst = next(s for s in svc.gateway.instances if s.name == name)
            assert len(inst.flights) == 1 and not inst.shadow.idle
            call.cancel()
            assert await wait_for(lambda: not inst.flights and inst.shadow.idle)

    run(go())


def test_an_upstream_error_ends_the_flight():
    async def go():
        async with picker() as (svc, stub):
            call, _ = await route(stub, json.dumps(chat()).encode())
            insts = [s for s in svc.gateway.instances if s.flights]
            assert len(insts) == 1
            await call.write(response_headers(503, "application/json"))
            await call.read()
            assert not insts[0].flights and insts[0].health.failures == 1
            await call.done_writing()

    run(go())


# -- health -----------------------------------------------------------------------------------


def test_grpc_health_checks():
    async def go():
        async with picker() as (svc, _), grpc.aio.insecure_channel(
                f"127.0.0.1:{svc.port}") as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            for name in ("", "liveness", "readiness",
                         "envoy.service.ext_proc.v3.ExternalProcessor"):
                raw = b"" if not name else b"\x0a" + bytes([len(name)]) + name.encode()
                assert await check(raw) == b"\x08\x01"  # SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await check(b"\x0a\x03abc")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

    run(go())


def test_cli_help_and_store_option(capsys):
    from duetime.cli import main
    from duetime.gateway.config import ConfigError

    assert main(["epp", "--help"]) == 0
    assert "x-gateway-destination-endpoint" in capsys.readouterr().out
    pool = pool_from_dict(config(), "test")
    assert pool.with_store("memory").state.store is None
    assert pool.with_store("redis://127.0.0.1:1/0").state.store == "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError, match="--store 'http://x'"):
        pool.with_store("http://x")
    assert main(["epp", "--config", "nope.yaml", "--store", "http://x"]) != 0


def test_the_picker_and_a_gateway_replica_share_live_state(redis_server):
    """A ``duetime serve`` replica sends eight long prompts to a; the picker, on the same
    Redis, holds them in its replica of a and sends a 100 ms chat to b."""
    n_long = 8

    async def go():
        cfg = config(state={"source": "shadow", "store": redis_server.url,
                            "store_sync_s": 0.01})
        cfg["instances"][0]["emulate"] = {"speed": 1.0}
        async with picker(cfg) as (psvc, stub):
            pool = dataclasses.replace(psvc.pool, instances=tuple(
                dataclasses.replace(i, emulate=None) for i in psvc.pool.instances))
            gw = await Service(pool).start()
            try:
                async with httpx.AsyncClient(base_url=gw.url, timeout=20) as c:
                    tasks = long_streams(c, n_long)
                    a = psvc.gateway.instances[0]
                    assert await wait_for(lambda: len(a.remote_flights) == n_long)
                    call, out = await route(stub, json.dumps(chat()).encode(),
                                            extra={"x-duetime-ttft-ms": "100"})
                    still_busy = not any(t.done() for t in tasks)
                    call.cancel()
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    assert still_busy, "premise: a's long prompts should outlast the choice"
                    assert set_headers(out[0])[DEST] == endpoints(psvc)["b"]
                    assert await wait_for(lambda: not a.remote_flights)
            finally:
                await gw.stop()

    run(go(), 90.0)


def test_the_picker_exports_the_desired_replica_signal():
    """Requests the picker routes size their model in its autoscaler's signal, on its metrics
    port: ``/duetime/replicas`` and ``duetime_desired_replicas`` (the test ticks itself)."""
    async def go():
        port = _free_port()
        cfg = config(autoscale={"interval_s": 3600, "capacity": {"big": 1 / 3600},
                                "params": {"utilization": 1.0, "window": 1}})
        cfg["instances"] = cfg["instances"][:1]
        cfg["quality"]["tasks"]["chat"] = {"big": 0.9}
        svc = await PickerService(pool_from_dict(cfg, "test"), host="127.0.0.1", port=0,
                                  metrics_port=port).start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
                stub = pb_grpc.ExternalProcessorStub(ch)
                for _ in range(3):
                    call, out = await route(stub, json.dumps(chat()).encode())
                    assert set_headers(out[0])[DEST]
                    call.cancel()
            assert svc.gateway.replicas.tick() == {"big": 3}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
                got = (await c.get("/duetime/replicas")).json()["last"]
                assert got["desired"] == {"big": 3} and got["models"]["big"]["routed"] == 3
                assert 'duetime_desired_replicas{model="big"} 3.0' in (
                    await c.get("/metrics")).text
        finally:
            await svc.stop(0)

    run(go())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
