"""The gateway's live desired-replica signal (pool config ``autoscale``): the autoscaler asked
over the gateway's live state, its answer on ``/metrics`` and ``/duetime/replicas``, and the
config's errors. Real emulators on loopback; the ticks are called by the test (the section's
interval is long), so no premise depends on the machine's speed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from duetime.gateway.config import ConfigError
from duetime.service import Service, pool_from_dict

LONG = 3600.0  # the background tick's interval: the test ticks itself


def run(coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def config(autoscale: dict[str, Any], n: int = 1) -> dict[str, Any]:
    return {
        "policy": "round-robin",
        "quality": {"workload": None, "tasks": {"chat": {"big": 0.9}}},
        "instances": [{"name": f"big.{k}", "model": "big", "profile": "qwen3-0.6b",
                       "emulate": {"speed": 4.0, "seed": k},
                       "price_usd_per_mtok": {"prompt": 0.1, "output": 0.3}}
                      for k in range(n)],
        "autoscale": {"interval_s": LONG, **autoscale},
    }


async def chat(c: httpx.AsyncClient) -> None:
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def desired_in_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("duetime_desired_replicas{"):
            model = line.split('model="')[1].split('"')[0]
            out[model] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_rate_the_router_sends_a_model_sizes_it_on_metrics_and_json():
    """8 requests routed since the last tick of the hour-long interval is 8/3600 q/s; at one
    replica's 1/3600 q/s (utilization 1) that is 8 replicas, capped at max_replicas 6. With
    nothing routed since, the model needs one — once the replicas asked for are no longer
    expected."""
    async def main() -> None:
        cfg = config({"capacity": {"big": 1 / LONG}, "max_replicas": 6,
                      "params": {"utilization": 1.0, "window": 1}})
        svc = await Service(pool_from_dict(cfg, "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                before = (await c.get("/duetime/replicas")).json()
                assert before["autoscaler"] == "duetime" and before["last"] is None
                for _ in range(8):
                    await chat(c)
                assert gw.replicas.tick() == {"big": 6}
                got = (await c.get("/duetime/replicas")).json()["last"]
                assert got["desired"] == {"big": 6}
                assert got["models"]["big"]["routed"] == 8 and got["models"]["big"]["ready"] == 1
                assert got["models"]["big"]["rate_rps"] == pytest.approx(8 / LONG)
                assert desired_in_metrics((await c.get("/metrics")).text) == {"big": 6.0}
                # asked for and not come: counted as starting for a scale-up delay (60 s), so
                # the hold keeps the ask; once the delay passed without them, one is enough
                assert gw.replicas.tick() == {"big": 6}
                assert gw.replicas.last["models"]["big"]["starting"] == 5
                assert gw.replicas.tick(time.monotonic() + 61) == {"big": 1}
                assert desired_in_metrics((await c.get("/metrics")).text) == {"big": 1.0}
        finally:
            await svc.stop()

    run(main())


def test_without_a_capacity_a_late_forecast_asks_for_one_more():
    """No capacity, no table: the forecasts' rule alone. With ``late`` set below any forecast
    the engines make, the typical request is late: one replica more than the one serving; a
    quiet model (no recent requests: no forecast) keeps what it has."""
    async def main() -> None:
        svc = await Service(pool_from_dict(config({"params": {"late": 1e-9}}, n=2),
                                           "test.yaml")).start()
        gw = svc.gateway
        assert gw is not None
        try:
            assert gw.replicas.tick() == {"big": 2}          # quiet: keeps its two
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                await chat(c)
            assert gw.replicas.tick() == {"big": 3}
            # still late, but the replica asked for counts as starting: not asked twice
            assert gw.replicas.tick() == {"big": 3}
            last = gw.replicas.last
            assert last is not None and last["models"]["big"]["forecast_ratio"] > 0
        finally:
            await svc.stop()

    run(main())


@pytest.mark.parametrize("autoscale, error", [
    ({"autoscaler": "nope"}, "autoscale.autoscaler: unknown autoscaler 'nope'"),
    ({"capacity": {"small": 1.0}}, "autoscale.capacity.small: unknown model"),
    ({"capacity": {"big": 0}}, "autoscale.capacity.big: must be > 0"),
    ({"params": {"x": 1}}, "autoscale.params.x: autoscaler 'duetime' has no parameter"),
    ({"autoscaler": "throughput-planner"}, "autoscale.capacity: autoscaler "
                                           "'throughput-planner' needs each model's capacity"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas 3 > max_replicas 2"),
    ({"min_replicas": 0}, "autoscale.min_replicas: Input should be greater than or equal to 1"),
    ({"table": [{"rate": 1, "replicas": {"small": 1}}]}, "autoscale.table[0]: unknown models"),
    ({"table": "missing.yaml"}, "autoscale.table: cannot read"),
])
def test_autoscale_config_errors_name_the_field(autoscale, error):
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        pool_from_dict(config(autoscale), "test.yaml")


def test_a_table_file_is_read_beside_the_config(tmp_path):
    (tmp_path / "table.yaml").write_text(
        "- {rate: 4.0, replicas: {big: 2}}\n- {rate: 1.0, replicas: {big: 1}}\n")
    cfg = tmp_path / "pool.yaml"
    cfg.write_text("x: 1\n")
    pool = pool_from_dict(config({"table": "table.yaml"}), str(cfg))
    assert pool.autoscale.table == ((1.0, {"big": 1}), (4.0, {"big": 2}))  # sorted by rate


def test_cli_lists_the_autoscalers_and_their_parameters(capsys):
    import json

    from duetime.cli import main

    assert main(["autoscalers"]) == 0
    text = capsys.readouterr().out
    assert "duetime: duetime's" in text and "hold_s (default 120)" in text
    assert main(["autoscalers", "--json"]) == 0
    got = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    assert set(got) == {"static", "queue-threshold", "llm-d-saturation", "throughput-planner",
                        "duetime"}
    assert {p["name"] for p in got["queue-threshold"]["params"]} == {
        "threshold", "scale_down_stabilization_s"}


def test_a_forecast_ratio_needs_a_positive_target() -> None:
    """Requests recorded with no target left (they waited it out in the admission queue, as
    the gateway recorded them before their whole target was kept) give no ratio rather than
    dividing by zero; the ratio is the median prompt's forecast over the median target."""
    import numpy as np

    from duetime.autoscale.status import Recent

    def recent(target: list[float]) -> Recent:
        n = len(target)
        return Recent(np.zeros(n), np.full(n, np.nan), np.full(n, np.nan), np.array(target),
                      np.zeros(n), np.full(n, 100.0))

    assert recent([0.0, 0.0, 0.0]).forecast_ratio(lambda p: 0.2) is None
    assert recent([0.5, 0.5, 1.0]).forecast_ratio(lambda p: 0.2 if p == 100 else 9) == 0.4
