"""Forecast fidelity on a real vLLM, asserted with a tolerance (the tiny-large server of
``vllm_pool``, calibrated by the fixture as an operator would).

Two measurements, each kept off the server's engine core (the client, the gateway and the
server's API process on the other cores, ``conftest.off_core``), so that the number measures
the model, not this machine's contention:

* **the harness**: ``duetime validate`` driving the server directly at two loads, every request
  replayed through the engine: the pooled median and p90 of |predicted / observed - 1| of the
  TTFT, and the median of each request's inter-token latency (the batch-time model alone);
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
(``machine_noise``; 1.3-3.6% there). A profile twice off (a ~50% error) fails.

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
ITL_MEDIAN = 0.15  # the replay's inter-token latency: the batch-time model alone
NOISE_FACTOR_MEDIAN, NOISE_FACTOR_P90 = 4.0, 10.0  # how much the machine's noise widens them


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


def machine_noise(server, n: int = 12) -> float:
    """This machine's noise on the server: the median relative deviation of the TTFT of
    identical lone requests (256 random token ids, one output token) from their median."""
    rng = random.Random(7)

    async def go() -> list[float]:
        async with httpx.AsyncClient(timeout=60) as c:
            out = []
            for _ in range(n + 2):
                body = {"model": server.name, "prompt": _ids(rng, 256), "max_tokens": 1,
                        "temperature": 0, "stream": True}
                out.append((await _ttft(c, server.base_url, body))[0])
            return out[2:]  # (the first two warm the connection)

    ttfts = asyncio.run(go())
    med = statistics.median(ttfts)
    return statistics.median(abs(t / med - 1) for t in ttfts)


def test_forecast_fidelity_is_within_tolerance(large, vllm_pool, tmp_path):
    with off_core(large.engine_core, [large.pid]):
        noise = machine_noise(large)
        harness = _harness(large, tmp_path)
        live = _live(large, vllm_pool, tmp_path)
    def tol(median: float, p90: float) -> tuple[float, float]:
        return (max(median, NOISE_FACTOR_MEDIAN * noise), max(p90, NOISE_FACTOR_P90 * noise))

    got = {k: (harness[f"{k}ttft_median_abs_pct_error"], harness[f"{k}ttft_p90_abs_pct_error"])
           for k in ("", "corrected_")}
    tols = {"": tol(STATIC_MEDIAN, STATIC_P90),
            "corrected_": tol(CORRECTED_MEDIAN, CORRECTED_P90)}
    tol_live = tol(LIVE_MEDIAN, 1.0)[0]
    itl, tol_itl = harness["itl_median_abs_pct_error"], tol(ITL_MEDIAN, 1.0)[0]
    print(f"\nforecast fidelity on tiny-large (machine noise {noise:.1%}):\n"
          + "".join(f"  harness{' ' + k[:-1] if k else ''}: |error| median {got[k][0]:.1%} "
                    f"(tolerance {tols[k][0]:.1%}), p90 {got[k][1]:.1%} (tolerance "
                    f"{tols[k][1]:.1%})\n" for k in got)
          + "  per load: " + ", ".join(f"{k}: {v['ttft_median_abs_pct_error']:.1%}"
                                       for k, v in harness["per_load"].items())
          + f"\n  inter-token latency: |error| median {itl:.1%} (tolerance {tol_itl:.1%})"
          + f"\n  live, 5 clients through the gateway: |error| median {live['median']:.1%} "
          f"(tolerance {tol_live:.1%}), p90 {live['p90']:.1%}, bias {live['bias']:+.1%}, "
          f"{live['n']} requests")
    assert harness["failed"] == 0, harness["errors"]
    for k in got:
        assert got[k][0] <= tols[k][0] and got[k][1] <= tols[k][1], (k, got, tols)
    assert itl <= tol_itl, (itl, tol_itl)
    assert live["median"] <= tol_live, live


def _harness(server, tmp_path) -> dict[str, Any]:
    """``duetime validate`` against the server at 30% and 60% of its capacity."""
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(server.calibration))
    out = tmp_path / "validate"
    assert main(["validate", server.base_url, "--model", server.name, "--profile",
                 str(profile), "--out", str(out), "--loads", "0.3,0.6", "--requests", "30",
                 "--max-prompt", "1024", "--max-output", "64", "--pause", "0.5",
                 "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    with (out / "results.csv").open() as f:  # (why any request failed, for the assertion)
        summary["errors"] = [r["error"] for r in csv.DictReader(f) if r.get("error")][:5]
    return summary


def _live(server, vllm_pool, tmp_path, clients: int = 5, requests: int = 80
          ) -> dict[str, float]:
    """Five closed-loop clients through a gateway over the pool, on ``server``'s model."""
    cfg = pool_config(vllm_pool, instances=[instance_config(s) for s in vllm_pool])
    rng = random.Random(11)
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

