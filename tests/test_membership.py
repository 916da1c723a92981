"""Membership while serving: instances added, removed and changed through the pool config
(applied directly, by the file watch and by SIGHUP), joining out of rotation until a health
probe passes, draining with their streams finishing, refused configs keeping the running pool,
and what ``/duetime/instances`` and ``/metrics`` say of it. Real emulators on loopback."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from duetime.gateway.changes import check_live, group_members, instance_changes, members_of, moved
from duetime.gateway.config import ConfigError
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.membership import Membership, Phase
from duetime.service import Service, pool_from_dict
from duetime.service.config_watch import ConfigWatch

PRICE = {"prompt": 0.1, "output": 0.3}


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def inst(name: str, model: str = "big", seed: int = 0, **kw: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "profile": "qwen3-0.6b",
            "emulate": {"speed": 4.0, "seed": seed}, "price_usd_per_mtok": PRICE, **kw}


def config(*instances: dict[str, Any], **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "policy": "round-robin",
        "quality": {"workload": None, "tasks": {"chat": {"big": 0.9, "small": 0.5}}},
        "instances": list(instances),
        "health": {"interval_s": 0.2},
        "discovery": {"watch_s": 0.1},
    }
    d.update(kw)
    return d


async def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


async def chat(c: httpx.AsyncClient, model: str = "big", tokens: int = 4) -> str:
    """One streamed chat read to its end; the instance that served it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens, "stream": True}
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        text = (await r.aread()).decode()
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text
    return r.headers["x-duetime-instance"]


# -- the pieces ---------------------------------------------------------------------------------

def test_instance_changes_and_what_may_change_live():
    old = pool_from_dict(config(inst("a"), inst("b", "small", 1)), "old.yaml")
    new = pool_from_dict(config(inst("b", "small", 1, request_overhead_ms=5),
                                inst("c", seed=2)), "new.yaml")
    ch = instance_changes(list(old.instances), list(new.instances))
    assert [i.name for i in ch.added] == ["c"] and ch.removed == ["a"]
    assert [i.name for i in ch.changed] == ["b"]
    assert ch.describe() == "added c; removed a; changed b"
    check_live(old, new)  # (instances only: fine)
    with pytest.raises(ConfigError, match=r"new.yaml: policy changed: that needs a restart"):
        check_live(old, pool_from_dict(config(inst("a"), policy="sfs"), "new.yaml"))
    with pytest.raises(ConfigError, match="instance 'a': its model changed"):
        check_live(old, pool_from_dict(config(inst("a", "small")), "new.yaml"))
    with pytest.raises(ConfigError, match="instance 'a': its emulate setting changed"):
        check_live(old, pool_from_dict(config({**inst("a"), "emulate": {"speed": 2.0}}),
                                       "new.yaml"))


def test_dns_groups_expand_to_one_member_per_address():
    pool = pool_from_dict(config(inst("a"), {
        "name": "g", "model": "small", "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE,
        "url": "http://vllm.test:8000/", "discover": "dns"}), "p.yaml")
    g = pool.instances[1]
    ms = group_members(g, [(a, a, None) for a in ("10.0.0.2", "fd00::1", "10.0.0.1")])
    assert [m.name for m in ms] == ["g@10.0.0.1", "g@10.0.0.2", "g@fd00::1"]
    assert [m.url for m in ms] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000",
                                   "http://[fd00::1]:8000"]
    assert all(m.discover == "none" and m.model == "small" for m in ms)
    assert [i.name for i in members_of(pool, {})] == ["a"]  # (not looked up yet: none)
    assert moved(ms[0], ms[1]) and not moved(ms[0], ms[0])
    pod = group_members(g, [("pod-1", "10.0.0.9", 9000)])[0]  # (an InferencePool's pod)
    assert (pod.name, pod.url) == ("g@pod-1", "http://10.0.0.9:9000")


@pytest.mark.parametrize("entry, error", [
    ({"url": "http://10.0.0.1:8000"}, "discover: dns needs a host name in the url"),
    ({"url": "http://x.test", "kv_events": "tcp://x.test:5557"}, "kv_events: not for a group"),
    ({"url": "http://x.test", "name": "g@1"}, "name: a group's name may not contain"),
])
def test_dns_group_config_errors(entry, error):
    g = {"name": "g", "model": "small", "profile": "qwen3-0.6b", "price_usd_per_mtok": PRICE,
         "discover": "dns", **entry}
    with pytest.raises(ConfigError, match=error):
        pool_from_dict(config(inst("a"), g), "p.yaml")
    with pytest.raises(ConfigError, match="a DNS server is an IP address"):
        pool_from_dict(config(inst("a"), discovery={"dns_servers": ["dns.test"]}), "p.yaml")


