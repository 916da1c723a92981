"""The one intake path (duetime.gateway.intake.request): the relay, the dry run and the picker
take it with different explicit arguments — which key checks apply, which instances are
allowed — and get the same request context otherwise."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from duetime.gateway import pool_from_dict
from duetime.gateway.app import Gateway
from duetime.gateway.intake.request import Allowed, KeyCheck, RequestContext
from duetime.web.errors import ApiError
from test_auth import ALICE, config, keys_files, scope

BODY = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "hello"}],
                   "max_tokens": 4}).encode()


def take(gw: Gateway, key: str | None, keys: KeyCheck, *, body: bytes = BODY,
         chat: bool | None = True, allowed: Allowed | None = None) -> RequestContext:
    return asyncio.run(gw.intake.take(body, scope(key), arrival=0.0, chat=chat, keys=keys,
                                      allowed=allowed))


def status(fn: Any) -> int:
    with pytest.raises(ApiError) as e:
        fn()
    return e.value.status


@pytest.fixture
def gw(tmp_path) -> Gateway:
    """A pool with keys: alice may send one request a minute."""
    return Gateway(pool_from_dict(config(keys_files(tmp_path, rpm=1), emulate=False), "test"))


def test_the_relay_identifies_and_admits(gw):
    assert status(lambda: take(gw, None, KeyCheck.ADMIT)) == 401
    ctx = take(gw, ALICE, KeyCheck.ADMIT)
    assert ctx.key is not None and ctx.key.name == "alice"
    assert dict(ctx.grant.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    assert ctx.controls.client == "key:alice"  # (fairness among queued requests: per key)
    assert status(lambda: take(gw, ALICE, KeyCheck.ADMIT)) == 429  # (its minute is spent)


def test_the_dry_run_identifies_but_spends_nothing(gw):
    assert status(lambda: take(gw, None, KeyCheck.IDENTIFY)) == 401
    for _ in range(3):
        ctx = take(gw, ALICE, KeyCheck.IDENTIFY, chat=None)  # (chat: told by the body)
        assert ctx.key is not None and ctx.grant.headers == [] and ctx.chat
    take(gw, ALICE, KeyCheck.ADMIT)  # (the key's one request a minute is still there)


def test_the_picker_checks_no_key_and_keeps_to_its_subset(gw):
    ctx = take(gw, None, KeyCheck.NONE)
    assert ctx.key is None and [s.name for s in ctx.candidates] == ["a", "b"]
    only_b = take(gw, None, KeyCheck.NONE, allowed=Allowed(lambda s: s.name == "b", "no"))
    assert [s.name for s in only_b.candidates] == ["b"]
    with pytest.raises(ApiError) as e:
        take(gw, None, KeyCheck.NONE, allowed=Allowed(lambda s: False, "none allowed"))
    assert (e.value.status, e.value.message, e.value.code) == (503, "none allowed",
                                                                "no_healthy_instance")


def test_every_caller_gets_the_same_context_otherwise(gw):
    """Parsing, tokens, controls, policy, candidates and predictions do not depend on the
    caller; a refusal after admission still carries the key's limits."""
    a = take(gw, ALICE, KeyCheck.ADMIT)
    b = take(gw, ALICE, KeyCheck.IDENTIFY)
    c = take(gw, None, KeyCheck.NONE)
    for x in (b, c):
        assert (x.req.prompt_tokens, x.predicted, x.cap, x.quality, x.policy.name) == (
            a.req.prompt_tokens, a.predicted, a.cap, a.quality, a.policy.name)
        assert x.controls.target_s == a.controls.target_s
        assert [s.name for s in x.candidates] == [s.name for s in a.candidates]
        assert x.rid != a.rid


def test_a_refusal_after_admission_carries_the_limits(tmp_path):
    gw = Gateway(pool_from_dict(config(keys_files(tmp_path, rpm=5), emulate=False), "test"))
    body = json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(ApiError) as e:
        take(gw, ALICE, KeyCheck.ADMIT, body=body.encode())
    assert e.value.status == 404
    assert dict(e.value.headers)[b"x-ratelimit-remaining-requests"] == b"4"
