"""The online correction of TTFT forecasts (duetime.estimate.correction), alone and in the
gateway against an emulator whose speed changes while it runs."""

from __future__ import annotations

import random

import httpx
import pytest

from duetime.estimate.correction import TtftCorrection, correction_factor


def test_the_factor_is_the_bounded_median_of_recent_ratios() -> None:
    c = TtftCorrection(window=8, min_samples=4, low=0.5, high=3.0)
    for _ in range(3):
        c.observe(0.1, 0.2)
    assert c.factor == 1.0  # still learning
    c.observe(0.1, 0.2)
    assert c.factor == pytest.approx(2.0)
    for _ in range(8):
        c.observe(0.1, 1.0)  # ten times slower: bounded
    assert c.factor == 3.0
    for _ in range(8):
        c.observe(0.1, 0.01)
    assert c.factor == 0.5
    c.observe(0.0, 1.0)  # (no forecast: ignored)
    c.observe(0.1, float("inf"))
    assert c.observed == 20
    off = TtftCorrection(enabled=False)
    off.observe(0.1, 0.3)
    assert off.factor == 1.0
    assert correction_factor(object()) == 1.0
    with pytest.raises(ValueError):
        TtftCorrection(window=4, min_samples=5)


def test_a_stable_instance_does_not_wander_and_outliers_do_not_move_it() -> None:
    """Ratios around 1.1 with ±20% noise and one request in ten ten times slower (a paused
    process): the factor stays within a few percent of the typical ratio."""
    rng = random.Random(0)
    c = TtftCorrection()
    seen = []
    for i in range(400):
        slow = 10.0 if i % 10 == 0 else 1.0
        c.observe(0.05, 0.05 * 1.1 * rng.uniform(0.8, 1.2) * slow)
        if i >= 50:
            seen.append(c.factor)
    assert min(seen) > 1.0 and max(seen) < 1.3


def test_the_gateway_tracks_an_instance_that_slows_down() -> None:
    """One emulated instance; requests one at a time: the correction settles near 1 (the
    emulator runs the forecast's own engine), then, after the emulator is made three times
    slower, follows within 40 requests to about 3, and the corrected forecasts are close to the
    observed TTFTs again."""
    from test_gateway import PRICE, gateway, run

    cfg = {"policy": "sfs", "quality": {"workload": None, "tasks": {"chat": {"m": 0.5}}},
           "instances": [{"name": "e", "model": "m", "profile": "qwen3-32b",
                          "emulate": {"speed": 0.5, "enable_prefix_caching": False},
                          "price_usd_per_mtok": PRICE}],
           # (the replica's forecasts: a published snapshot would carry the emulator's new
           # speed itself, and need no correction)
           "state": {"source": "shadow"}}
    prompt = [7] * 800

    async def go():
        async with gateway(cfg) as (svc, c):
            inst = svc.gateway.instances[0]

            async def ask() -> httpx.Response:
                r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt,
                                                          "max_tokens": 2})
                assert r.status_code == 200, r.text
                return r

            for _ in range(24):
                first = await ask()
            before = inst.ttft_correction.factor
            svc.emulators["e"].set_speed(0.5 / 3)
            after = []
            for _ in range(40):
                await ask()
                after.append(inst.ttft_correction.factor)
            r = await ask()
            metrics = (await c.get("/metrics")).text
            return first, before, after, r, metrics

    first, before, after, r, metrics = run(go(), timeout=120)
    print(f"\ncorrection before {before:.3f}; after the slowdown, every 10 requests: "
          f"{', '.join(f'{x:.2f}' for x in after[9::10])}")
    # (the forecast replays the emulator's own engine: what is left is the HTTP path, a few
    # ms beside ~100 ms of prefill here; a slower machine's larger share still passes)
    assert 0.8 < before < 1.5, before
    assert 2.0 < after[-1] / before < 4.5, (before, after)
    # the same prompt on the same idle instance: the forecast grew by the correction's factor
    grown = float(r.headers["x-duetime-forecast-ttft-ms"]) / float(
        first.headers["x-duetime-forecast-ttft-ms"])
    assert grown == pytest.approx(after[-1] / before, rel=0.1)
    assert 'duetime_ttft_correction{instance="e"}' in metrics


