"""The gateway with trained predictors as its quality source (``quality.predictor``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from duetime.cli import main
from duetime.gateway import ConfigError, pool_from_dict
from duetime.service import Service

PRICE = {"prompt": 0.1, "output": 0.2}


@pytest.fixture(scope="module")
def predictor(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("pred")
    assert main(["predict", "synth", "--out", str(d / "train.jsonl"), "--n", "150",
                 "--seed", "3"]) == 0
    assert main(["predict", "train", "--data", str(d / "train.jsonl"),
                 "--out", str(d / "model")]) == 0
    return str(d / "model")


def config(predictor: str, policy: str = "sfs") -> dict:
    def inst(name: str, profile: str) -> dict:
        return {"name": name, "model": profile, "profile": profile,
                "emulate": {"speed": 4.0}, "price_usd_per_mtok": PRICE}

    return {"policy": policy, "quality": {"predictor": predictor},
            "instances": [inst("a", "qwen3-8b"), inst("b", "qwen3-0.6b")]}


@pytest.mark.parametrize("policy", ["sfs", "laar"])
def test_routes_with_trained_predictions(predictor, policy) -> None:
    async def go():
        svc = await Service(pool_from_dict(config(predictor, policy), "test"),
                            drain_timeout_s=3.0).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                return await c.post("/v1/chat/completions", json={
                    "model": "auto", "max_tokens": 4, "messages": [
                        {"role": "user", "content": "Summarise the following report: ..."}]})
        finally:
            await svc.stop()

    r = asyncio.run(asyncio.wait_for(go(), 60))
    assert r.status_code == 200
    assert r.headers["x-duetime-model"] in ("qwen3-8b", "qwen3-0.6b")


def test_a_bad_predictor_is_a_config_error(tmp_path, predictor) -> None:
    with pytest.raises(ConfigError, match=r"quality\.predictor"):
        pool_from_dict(config(str(tmp_path / "missing")), "pool.yaml")
    cfg = config(predictor)
    cfg["quality"].update(workload=None, tasks={"chat": {"mystery": 0.5}})
    for inst in cfg["instances"]:
        inst["model"] = "mystery"
    with pytest.raises(ConfigError, match="knows no model"):
        pool_from_dict(cfg, "pool.yaml")


def test_a_deadline_policy_is_given_the_predicted_p90(predictor) -> None:
    """``sfs-deadline`` reads the length predictor's p90 head: its q = 0.9 length is the p90
    (capped as the median is), above the median it is given as ``output_tokens``; at q = 0.5
    the median."""
    async def go(q: float) -> dict:
        cfg = config(predictor)
        cfg["policy"] = {"name": "sfs-deadline", "q": q}
        svc = await Service(pool_from_dict(cfg, "test"), drain_timeout_s=3.0).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=20) as c:
                r = await c.post("/duetime/route", headers={"x-duetime-deadline-ms": "60000"},
                                 json={"model": "auto", "max_tokens": 100000, "messages": [
                                     {"role": "user", "content": "Write a long story."}]})
                assert r.status_code == 200, r.text
                return r.json()
        finally:
            await svc.stop()

    def q_lengths(q: float) -> list[tuple[float, float]]:
        got = asyncio.run(asyncio.wait_for(go(q), 60))
        return [(c["output_tokens_q"], c["output_tokens"]) for c in got["candidates"]]

    wide = q_lengths(0.9)  # (lengths are capped where the request's cap is: 256 here)
    assert all(n_q >= med for n_q, med in wide) and any(n_q > med for n_q, med in wide), wide
    assert all(n_q == med for n_q, med in q_lengths(0.5))
