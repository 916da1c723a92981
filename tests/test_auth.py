"""API keys, per-key limits, admin keys and the embedded emulators' control token.

The limits run on an injected clock (a constant, or one the test moves), so no test sleeps or
assumes a machine's speed. The gateway tests run the real service (gateway and embedded
emulators) on loopback, as tests/test_gateway.py does.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from duetime.cli import main
from duetime.gateway import ConfigError, pool_from_dict
from duetime.gateway.app import Gateway
from duetime.gateway.intake.auth import Auth, KeyMetering, RateLimited
from duetime.gateway.intake.ratelimit import Draw, Limiter, MemoryLimitStore
from duetime.gateway.keys import AuthConfig, key_digest, new_key
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.lifecycle import Attempt, Lifecycle, Outcome
from duetime.web.access import bearer, is_loopback
from duetime.web.asgi import Scope
from duetime.web.errors import ApiError
from test_gateway import gateway

PRICE = {"prompt": 0.1, "output": 0.3}
QUALITY = {"workload": None, "tasks": {"chat": {"big": 0.9, "small": 0.5}}}
ALICE, BOB, CAROL, ROOT = new_key(), new_key(), new_key(), new_key()


def run(coro: Any, timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def admit(auth: Auth, *args: Any) -> Any:
    return asyncio.run(auth.admit(*args))


def write(path: Path, entries: Any) -> str:
    path.write_text(yaml.safe_dump(entries))
    return str(path)


def keys_files(tmp_path: Path, **alice: Any) -> dict[str, str]:
    """alice (limits as given), bob (model small only), carol (no limits); admin root."""
    keys = write(tmp_path / "keys.yaml", [
        {"name": "alice", "sha256": key_digest(ALICE), **alice},
        {"name": "bob", "sha256": key_digest(BOB), "models": ["small"]},
        {"name": "carol", "sha256": key_digest(CAROL)}])
    admin = write(tmp_path / "admin.yaml", [{"name": "root", "sha256": key_digest(ROOT)}])
    return {"keys_file": keys, "admin_keys_file": admin}


def config(auth: dict[str, Any] | None = None, *, emulate: bool = True) -> dict[str, Any]:
    """Two instances: a (model big), b (model small); emulated, or URLs nobody listens on."""
    a: dict[str, Any] = {"name": "a", "model": "big", "profile": "qwen3-8b",
                         "price_usd_per_mtok": PRICE}
    b: dict[str, Any] = {"name": "b", "model": "small", "profile": "qwen3-0.6b",
                         "price_usd_per_mtok": PRICE}
    if emulate:
        a["emulate"] = {"speed": 4.0}
        b["emulate"] = {"speed": 4.0, "seed": 1}
    else:
        a["url"], b["url"] = "http://127.0.0.1:9", "http://127.0.0.1:9"
    d: dict[str, Any] = {"instances": [a, b], "quality": QUALITY,
                         "timeouts": {"connect_s": 1.0, "first_token_s": 10.0, "read_s": 10.0}}
    if auth is not None:
        d["auth"] = auth
    return d


def chat(model: str = "auto", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4, **kw}


def auth_header(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def scope(key: str | None = None) -> Scope:
    return {"headers": [] if key is None else [(b"authorization", f"Bearer {key}".encode())]}


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def auth_over(tmp_path: Path, clock: Clock, **alice: Any) -> Auth:
    pool = pool_from_dict(config(keys_files(tmp_path, **alice), emulate=False), "test")
    return Auth(pool.auth, CollectorRegistry(), limiter=Limiter(clock=clock))


# -- keys files ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("entries", "where", "why"), [
    ([{"name": "x", "sha256": "abc"}], "[0].sha256", "64 hex digits"),
    ([{"name": "x", "sha256": "a" * 64, "rate": 3}], "[0].rate", "unknown field"),
    ([{"name": "x", "sha256": "a" * 64}, {"name": "x", "sha256": "b" * 64}], "[1].name",
     "duplicate key name"),
    ([{"name": "x", "sha256": "a" * 64}, {"name": "y", "sha256": "A" * 64}], "[1].sha256",
     "same key"),
    ([{"name": "x", "sha256": "a" * 64, "rpm": 0}], "[0].rpm", "greater than or equal to 1"),
    ([{"name": "x", "sha256": "a" * 64, "models": ["huge"]}], "[0].models",
     "unknown model(s) ['huge']"),
    ({"keys": []}, "keys.yaml", "must be a list"),
])
def test_keys_file_errors_name_the_file_the_entry_and_the_reason(tmp_path, entries, where, why):
    path = write(tmp_path / "keys.yaml", entries)
    with pytest.raises(ConfigError) as e:
        pool_from_dict(config({"keys_file": path}, emulate=False), "pool.yaml")
    msg = str(e.value)
    assert msg.startswith(f"pool.yaml: auth.keys_file: {path}"), msg
    assert where in msg and why in msg, msg


def test_missing_keys_file_and_admin_entries_with_limits_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"auth.keys_file: .*nope.yaml: cannot read"):
        pool_from_dict(config({"keys_file": str(tmp_path / "nope.yaml")}, emulate=False), "p")
    path = write(tmp_path / "admin.yaml", [{"name": "r", "sha256": "a" * 64, "rpm": 5}])
    with pytest.raises(ConfigError, match=r"auth.admin_keys_file: .*\[0\].rpm: unknown field"):
        pool_from_dict(config({"admin_keys_file": path}, emulate=False), "p")
    with pytest.raises(ConfigError, match=r"auth.keyfile: unknown field"):
        pool_from_dict(config({"keyfile": "x"}, emulate=False), "p")


def test_keys_file_path_is_relative_to_the_pool_config(tmp_path):
    from duetime.gateway import load_pool
    write(tmp_path / "keys.json", [{"name": "alice", "sha256": key_digest(ALICE), "rpm": 7}])
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(
        config({"keys_file": "keys.json"}, emulate=False)))
    pool = load_pool(tmp_path / "pool.yaml")
    assert pool.auth is not None and pool.auth.keys is not None
    (key,) = pool.auth.keys.values()
    assert (key.name, key.rpm, key.tpm, key.models) == ("alice", 7, None, None)
    assert pool_from_dict(config(emulate=False), "p").auth is None  # no auth: none


def test_keys_new_prints_the_secret_once_on_stderr_and_an_entry_that_loads(tmp_path, capsys):
    assert main(["keys", "new", "--name", "dave", "--rpm", "5", "--model", "small"]) == 0
    out, err = capsys.readouterr()
    secret = err.strip().splitlines()[-1]
    assert secret.startswith("dt-") and secret not in out
    entries = yaml.safe_load(io.StringIO(out))
    assert entries == [{"name": "dave", "sha256": key_digest(secret), "models": ["small"],
                        "rpm": 5}]
    path = tmp_path / "keys.yaml"
    path.write_text(out)
    pool = pool_from_dict(config({"keys_file": str(path)}, emulate=False), "p")
    assert pool.auth is not None and key_digest(secret) in (pool.auth.keys or {})
    assert main(["keys", "new", "--name", "x", "--admin", "--rpm", "1"]) != 0


# -- the checks, on an injected clock -----------------------------------------------------------

def test_unknown_or_missing_key_is_401_and_the_key_is_never_in_the_message(tmp_path):
    auth = auth_over(tmp_path, Clock())
    for s in (scope(), scope("dt-wrong"), {"headers": [(b"authorization", b"Basic abc")]}):
        with pytest.raises(ApiError) as e:
            auth.identify(s)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key")
        assert "dt-wrong" not in e.value.message
    assert auth.identify(scope(ALICE)).name == "alice"
    assert bearer("bearer  tok ") == "tok" and bearer("Bearer") is None


def test_model_not_allowed_is_403_and_an_alias_needs_the_alias(tmp_path):
    auth = auth_over(tmp_path, Clock())
    bob = auth.identify(scope(BOB))
    admit(auth, bob, "small", 10)
    for model in ("big", "auto", None):
        with pytest.raises(ApiError) as e:
            admit(auth, bob, model, 10)
        assert (e.value.status, e.value.code, e.value.param) == (403, "model_not_allowed",
                                                                  "model")
    carol = auth.identify(scope(CAROL))
    for model in ("big", "auto", None):
        admit(auth, carol, model, 10)  # no models listed: all


def test_rpm_refuses_with_the_time_until_a_request_fits(tmp_path):
    clock = Clock()
    auth = auth_over(tmp_path, clock, rpm=2)
    alice = auth.identify(scope(ALICE))
    g = admit(auth, alice, None, 10)
    assert dict(g.headers)[b"x-ratelimit-remaining-requests"] == b"1"
    assert dict(g.headers)[b"x-ratelimit-limit-requests"] == b"2"
    admit(auth, alice, None, 10)
    clock.t += 6.0  # a fifth of a request refilled (2 per minute: one per 30 s)
    with pytest.raises(RateLimited) as e:
        admit(auth, alice, None, 10)
    h = dict(e.value.headers)
    assert (e.value.status, e.value.code, e.value.type) == (429, "rate_limit_exceeded",
                                                             "requests")
    assert h[b"retry-after"] == b"24" and h[b"retry-after-ms"] == b"24000"
    assert h[b"x-ratelimit-remaining-requests"] == b"0"
    assert h[b"x-ratelimit-reset-requests"] == b"54s"  # until both are back
    clock.t += 23.9
    with pytest.raises(RateLimited):
        admit(auth, alice, None, 10)
    clock.t += 0.2
    admit(auth, alice, None, 10)  # refused requests took nothing


def _attempt(fid: str, key, t: float, tokens: int) -> Attempt:
    """An attempt that streamed ``tokens`` (on an instance with no parts of its own)."""
    f = Flight(fid, 10, 4, t, None)
    f.first_token, f.tokens = t, tokens
    return Attempt(f, SimpleNamespace(subscribers=[]), 1, t, 1.0, "sfs", "shadow", key=key)


def test_tpm_counts_prompt_tokens_at_admission_and_output_tokens_when_known(tmp_path):
    clock = Clock()
    auth = auth_over(tmp_path, clock, tpm=100, rpm=1000)
    lifecycle = Lifecycle([KeyMetering(auth.limiter)])
    alice = auth.identify(scope(ALICE))
    g = admit(auth, alice, None, 10)
    assert dict(g.headers)[b"x-ratelimit-remaining-tokens"] == b"90"
    # two attempts of the request end, 50 tokens streamed in all: charged to its key
    for i, streamed in enumerate((20, 30)):
        lifecycle.end(_attempt(f"r-{i}", alice, clock.t, streamed), clock.t, Outcome.OK)
    with pytest.raises(RateLimited) as e:  # 40 left: 50 more prompt tokens wait 6 s
        admit(auth, alice, None, 50)
    assert e.value.type == "tokens"
    assert dict(e.value.headers)[b"retry-after"] == b"6"
    with pytest.raises(RateLimited) as e:  # more than the limit: never
        admit(auth, alice, None, 101)
    assert b"retry-after" not in dict(e.value.headers)
    assert "Request too large" in e.value.message
    # an attempt without a key charges no one; an attempt ends (and charges) once
    done = _attempt("other", None, clock.t, 50)
    lifecycle.end(done, clock.t, Outcome.OK)
    again = _attempt("r-0", alice, clock.t, 20)
    lifecycle.end(again, clock.t, Outcome.OK)
    assert not lifecycle.end(again, clock.t, Outcome.OK)
    clock.t += 6.0 + 20 * 60 / 100  # (the 20 tokens charged again take 12 s to refill)
    admit(auth, alice, None, 50)


def test_memory_store_refills_up_to_the_limit_and_takes_all_draws_or_none():
    s = MemoryLimitStore()
    both = [Draw("k:requests", 60, 1), Draw("k:tokens", 100, 80)]
    assert asyncio.run(s.acquire(both, 0.0))[0]
    ok, levels = asyncio.run(s.acquire(both, 0.0))  # tokens short: the request is not taken either
    assert not ok and levels[0].remaining == 59 and levels[1].wait_s == pytest.approx(36.0)
    ok, levels = asyncio.run(s.acquire([Draw("k:requests", 60, 1)], 3600.0))
    assert ok and levels[0].remaining == 59  # capped at the limit


def test_admin_routes_and_urls(tmp_path):
    pool = pool_from_dict(config(keys_files(tmp_path), emulate=False), "test")
    loopback_open = Auth(None, CollectorRegistry())
    assert loopback_open.warning() is None and loopback_open.protect([]) == []
    exposed = Auth(None, CollectorRegistry(), host="0.0.0.0")
    assert "without API keys" in (exposed.warning() or "")
    keys_only = Auth(AuthConfig(pool.auth.keys), CollectorRegistry(), host="::")
    assert "without admin keys" in (keys_only.warning() or "")
    assert Auth(pool.auth, CollectorRegistry(), host="10.0.0.1").warning() is None
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


# -- through the gateway's app (no upstream needed) ---------------------------------------------

async def _asgi_get(gw: Gateway, path: str, key: str | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=gw.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        return await c.get(path, headers=auth_header(key) if key else None)


def test_admin_key_guards_metrics_and_duetime_routes_but_not_health_or_models(tmp_path):
    gw = Gateway(pool_from_dict(config(keys_files(tmp_path), emulate=False), "test"))

    async def go() -> dict[str, Any]:
        out = {}
        for path in ("/metrics", "/duetime/instances", "/health", "/v1/models"):
            for who, key in (("none", None), ("client", CAROL), ("admin", ROOT)):
                out[path, who] = await _asgi_get(gw, path, key)
        return out

    r = run(go())
    for path in ("/metrics", "/duetime/instances"):
        assert r[path, "none"].status_code == 401
        assert r[path, "none"].json()["error"]["code"] == "invalid_api_key"
        assert r[path, "client"].status_code == 403
        assert r[path, "client"].json()["error"]["code"] == "admin_key_required"
        assert r[path, "admin"].status_code == 200
    assert [i["url"] for i in r["/duetime/instances", "admin"].json()["instances"]] == [
        "http://127.0.0.1:9"] * 2
    for path in ("/health", "/v1/models"):  # (health: 503, nothing polled; but not 401)
        assert {r[path, w].status_code for w in ("none", "client", "admin")} <= {200, 503}
    metrics = r["/metrics", "admin"].text  # (read after the two refusals of /metrics)
    assert 'duetime_auth_rejections_total{key="carol",reason="admin_key_required"} 1.0' \
        in metrics
    assert 'duetime_auth_rejections_total{key="",reason="invalid_api_key"} 1.0' in metrics
    assert ROOT not in metrics and CAROL not in metrics


def test_without_auth_urls_show_on_loopback_only_and_the_exposed_gateway_warns(caplog):
    pool = pool_from_dict(config(emulate=False), "test")
    on_loopback = run(_asgi_get(Gateway(pool), "/duetime/instances")).json()
    assert [i["url"] for i in on_loopback["instances"]] == ["http://127.0.0.1:9"] * 2
    exposed = Gateway(pool, host="0.0.0.0")
    body = run(_asgi_get(exposed, "/duetime/instances")).json()
    assert [(i["name"], i["url"]) for i in body["instances"]] == [("a", None), ("b", None)]
    assert run(_asgi_get(exposed, "/metrics")).status_code == 200  # nothing asked

    async def start_stop() -> None:
        await exposed.start()
        await exposed.close()

    with caplog.at_level(logging.WARNING, logger="duetime.gateway"):
        run(start_stop())
    assert any("without API keys" in r.getMessage() for r in caplog.records)


# -- through the real gateway over emulators ----------------------------------------------------

def test_gateway_401_403_429_and_limit_headers(tmp_path):
    cfg = config(keys_files(tmp_path, rpm=2))

    async def go() -> dict[str, Any]:
        async with gateway(cfg) as (svc, c):
            assert svc.gateway is not None
            svc.gateway.auth.limiter.clock = Clock()  # no refill during the test
            r: dict[str, Any] = {}
            r["none"] = await c.post("/v1/chat/completions", json=chat())
            r["wrong"] = await c.post("/v1/chat/completions", json=chat(),
                                      headers=auth_header("dt-not-a-key"))
            r["bob_big"] = await c.post("/v1/chat/completions", json=chat("big"),
                                        headers=auth_header(BOB))
            r["bob_small"] = await c.post("/v1/chat/completions", json=chat("small"),
                                          headers=auth_header(BOB))
            r["a1"] = await c.post("/v1/chat/completions", json=chat(stream=True),
                                   headers=auth_header(ALICE))
            r["a2"] = await c.post("/v1/completions",
                                   json={"model": "auto", "prompt": "hi", "max_tokens": 2},
                                   headers=auth_header(ALICE))
            r["a3"] = await c.post("/v1/chat/completions", json=chat(),
                                   headers=auth_header(ALICE))
            r["metrics"] = await c.get("/metrics", headers=auth_header(ROOT))
            return r

    r = run(go())
    for k in ("none", "wrong"):
        assert r[k].status_code == 401
        assert r[k].json()["error"]["code"] == "invalid_api_key"
        assert set(r[k].json()["error"]) == {"message", "type", "param", "code"}
    assert r["bob_big"].status_code == 403
    assert r["bob_big"].json()["error"]["code"] == "model_not_allowed"
    assert r["bob_small"].status_code == 200
    assert "x-ratelimit-limit-requests" not in r["bob_small"].headers  # bob has no limits
    assert r["a1"].status_code == 200 and "data: [DONE]" in r["a1"].text
    assert r["a1"].headers["x-ratelimit-remaining-requests"] == "1"
    assert r["a2"].status_code == 200
    assert r["a2"].headers["x-ratelimit-remaining-requests"] == "0"
    a3 = r["a3"]
    assert a3.status_code == 429
    assert a3.json()["error"]["code"] == "rate_limit_exceeded"
    assert a3.headers["retry-after"] == "30"
    assert a3.headers["x-ratelimit-limit-requests"] == "2"
    assert a3.headers["x-ratelimit-reset-requests"] == "1m0s"
    m = r["metrics"].text
    assert 'duetime_auth_rejections_total{key="alice",reason="rate_limit_exceeded"} 1.0' in m
    assert 'duetime_auth_rejections_total{key="bob",reason="model_not_allowed"} 1.0' in m
    assert 'duetime_requests_total{route="chat",status="401"} 2.0' in m


def test_gateway_charges_output_tokens_to_the_key(tmp_path):
    cfg = config(keys_files(tmp_path, tpm=100_000))

    async def go() -> list[httpx.Response]:
        async with gateway(cfg) as (svc, c):
            assert svc.gateway is not None
            svc.gateway.auth.limiter.clock = Clock()
            return [await c.post("/v1/chat/completions", json=chat(max_tokens=8, **kw),
                                 headers=auth_header(ALICE))
                    for kw in ({}, {"stream": True})]

    first, second = run(go())
    assert first.status_code == second.status_code == 200
    usage = first.json()["usage"]
    assert usage["completion_tokens"] >= 1
    left_after_first = int(first.headers["x-ratelimit-remaining-tokens"])
    assert left_after_first == 100_000 - usage["prompt_tokens"]
    # the second request's admission saw the first one's output tokens charged
    left_after_second = int(second.headers["x-ratelimit-remaining-tokens"])
    assert left_after_second == left_after_first - usage["completion_tokens"] \
        - usage["prompt_tokens"]


def test_no_auth_gateway_answers_anyone_as_before():
    async def go() -> list[httpx.Response]:
        async with gateway(config()) as (_svc, c):
            return [await c.post("/v1/chat/completions", json=chat()),
                    await c.post("/v1/chat/completions", json=chat(),
                                 headers=auth_header("anything")),
                    await c.get("/metrics"), await c.get("/duetime/instances")]

    rs = run(go())
    assert [r.status_code for r in rs] == [200, 200, 200, 200]
    assert "x-ratelimit-limit-requests" not in rs[0].headers
    assert all(i["url"].startswith("http://127.0.0.1:") for i in rs[3].json()["instances"])


def test_embedded_emulators_control_routes_need_the_service_token():
    async def go() -> dict[str, Any]:
        async with gateway(config()) as (svc, _c):
            url = svc.emulator_servers["a"].url
            token = svc.admin_tokens["a"]
            async with httpx.AsyncClient(base_url=url, timeout=10) as e:
                return {
                    "none": await e.post("/emulator/faults", json={"rate": 1.0}),
                    "wrong": await e.post("/emulator/faults", json={"rate": 1.0},
                                          headers=auth_header("guess")),
                    "other": await e.post("/emulator/faults", json={"rate": 1.0},
                                          headers=auth_header(svc.admin_tokens["b"])),
                    "speed": await e.post("/emulator/speed", json={"speed": 9}),
                    "rate": svc.emulators["a"].faults.rate,
                    "ok": await e.post("/emulator/faults", json={"rate": 0.5},
                                       headers=auth_header(token)),
                }

    r = run(go())
    for k in ("none", "wrong", "other", "speed"):
        assert r[k].status_code == 401, k
        assert r[k].json()["error"]["code"] == "invalid_api_key"
    assert r["rate"] == 0.0  # nothing injected
    assert r["ok"].status_code == 200 and r["ok"].json()["rate"] == 0.5


def test_standalone_emulator_control_routes_closed_without_a_token_beyond_loopback():
    from duetime.emulator import create_app, emulator_from_profile

    async def go(**kw: Any) -> int:
        app = create_app(emulator_from_profile("qwen3-0.6b"), **kw)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://emu") as c:
            return (await c.get("/emulator/faults")).status_code

    assert run(go()) == 200
    assert run(go(control_open=False)) == 403
    assert run(go(admin_token="t")) == 401


def test_keys_file_accepts_json(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "j", "sha256": key_digest("k"), "tpm": 9}]))
    pool = pool_from_dict(config({"keys_file": str(path)}, emulate=False), "p")
    assert pool.auth is not None and [k.tpm for k in (pool.auth.keys or {}).values()] == [9]


def test_duetime_emulate_reads_its_admin_token_from_the_environment():
    env = {**os.environ, "DUETIME_EMULATOR_ADMIN_TOKEN": "tok-123"}
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "emulate", "--profile",
                             "qwen3-0.6b", "--port", "0", "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            text=True)
    killer = threading.Timer(60.0, proc.kill)  # (bounded even if it never prints)
    killer.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # (the first line says where it listens)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        with httpx.Client(base_url=m.group(1), timeout=10) as c:
            refused = c.get("/emulator/faults")
            allowed = c.get("/emulator/faults", headers=auth_header("tok-123"))
            models = c.get("/v1/models")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        killer.cancel()
    assert refused.status_code == 401 and allowed.status_code == 200
    assert models.status_code == 200  # the rest of the API is unchanged