def test_membership_phases_and_indexes():
    class S:  # (what Membership reads of an instance)
        def __init__(self, name: str, model: str) -> None:
            self.name, self.model, self.phase = name, model, Phase.SERVING
            self.instance = type("I", (), {"url": f"http://{name}"})()

    m = Membership([S("a", "big")], GatewayMetrics())  # type: ignore[list-item]
    seen: list[tuple[str, str]] = []
    m.listeners.append(lambda c, s: seen.append((c.change, s.name)))
    b = S("b", "small")
    m.join(b, "config")  # type: ignore[arg-type]
    assert m.by_model == {"big": [m.get("a")], "small": []}  # (joining: a 503, not a 404)
    m.ready(b)  # type: ignore[arg-type]
    assert [s.name for s in m.serving] == ["a", "b"] and m.by_model["small"] == [b]
    m.drain(m.get("a"), "config")  # type: ignore[arg-type]
    assert "big" not in m.by_model and [s.name for s in m.serving] == ["b"]
    m.leave(m.get("a"))  # type: ignore[arg-type]
    assert len(m) == 1 and seen == [("join", "b"), ("ready", "b"), ("drain", "a"),
                                    ("leave", "a")]
    assert m.describe()["phases"] == {"joining": [], "serving": ["b"], "draining": []}
    with pytest.raises(ValueError, match="a member already"):
        m.join(b, "config")  # type: ignore[arg-type]


# -- live ---------------------------------------------------------------------------------------

