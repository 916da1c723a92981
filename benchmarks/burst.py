"""Where does a burst go, and how wrong are the forecasts under it?

The demo pool (Qwen3 0.6B / 8B / 32B on H100 timing, emulated in the gateway's own process, as
``duetime serve`` runs it) behind ``duetime serve --config`` (its own process), policy
``sfs``; the client in this process. For each setting of ``admission.gateway_load`` (the
gateway's own CPU in the forecasts: on, off), in turn in one run: a fresh gateway,
``--warmup`` requests one after another (so that a measuring window closes), then ``--burst``
streamed requests at once (a short chat, ``max_tokens`` 4). Prints, per setting: how many requests each instance served, the burst's
wall time, TTFT p50 / p90 as the client saw it and as the gateway did (from a request's
arrival: ``duetime_ttft_seconds``), and the forecast's error under the burst, observed over
forecast TTFT from the routing decision (``duetime_forecast_ttft_ratio``, p50 / p90). The two
histograms are read from the gateway's ``/metrics`` before and after the burst; their
quantiles are bucket bounds.

    python benchmarks/burst.py [--burst 500] [--warmup 60] [--rounds 1] [--speed 1]

A last row, ``capacity``, says what each instance can serve of such a burst: the share of the
pool's rate if each served the whole burst alone (its engine and batch-time model, the burst's
requests at once: a 12-token prompt, 4 output tokens), the split a burst spread "in
proportion to what each can serve" would have, and in the last column those rates (requests/s).
The column before it, the burst over its wall time, bounds the rate at which the gateway passed
the burst on: where every instance's rate is above it, the engines were not the bottleneck (each
could have taken the whole burst as it came) and the fastest forecasts win, not the capacity
split; ``--speed`` slows the emulated instances until they are.

The client (aiohttp: with httpx the client itself spent 6.7 s of CPU on a burst of 500 and
was the bottleneck; a client in the gateway's own process does not make a burst at all) and
the gateway share the machine's cores: compare the rows of one run. The last column is the
CPU seconds each spent during the burst.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from duetime.engine.engine import Engine
from duetime.engine.profiles import load_profile
from duetime.service.pool import DEMO_MODELS

ROOT = Path(__file__).resolve().parents[1]

BODY = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "hello"}],
                   "max_tokens": 4, "stream": True}).encode()


async def one(session: aiohttp.ClientSession, url: str) -> tuple[str, float, float]:
    """(instance, observed TTFT s, forecast TTFT s) of one streamed request."""
    t0 = time.monotonic()
    first = None
    async with session.post(f"{url}/v1/chat/completions", data=BODY,
                            headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - t0
    return (r.headers["x-duetime-instance"], first or float("nan"),
            float(r.headers["x-duetime-forecast-ttft-ms"]) / 1000)


async def buckets(session: aiohttp.ClientSession, url: str, name: str) -> Counter:
    """Cumulative bucket counts of histogram ``name`` (summed over its instances)."""
    out: Counter = Counter()
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_bucket":
                out[float(s.labels["le"])] += s.value
    return out


def bucket_pct(before: Counter, after: Counter, q: float) -> float:
    """The bucket bound where the burst's (after - before) cumulative count reaches ``q``."""
    bounds = sorted(after)
    total = after[math.inf] - before[math.inf]
    for b in bounds:
        if after[b] - before[b] >= q * total:
            return b
    return math.inf


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def run(gateway_load: bool, burst: int, warmup: int, speed: float) -> dict:
    pool = {"policy": "sfs", "admission": {"gateway_load": gateway_load},
            "instances": [{"name": m, "model": m, "emulate": {"speed": speed, "seed": k}}
                          for k, m in enumerate(DEMO_MODELS)]}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "pool.yaml"
        cfg.write_text(json.dumps(pool))
        proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--config", str(cfg),
                                 "--port", str(port), "--log-level", "error"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=300)) as c:
                for _ in range(600):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with c.get(f"{url}/health") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
                for _ in range(warmup):
                    await one(c, url)
                hists = ("duetime_ttft_seconds", "duetime_forecast_ttft_ratio")
                before = {h: await buckets(c, url, h) for h in hists}
                t0, cpu0, gw0 = time.monotonic(), time.process_time(), cpu_s(proc.pid)
                got = await asyncio.gather(*(one(c, url) for _ in range(burst)),
                                           return_exceptions=True)
                wall = time.monotonic() - t0
                cpu = (time.process_time() - cpu0, cpu_s(proc.pid) - gw0)
                after = {h: await buckets(c, url, h) for h in hists}
            errors = [g for g in got if isinstance(g, BaseException)]
            got = [g for g in got if not isinstance(g, BaseException)]
        finally:
            proc.terminate()
            proc.wait(30)
    return {"served": Counter(i for i, _, _ in got), "wall": wall, "cpu": cpu,
            "errors": [repr(e)[:120] for e in errors],
            "ttft": [t for _, t, _ in got],
            "gw_ttft": [bucket_pct(before[hists[0]], after[hists[0]], q) for q in (0.5, 0.9)],
            "ratio": [bucket_pct(before[hists[1]], after[hists[1]], q) for q in (0.5, 0.9)]}


def capacity(names: tuple[str, ...], burst: int, speed: float) -> dict[str, float]:
    """Each instance's rate on the burst, served alone (requests/s; see the doc)."""
    rate = {}
    for name in names:
        p = load_profile(name).scaled(speed)
        e = Engine(p.config, p.batch_time, time=0.0, retain_finished=False)
        for i in range(burst):
            e.add(f"r{i}", 12, 4, arrival=0.0)
        e.drain()
        rate[name] = burst / e.time
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1, help="each setting this many times")
    ap.add_argument("--speed", type=float, default=1.0,
                    help="the emulated instances run X times faster (default 1: H100 timing; "
                    "below ~0.03 the engines, not the gateway, are the burst's bottleneck)")
    args = ap.parse_args()
    names = tuple(DEMO_MODELS)
    print("| gateway_load | round | " + " | ".join(names) + " | failed | wall (s) | client TTFT "
          "p50 / p90 (ms) | gateway TTFT p50 / p90 (ms, ≤) | observed / forecast p50 / p90 (≤) | "
          "CPU s: client / gateway | burst / wall (req/s) |")
    print("|---|---|" + "---|" * len(names) + "---|---|---|---|---|---|---|")
    for k in range(args.rounds):
        for gl in (True, False):
            r = asyncio.run(run(gl, args.burst, args.warmup, args.speed))
            print(f"| {'on' if gl else 'off'} | {k + 1} | "
                  + " | ".join(str(r["served"].get(n, 0)) for n in names)
                  + f" | {len(r['errors'])} | {r['wall']:.1f} | {statistics.median(r['ttft']) * 1000:.0f} / "
                  f"{pct(r['ttft'], 0.9) * 1000:.0f} | {r['gw_ttft'][0] * 1000:g} / "
                  f"{r['gw_ttft'][1] * 1000:g} | {r['ratio'][0]:g} / {r['ratio'][1]:g} | "
                  f"{r['cpu'][0]:.1f} / {r['cpu'][1]:.1f} | {args.burst / r['wall']:.0f} |",
                  flush=True)
            for e in r["errors"][:3]:
                print(f"    {e}", file=sys.stderr)
    rate = capacity(names, args.burst, args.speed)
    total = sum(rate.values())
    print("| capacity | | " + " | ".join(f"{rate[n] / total * args.burst:.0f}" for n in names)
          + " | | | | | | | " + " / ".join(f"{rate[n]:.0f}" for n in names) + " |")


if __name__ == "__main__":
    main()
