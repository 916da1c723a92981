"""Deadlines and per-token targets at the gateway: ``x-duetime-deadline-ms`` and the pool's
``deadline`` rule, the TTFT and TPOT headers of llm-d and SGLang, and ``sfs-deadline``
routing on them (its dry run explains finishes)."""

from __future__ import annotations

import pytest

from duetime.gateway import ConfigError, pool_from_dict
from duetime.gateway.intake.controls import read_controls
from duetime.web.errors import ApiError
from test_gateway import chat, config, gateway, run


def controls(pool, headers: dict[str, str], prompt: int = 100, output: int | None = None):
    scope = {"headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    return read_controls(scope, pool, prompt, client="c", output_tokens=output)


def test_deadline_and_tpot_headers_and_the_pool_rule() -> None:
    pool = pool_from_dict(config(), "test")
    c = controls(pool, {})
    assert c.deadline_s is None and c.tpot_target_s is None
    c = controls(pool, {"x-duetime-deadline-ms": "2500", "x-duetime-tpot-ms": "40"})
    assert c.deadline_s == 2.5 and c.tpot_target_s == pytest.approx(0.04)
    assert controls(pool, {"x-llm-d-slo-tpot-ms": "30"}).tpot_target_s == pytest.approx(0.03)
    assert controls(pool, {"x-sgl-tps-slo": "20"}).tpot_target_s == pytest.approx(0.05)
    assert controls(pool, {"x-sgl-ttft-slo-ms": "321"}).target_s == pytest.approx(0.321)
    assert controls(pool, {"x-llm-d-slo-ttft-ms": "123",
                           "x-duetime-ttft-ms": "99"}).target_s == pytest.approx(0.099)
    for bad in ({"x-duetime-deadline-ms": "-1"}, {"x-sgl-tps-slo": "fast"}):
        with pytest.raises(ApiError) as e:
            controls(pool, bad)
        assert e.value.status == 400
    ruled = pool_from_dict(config(deadline={
        "base_ms": 1000, "per_output_token_ms": 20, "max_ms": 5000,
        "tasks": {"code": {"per_output_token_ms": 50}}}), "test")
    assert controls(ruled, {}, output=100).deadline_s == pytest.approx(3.0)
    assert controls(ruled, {}, output=1000).deadline_s == pytest.approx(5.0)
    assert controls(ruled, {"x-duetime-task": "code"}, output=10).deadline_s == \
        pytest.approx(1.5)
    assert controls(ruled, {"x-duetime-deadline-ms": "800"}).deadline_s == 0.8
    with pytest.raises(ConfigError, match=r"deadline\.tasks\.nope: unknown task"):
        pool_from_dict(config(deadline={"tasks": {"nope": {"base_ms": 1}}}), "test")


def test_sfs_deadline_routes_on_the_deadline_at_the_gateway() -> None:
    """A dry run of sfs-deadline explains each instance's finish forecast against the
    deadline; a deadline nothing can meet leaves the least finish."""
    async def go():
        async with gateway(config()) as (_svc, c):
            ok = (await c.post("/duetime/route", json=chat(max_tokens=64), headers={
                "x-duetime-policy": "sfs-deadline", "x-duetime-deadline-ms": "600000"}
                               )).json()
            tight = (await c.post("/duetime/route", json=chat(max_tokens=64), headers={
                "x-duetime-policy": "sfs-deadline", "x-duetime-deadline-ms": "1"})).json()
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=4), headers={
                "x-duetime-policy": "sfs-deadline", "x-duetime-deadline-ms": "600000"})
            return ok, tight, r

    ok, tight, r = run(go())
    assert r.status_code == 200, r.text
    rows = {x["instance"]: x for x in ok["candidates"]}
    assert all(x["forecast_finish_s"] * 1e3 > x["forecast_ttft_ms"] >= 0
               for x in rows.values())
    assert ok["chosen"] == "a" and rows["a"]["feasible"]  # (the better model, in time)
    finish = {x["instance"]: x["forecast_finish_s"] for x in tight["candidates"]}
    assert tight["chosen"] == min(finish, key=finish.get)
    assert not any(x["feasible"] for x in tight["candidates"])
