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
