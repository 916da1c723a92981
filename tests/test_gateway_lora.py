"""The gateway in front of instances serving LoRA adapters (embedded emulators started with
them): requests name an adapter as their model and go to the instances that serve it, asked
for by that name; sfs forecasts the ``max_loras`` cap; the adapters are listed; llm-d's
lora-affinity reads ``vllm:lora_requests_info``; config errors name their field."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from duetime.gateway import ConfigError, pool_from_dict
from duetime.gateway.config import adapter_id
from duetime.gateway.state.scraped import ScrapedLoad
from test_gateway import PRICE, gateway, run


def lora_config(policy: str = "sfs", **kw: Any) -> dict[str, Any]:
    """Two emulated instances of model ``base``, one adapter per step (``max_loras`` 1):
    ``a`` serves adapters x and y, ``b`` serves y."""
    inst = {"model": "base", "profile": "qwen3-0.6b", "config": {"max_loras": 1},
            "price_usd_per_mtok": PRICE}
    return {"policy": policy,
            "quality": {"workload": None, "tasks": {"chat": {"base": 0.8}}},
            "instances": [{**inst, "name": "a", "adapters": ["x", "y"],
                           "emulate": {"speed": 1.0}},
                          {**inst, "name": "b", "adapters": ["y"],
                           "emulate": {"speed": 1.0, "seed": 1}}],
            "health": {"interval_s": 0.1, "eject_after": 1},
            "timeouts": {"connect_s": 1.0, "first_token_s": 30.0, "read_s": 30.0}, **kw}


def test_requests_on_an_adapter_go_where_it_is_served_and_ask_for_it():
    async def go():
        async with gateway(lora_config()) as (_svc, c):
            models = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
            assert models["x"]["parent"] == "base" and models["x"]["instances"] == ["a"]
            assert sorted(models["y"]["instances"]) == ["a", "b"]
            for _ in range(3):  # only a serves x
                r = await c.post("/v1/completions", json={"model": "x", "prompt": "hi",
                                                           "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert r.headers["x-duetime-instance"] == "a"
                assert r.json()["model"] == "x"  # (the emulator ran it on the adapter)
            r = await c.post("/v1/completions", json={"model": "z", "prompt": "hi"})
            assert r.status_code == 404 and "LoRA adapters: x, y" in r.json()["error"]["message"]
    run(go())


def test_sfs_forecasts_the_adapter_cap():
    """A long request on adapter x runs on a (max_loras 1): a request on y would wait there
    until it ends, and sfs's forecasts say so — it sends y to b, while a request on x (which
    runs beside the long one) may stay on a."""
    async def go():
        async with gateway(lora_config()) as (svc, c):
            long = {"model": "x", "prompt": "hi", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}

            async def hold() -> None:
                async with c.stream("POST", "/v1/completions", json=long) as resp:
                    async for _ in resp.aiter_bytes():
                        pass

            task = asyncio.create_task(hold())
            emu = svc.emulators["a"]
            for _ in range(500):
                if emu.engine.num_running:
                    break
                await asyncio.sleep(0.01)
            assert emu.engine.num_running == 1
            e = (await c.post("/duetime/route", json={"model": "y", "prompt": "hi"},
                              headers={"x-duetime-ttft-ms": "2000"})).json()
            f = {x["instance"]: x["forecast_ttft_ms"] for x in e["candidates"]}
            assert e["chosen"] == "b" and f["a"] > 10 * f["b"], e
            r = await c.post("/v1/completions", json={"model": "y", "prompt": "hi",
                                                       "max_tokens": 2})
            assert r.headers["x-duetime-instance"] == "b"
            task.cancel()
    run(go(), timeout=60)


def test_lora_affinity_reads_the_instances_metric():
    """The gateway reads each instance's ``vllm:lora_requests_info``: with a long request on
    y running on a (sent there by round-robin's first turn), llm-d's lora-affinity scores a
    1.0 for y and b 0.8 (its one slot free)."""
    async def go():
        cfg = lora_config("lora-affinity",
                          state={"source": "metrics", "scrape_interval_s": 0.05})
        async with gateway(cfg) as (svc, c):
            long = {"model": "y", "prompt": "hi", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}

            async def hold() -> None:
                async with c.stream("POST", "/v1/completions", json=long,
                                    headers={"x-duetime-policy": "round-robin"}) as resp:
                    async for _ in resp.aiter_bytes():
                        pass

            task = asyncio.create_task(hold())
            inst = {s.name: s for s in svc.gateway.instances}
            for _ in range(500):
                if inst["a"].scraped.lora_names == ("y",):
                    break
                await asyncio.sleep(0.02)
            assert inst["a"].lora_adapters == (frozenset({adapter_id("y")}), 1)
            assert inst["b"].lora_adapters == (frozenset(), 1)
            e = (await c.post("/duetime/route", json={"model": "y", "prompt": "hi"})).json()
            lora = {x["instance"]: x["lora"] for x in e["candidates"]}
            assert lora == {"a": 1.0, "b": 0.8}
            task.cancel()
    run(go(), timeout=60)


def test_lora_requests_info_is_read_from_the_newest_series():
    s = ScrapedLoad()
    s.set('vllm:num_requests_running{model_name="m"} 2.0\n'
          'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1",'
          'waiting_lora_adapters="a1"} 1.7e9\n'
          'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1,a2",'
          'waiting_lora_adapters="a1,a2"} 1.8e9\n'
          'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
          'waiting_lora_adapters=""} 1.75e9\n', 0.0)
    assert s.lora_names == ("a1", "a2") and s.max_lora == 2 and s.running == 2
    s.set('vllm:num_requests_running{model_name="m"} 0.0\n', 1.0)
    assert s.lora_names is None


@pytest.mark.parametrize(("change", "where", "why"), [
    (lambda d: d["instances"][0]["config"].pop("max_loras"), "instances[0].adapters",
     "max_loras"),
    (lambda d: d["instances"][1].update(adapters=["base"]), "instances",
     "also model names"),
    (lambda d: d["instances"][0].update(adapters=["x", "x"]), "instances[0].adapters",
     "distinct"),
])
def test_adapter_config_errors_name_their_field(change, where, why):
    d = lora_config()
    change(d)
    with pytest.raises(ConfigError, match=why) as info:
        pool_from_dict(d, "pool.yaml")
    assert where in str(info.value)


def test_a_task_maps_a_base_model_request_to_its_best_rated_adapter():
    """The quality table rates adapters per task: a request for the base model with task
    ``math`` runs on adapter x (rated above the base model and y for it), asked for by name
    where x is served; with task ``chat`` (no adapter rated) it stays on the base model; a
    request naming an adapter is scored with that adapter's accuracy."""
    cfg = lora_config("sfs")
    cfg["quality"]["tasks"] = {"chat": {"base": 0.8}, "math": {"base": 0.4, "x": 0.9, "y": 0.6}}

    async def go():
        async with gateway(cfg) as (_svc, c):
            for _ in range(3):
                r = await c.post("/v1/completions", json={"model": "base", "prompt": "2+2",
                                                           "max_tokens": 2},
                                 headers={"x-duetime-task": "math"})
                assert r.status_code == 200, r.text
                assert r.headers["x-duetime-instance"] == "a" and r.json()["model"] == "x"
            r = await c.post("/v1/completions", json={"model": "base", "prompt": "hi",
                                                       "max_tokens": 2},
                             headers={"x-duetime-task": "chat"})
            assert r.status_code == 200 and r.json()["model"] == "base"
            e = (await c.post("/duetime/route", json={"model": "y", "prompt": "2+2"},
                              headers={"x-duetime-task": "math"})).json()
            assert {x["quality"] for x in e["candidates"]} == {0.6}, e
            e = (await c.post("/duetime/route", json={"model": "base", "prompt": "2+2"},
                              headers={"x-duetime-task": "math"})).json()
            assert [x["instance"] for x in e["candidates"]] == ["a"], e
            assert e["candidates"][0]["quality"] == 0.9
    run(go())


def test_adapters_loaded_and_unloaded_at_run_time_are_read_from_v1_models():
    """An instance with LoRA on is read from its ``/v1/models`` every health interval: an
    adapter loaded there at run time is routed to it (asked for by name), one unloaded is no
    longer (a 404 once no instance lists it); the change is a membership change."""
    async def go():
        async with gateway(lora_config()) as (svc, c):
            body = {"prompt": "hi", "max_tokens": 2}

            async def listed(name: str, want: bool) -> None:
                for _ in range(300):
                    ids = {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
                    if (name in ids) == want:
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"{name} listed: {not want}")

            r = await c.post("/v1/completions", json={"model": "w", **body})
            assert r.status_code == 404
            svc.emulators["a"].load_adapter("w", "/adapters/w")
            await listed("w", True)
            r = await c.post("/v1/completions", json={"model": "w", **body})
            assert r.status_code == 200, r.text
            assert r.headers["x-duetime-instance"] == "a" and r.json()["model"] == "w"
            svc.emulators["a"].unload_adapter("x")
            await listed("x", False)
            r = await c.post("/v1/completions", json={"model": "x", **body})
            assert r.status_code == 404, r.text
            changes = (await c.get("/duetime/instances")).json()
            assert any(ch["change"] == "adapters" and ch["instance"] == "a"
                       for ch in changes["membership"]["recent"]), changes
    run(go())


def test_v1_models_answers_are_read_for_their_adapters():
    from duetime.gateway.state.pollers import listed_adapters

    pool = pool_from_dict(lora_config(), "test")
    body = (b'{"object":"list","data":[{"id":"base","parent":null},'
            b'{"id":"x","parent":"base","root":"/a/x"},{"id":"base","parent":"base"},'
            b'{"id":"z","parent":"base"}]}')
    assert listed_adapters(body, pool) == ("x", "z")
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        listed_adapters(b'{"data": 3}', pool)