def test_the_step_correction_is_the_median_of_token_ratios() -> None:
    from duetime.estimate.correction import StepCorrection

    c = StepCorrection(window=4, min_samples=2, steps_per_sample=10)
    c.observe(20, 10)  # the replica made twice the instance's tokens: steps take twice as long
    assert c.factor == 1.0  # (one sample: still learning)
    c.observe(10, 5)
    c.observe(10, 5)
    assert c.factor == pytest.approx(2.0)
    c.applied = 2.0  # (the replica now steps at the corrected time: it keeps pace)
    for _ in range(4):
        c.observe(10, 10)
    assert c.factor == pytest.approx(2.0)
    for _ in range(4):
        c.observe(1000, 10)  # bounded
    assert c.factor == 4.0
    c.observe(-1, 5)  # (a replica that moved back: ignored)
    with pytest.raises(ValueError):
        StepCorrection(window=2, min_samples=3)


def test_a_step_sample_spans_steps_not_tokens() -> None:
    """Thirty streams one step each make 30 tokens but one step: the replica a step ahead of
    the instance there is no sample (it would say 2); over ten steps it is one, off by 1/10."""
    from duetime.estimate.correction import StepCorrection

    c = StepCorrection(window=4, min_samples=1, steps_per_sample=10)
    c.observe(60, 30, streams=30)  # one step: the replica stands one step further
    assert c.factor == 1.0
    for _ in range(9):
        c.observe(30, 30, streams=30)
    assert c.factor == pytest.approx(330 / 300)


def test_a_replica_takes_a_new_step_factor_only_when_it_moved() -> None:
    from duetime.estimate.correction import SETTLE_MOVE, StepCorrection

    c = StepCorrection(window=1, min_samples=1, steps_per_sample=1)
    c.observe(1005, 1000)
    assert c.settle() is None and c.applied == 1.0  # (0.5%: the replica keeps its model)
    c.observe(110, 100)
    assert c.settle() == pytest.approx(1.1) and c.applied == pytest.approx(1.1)
    assert SETTLE_MOVE == 0.01


def test_the_replica_steps_at_the_pace_the_instance_streams() -> None:
    """``state.step_correction``: one emulated instance streaming 32-token answers to four
    clients; the replica's step factor settles, then, after the emulator is made three times
    slower, follows it (the factor grows about threefold: a ratio of one run's factors, so
    the machine's own pace cancels out)."""
    import asyncio

    from test_gateway import PRICE, gateway, run

    cfg = {"policy": "sfs", "quality": {"workload": None, "tasks": {"chat": {"m": 0.5}}},
           "instances": [{"name": "e", "model": "m", "profile": "qwen3-8b",
                          "emulate": {"speed": 2.0, "enable_prefix_caching": False},
                          "price_usd_per_mtok": PRICE}],
           "state": {"source": "shadow", "step_correction": True}}

    async def go():
        async with gateway(cfg) as (svc, c):
            inst = svc.gateway.instances[0]

            async def stream() -> None:
                body = {"model": "m", "prompt": "go", "max_tokens": 32, "stream": True,
                        "ignore_eos": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    await r.aread()

            async def load(n: int) -> None:
                async def worker() -> None:
                    for _ in range(n):
                        await stream()
                await asyncio.gather(*(worker() for _ in range(4)))

            await load(12)
            before = inst.step_correction.applied
            svc.emulators["e"].set_speed(2.0 / 3)
            await load(12)
            after = inst.step_correction.applied
            desc = (await c.get("/duetime/instances")).json()["instances"][0]
            return before, after, desc

    before, after, desc = run(go(), timeout=180)
    print(f"\nstep factor before {before:.3f}, after the slowdown {after:.3f}")
    assert 2.0 < after / before < 4.5, (before, after)
    assert desc["step_correction"] == pytest.approx(after, abs=1e-3)