def test_added_instance_joins_after_its_probe_and_removed_one_drains():
    """c is added while a streams: it joins out of rotation, is ready once its /health
    passes and then gets requests; a is removed with a long stream open: it gets no new
    request, its stream ends whole, then it leaves and its emulator stops."""
    async def main() -> None:
        cfg = config(inst("a"), inst("b", "small", 1))
        svc = await Service(pool_from_dict(cfg, "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                assert await chat(c) == "a"
                long = asyncio.create_task(chat(c, tokens=400))
                assert await wait_for(lambda: len(gw.membership.get("a").ledger) == 1)
                changes = await svc.reload(pool_from_dict(config(
                    inst("b", "small", 1), inst("c", seed=2)), "test.yaml"), gw)
                assert changes.describe() == "added c; removed a"
                a, cc = gw.membership.get("a"), gw.membership.get("c")
                assert a.phase is Phase.DRAINING and cc is not None
                assert await wait_for(lambda: cc.phase is Phase.SERVING)
                served = {await chat(c) for _ in range(4)}
                assert served == {"c"}  # (a drains: not a candidate)
                assert await long == "a"  # (its stream finished whole)
                assert await wait_for(lambda: gw.membership.get("a") is None)
                assert await wait_for(lambda: "a" not in svc.emulator_servers)
                r = await c.get("/duetime/instances")
                body = r.json()
                assert [i["name"] for i in body["instances"]] == ["b", "c"]
                assert all(i["phase"] == "serving" for i in body["instances"])
                recent = [(x["change"], x["instance"]) for x in body["membership"]["recent"]]
                assert recent == [("join", "c"), ("drain", "a"), ("ready", "c"), ("leave", "a")]
                metrics = (await c.get("/metrics")).text
                for change in ("join", "ready", "drain", "leave"):
                    assert f'duetime_membership_changes_total{{change="{change}"}} 1.0' in metrics
                assert 'duetime_instances{phase="serving"} 2.0' in metrics
                assert 'duetime_instance_healthy{instance="a"}' not in metrics
        finally:
            await svc.stop()

    run(main())


def test_joining_instance_stays_out_until_its_health_passes():
    """An added instance that does not answer its health probe yet (nothing listens at its
    URL: a server still starting) gets nothing; a model whose only instance is joining answers
    503, not 404."""
    async def main() -> None:
        svc = await Service(pool_from_dict(config(inst("a")), "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                # d: a URL nothing listens on yet (an instance still starting)
                import socket
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
                sock.close()
                d = {"name": "d", "model": "small", "profile": "qwen3-0.6b",
                     "price_usd_per_mtok": PRICE, "url": f"http://127.0.0.1:{port}"}
                await svc.reload(pool_from_dict(config(inst("a"), d), "test.yaml"), gw)
                await asyncio.sleep(0.5)
                assert gw.membership.get("d").phase is Phase.JOINING
                r = await c.post("/v1/chat/completions", json={
                    "model": "small", "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 503 and r.json()["error"]["code"] == \
                    "no_healthy_instance"
                assert {await chat(c, model="auto") for _ in range(3)} == {"a"}
                body = (await c.get("/duetime/instances")).json()
                d_state = next(i for i in body["instances"] if i["name"] == "d")
                assert d_state["phase"] == "joining" and d_state["last_error"]
        finally:
            await svc.stop()

    run(main())


def test_changed_instance_is_reconfigured_in_place(caplog):
    """A changed overhead reconfigures b in place (same state object, still serving); a
    config that changes the policy is refused whole: nothing changes."""
    async def main() -> None:
        cfg = config(inst("a"), inst("b", "small", 1))
        svc = await Service(pool_from_dict(cfg, "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            b = gw.membership.get("b")
            changes = await svc.reload(pool_from_dict(config(
                inst("a"), inst("b", "small", 1, request_overhead_ms=7)), "test.yaml"), gw)
            assert changes.describe() == "changed b"
            assert gw.membership.get("b") is b and b.phase is Phase.SERVING
            assert b.instance.request_overhead_s == pytest.approx(0.007)
            with pytest.raises(ConfigError, match="policy changed"):
                await svc.reload(pool_from_dict(config(inst("a"), policy="sfs"), "t.yaml"), gw)
            assert [s.name for s in gw.instances] == ["a", "b"] and gw.pool.policy == \
                "round-robin"
            assert set(svc.emulator_servers) == {"a", "b"}
        finally:
            await svc.stop()

    run(main())


def test_an_instance_added_back_while_draining_joins_again():
    """b is removed with a long stream open (draining) and added back before it left: it
    joins again (probed, then serving) instead of leaving, and its stream ends whole."""
    async def main() -> None:
        cfg = config(inst("a"), inst("b", seed=1))
        svc = await Service(pool_from_dict(cfg, "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                long = asyncio.create_task(chat(c, tokens=400))
                assert await wait_for(lambda: any(len(s.ledger) for s in gw.instances))
                busy = next(s for s in gw.instances if len(s.ledger))
                others = [inst("a"), inst("b", seed=1)]
                keep = [e for e in others if e["name"] != busy.name]
                await svc.reload(pool_from_dict(config(*keep), "test.yaml"), gw)
                assert busy.phase is Phase.DRAINING
                await svc.reload(pool_from_dict(config(*others), "test.yaml"), gw)
                assert gw.membership.get(busy.name) is busy
                assert await wait_for(lambda: busy.phase is Phase.SERVING)
                assert await long == busy.name
                await asyncio.sleep(0.3)
                assert gw.membership.get(busy.name) is busy and busy.phase is Phase.SERVING
        finally:
            await svc.stop()

    run(main())


def test_joining_replica_starts_from_its_least_corrected_sibling():
    """A new replica's TTFT correction starts at its serving siblings' least: an optimistic
    start gets it requests, from which it learns its own (a pessimistic start starved it)."""
    async def main() -> None:
        svc = await Service(pool_from_dict(config(inst("a"), inst("b", seed=1)),
                                           "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            for name, ratio in (("a", 3.0), ("b", 0.6)):
                for _ in range(8):
                    gw.membership.get(name).ttft_correction.observe(1.0, ratio)
            await svc.reload(pool_from_dict(config(inst("a"), inst("b", seed=1),
                                                   inst("c", seed=2)), "test.yaml"), gw)
            assert gw.membership.get("c").ttft_correction.factor == pytest.approx(0.6)
        finally:
            await svc.stop()

    run(main())


def test_config_file_watch_and_sighup(tmp_path: Path, caplog):
    """The file watch applies an edited file; a broken file is refused with one log line
    naming the file and the field, the pool kept; SIGHUP re-reads it."""
    async def main() -> None:
        path = tmp_path / "pool.yaml"
        cfg = config(inst("a"))
        path.write_text(yaml.safe_dump(cfg))
        svc = await Service(pool_from_dict(cfg, str(path))).start()
        gw = svc.gateway
        assert gw is not None
        from duetime.service.pool import pool_from_text
        watch = ConfigWatch(path, lambda t: pool_from_text(t, str(path)),
                            lambda p: svc.reload(p, gw),
                            watch_s=0.05, metrics=gw.metrics)
        watch.start()
        try:
            two = copy.deepcopy(cfg)
            two["instances"].append(inst("b", seed=1))
            path.write_text(yaml.safe_dump(two))
            assert await wait_for(lambda: gw.membership.get("b") is not None)
            bad = copy.deepcopy(two)
            bad["instances"][1]["url"] = "ftp://nowhere"
            del bad["instances"][1]["emulate"]
            with caplog.at_level(logging.ERROR, "duetime.gateway"):
                path.write_text(yaml.safe_dump(bad))
                assert await wait_for(lambda: any("pool config not applied" in r.message
                                                  for r in caplog.records))
            line = next(r.message for r in caplog.records if "not applied" in r.message)
            assert f"{path}: instances[1].url: must be an http(s) URL" in line
            assert [s.name for s in gw.instances] == ["a", "b"]
            # SIGHUP: the watch would not see a file it already read; the signal re-reads it
            watch.watch_s = 0
            await watch.stop()
            watch.start()
            path.write_text(yaml.safe_dump(cfg))
            os.kill(os.getpid(), signal.SIGHUP)
            assert await wait_for(lambda: gw.membership.get("b") is None or
                                  gw.membership.get("b").phase is Phase.DRAINING)
            assert await wait_for(lambda: gw.membership.get("b") is None)
            text = gw.metrics.registry.get_sample_value
            assert text("duetime_config_reloads_total", {"outcome": "refused"}) == 1
            assert text("duetime_config_reloads_total", {"outcome": "applied"}) == 2
        finally:
            await watch.stop()
            await svc.stop()

    run(main())


# -- replicas on one Redis agree ----------------------------------------------------------------

def test_replicas_on_one_store_apply_the_same_config(tmp_path: Path, redis_server):
    """Two gateway replicas on one Redis, each with its own copy of the file: the first to
    see a change applies it and the other follows through the store (its own file unchanged,
    as a ConfigMap volume that has not caught up); a refused file is not shared."""
    from duetime.emulator import create_app
    from duetime.emulator.options import EmulatorOptions
    from duetime.engine.profiles import load_profile
    from duetime.service.pool import pool_from_text
    from duetime.web.server import AppServer

    async def main() -> None:
        servers = []
        for k in range(3):
            emu = EmulatorOptions(speed=4.0, seed=k).emulator(load_profile("qwen3-0.6b"), "big")
            servers.append((await AppServer(create_app(emu), host="127.0.0.1", port=0).start(),
                            emu))
        urls = [s.url for s, _ in servers]

        def text(n: int) -> str:
            entries = [{"name": "abc"[k], "model": "big", "profile": "qwen3-0.6b",
                        "price_usd_per_mtok": PRICE, "url": urls[k]} for k in range(n)]
            return yaml.safe_dump(config(*entries, state={"store": redis_server.url},
                                         discovery={"watch_s": 0.05}))

        files = [tmp_path / "a.yaml", tmp_path / "b.yaml"]
        for f in files:
            f.write_text(text(2))
        svcs, watches = [], []
        try:
            for f in files:
                svc = await Service(pool_from_text(text(2), str(f))).start()
                gw = svc.gateway
                w = ConfigWatch(f, lambda t, f=f: pool_from_text(t, str(f)),
                                lambda p, svc=svc, gw=gw: svc.reload(p, gw), watch_s=0.05,
                                metrics=gw.metrics, shared=gw.shared.pool_config)
                w.start()
                svcs.append(svc)
                watches.append(w)
            await asyncio.sleep(0.3)  # (both subscribed)
            files[0].write_text(text(3))
            b = svcs[1].gateway
            assert await wait_for(lambda: getattr(b.membership.get("c"), "phase", None)
                                  is Phase.SERVING)
            assert files[1].read_text() == text(2)
            files[0].write_text(text(3).replace("round-robin", "sfs"))  # (refused by a)
            await asyncio.sleep(0.5)
            assert b.pool.policy == "round-robin"
            get = b.metrics.registry.get_sample_value
            assert get("duetime_config_reloads_total", {"outcome": "applied"}) == 1
            assert get("duetime_config_reloads_total", {"outcome": "refused"}) is None
        finally:
            for w in watches:
                await w.stop()
            for svc in svcs:
                await svc.stop()
            for server, emu in servers:
                await server.stop(force=True)
                await emu.close()

    run(main())
