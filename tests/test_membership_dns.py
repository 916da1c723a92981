"""DNS groups against a real DNS server (dnsmasq on loopback): an instance entry whose host is
a name is a group of replicas, one member per address, looked up again every
``discovery.dns_interval_s``. Replicas are emulators on 127.0.0.2, .3, .4 (one port: the
group's URL names it), as the pods behind a headless Service."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dns_server import DnsServer
from duetime.emulator import create_app
from duetime.emulator.options import EmulatorOptions
from duetime.engine.profiles import load_profile
from duetime.gateway.state.membership import Phase
from duetime.service import Service, pool_from_dict
from duetime.web.server import AppServer
from test_membership import PRICE, chat, config, inst, run, wait_for

ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[DnsServer]:
    server = DnsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def shared_port() -> int:
    """A TCP port free on every address in ADDRESSES."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ADDRESSES[0], 0))
            port = s.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for a in ADDRESSES:
                    t = stack.enter_context(socket.socket())
                    t.bind((a, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


@contextlib.asynccontextmanager
async def replicas(port: int):
    """An emulator of model ``big`` at each address, on ``port``."""
    servers = []
    try:
        for k, a in enumerate(ADDRESSES):
            emu = EmulatorOptions(speed=4.0, seed=k).emulator(load_profile("qwen3-0.6b"), "big")
            servers.append((await AppServer(create_app(emu), host=a, port=port).start(), emu))
        yield
    finally:
        for server, emu in servers:
            await server.stop(force=True)
            await emu.close()


def group_config(dns: DnsServer, port: int, **kw: Any) -> dict[str, Any]:
    g = {"name": "g", "model": "big", "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE,
         "url": f"http://pool.test:{port}", "discover": "dns"}
    return config(inst("s", "small"), g, discovery={
        "dns_servers": [dns.address], "dns_interval_s": 0.1, "watch_s": 0}, **kw)


def test_dns_group_follows_its_addresses(dns: DnsServer):
    """Two addresses: two members, both served; the record moves to .3 and .4: .2 drains and
    leaves, .4 joins and serves; no address: all drain (503); the server down: members
    kept."""
    async def main() -> None:
        port = shared_port()
        dns.set("pool.test", ADDRESSES[:2])
        async with replicas(port):
            svc = await Service(pool_from_dict(group_config(dns, port), "dns.yaml")).start()
            gw = svc.gateway
            assert gw is not None
            try:
                async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                    want = {"g@127.0.0.2", "g@127.0.0.3"}
                    assert await wait_for(lambda: {s.name for s in gw.membership.serving} ==
                                          want | {"s"})
                    assert {await chat(c) for _ in range(4)} == want
                    dns.set("pool.test", ADDRESSES[1:])
                    assert await wait_for(lambda: gw.membership.get("g@127.0.0.2") is None)
                    assert await wait_for(lambda: getattr(gw.membership.get("g@127.0.0.4"),
                                                          "phase", None) is Phase.SERVING)
                    assert {await chat(c) for _ in range(4)} == {"g@127.0.0.3", "g@127.0.0.4"}
                    body = (await c.get("/duetime/instances")).json()
                    changes = [(x["change"], x["instance"]) for x in
                               body["membership"]["recent"]]
                    assert ("drain", "g@127.0.0.2") in changes
                    assert ("join", "g@127.0.0.4") in changes
                    dns.stop()  # (lookups fail: the members stay)
                    await asyncio.sleep(0.5)
                    assert {s.name for s in gw.membership.serving} == {
                        "s", "g@127.0.0.3", "g@127.0.0.4"}
                    dns.start()
                    dns.set("pool.test", [])
                    assert await wait_for(lambda: [s.name for s in gw.instances] == ["s"])
                    r = await c.post("/v1/chat/completions", json={
                        "model": "big", "messages": [{"role": "user", "content": "x"}]})
                    assert r.status_code == 404  # (no member of model big is left)
            finally:
                await svc.stop()

    run(main())
