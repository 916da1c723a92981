"""Gateway replicas over one pool, with and without a shared store: how right are the forecasts?

Starts a real ``redis-server`` (loopback, free port) and, per variant, three fresh ``duetime
emulate`` processes (Qwen3 0.6B / 8B / 32B timing; fresh, so that no variant answers from the
prefix cache an earlier one filled) and ``duetime serve`` processes over them:

- ``single``: one gateway takes all the load (the reference);
- ``independent``: three gateways, each forecasting from its own requests only;
- ``shared``: three gateways sharing their in-flight requests through Redis
  (``--store redis://...``).

The same open-loop load (Poisson arrivals, prompts of random token ids, streamed) is spread
round-robin over the variant's gateways, as a load balancer would. For every request the
client records which replica and instance served it, the forecast TTFT the gateway sent in
``x-duetime-forecast-ttft-ms``, and the TTFT it observed (to the first streamed chunk). Each
replica's ``/duetime/instances`` is sampled while the load runs: ``in_flight_all -
in_flight`` is what it knows of the other replicas' requests.

Prints a table per variant: requests, median and p90 |forecast − observed| / observed, the
median observed / forecast ratio, on-time share, and the most other-replica requests each
replica held in view. ``--json FILE`` writes the numbers (``tests/test_replicas_live.py``
runs ``--quick``).

    python benchmarks/replicas_live.py                 # 3 variants, 300 requests each
    python benchmarks/replicas_live.py --quick         # 80 requests, shared and independent
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def duetime(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "duetime", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def wait_up(session: aiohttp.ClientSession, url: str, path: str,
                  timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url + path) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} did not answer within {timeout:.0f} s")


async def one(session: aiohttp.ClientSession, replica: int, url: str, prompt: list[int],
              max_tokens: int) -> dict[str, Any]:
    body = {"model": "auto", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=body) as r:
        h = r.headers
        ttft = None
        async for chunk in r.content.iter_any():
            if ttft is None and b"data:" in chunk:
                ttft = time.monotonic() - t0
        fc = h.get("x-duetime-forecast-ttft-ms")
        return {"replica": replica, "status": r.status, "instance": h.get("x-duetime-instance"),
                "forecast_s": None if fc is None else float(fc) / 1000.0, "ttft_s": ttft,
                "target_s": float(h.get("x-duetime-ttft-target-ms", "nan")) / 1000.0}


async def sample(session: aiohttp.ClientSession, urls: list[str], seen: list[int],
                 done: asyncio.Event) -> None:
    """The most other-replica requests each replica held in view, sampled every 50 ms."""
    while not done.is_set():
        for k, url in enumerate(urls):
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                async with session.get(url + "/duetime/instances") as r:
                    d = await r.json()
                remote = sum(i["in_flight_all"] - i["in_flight"] for i in d["instances"])
                seen[k] = max(seen[k], remote)
        await asyncio.sleep(0.05)


async def drive(urls: list[str], n: int, rate: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    lengths = rng.integers(200, 3000, n)
    outs = rng.integers(8, 48, n)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        for u in urls:
            await wait_up(s, u, "/health")
        for k, u in enumerate(urls):  # (warm each replica: first-call costs are not measured)
            for _ in range(3):
                await one(s, k, u, rng.integers(1, 30000, 64).tolist(), 2)
        seen = [0] * len(urls)
        done = asyncio.Event()
        sampler = asyncio.create_task(sample(s, urls, seen, done))
        tasks = []
        for i in range(n):
            await asyncio.sleep(float(gaps[i]))
            prompt = rng.integers(1, 30000, int(lengths[i])).tolist()
            k = i % len(urls)
            tasks.append(asyncio.create_task(one(s, k, urls[k], prompt, int(outs[i]))))
        got = await asyncio.gather(*tasks, return_exceptions=True)
        done.set()
        await sampler
        texts = []
        for u in urls:
            async with s.get(u + "/metrics") as r:
                texts.append(await r.text())
    recs = [g for g in got if isinstance(g, dict)]
    return {"records": recs, "errors": [repr(g)[:200] for g in got if not isinstance(g, dict)],
            "remote_seen": seen,
            "staleness_ms": quantiles(texts, "duetime_store_staleness_seconds"),
            "sync_ms": quantiles(texts, "duetime_store_sync_seconds")}


def quantiles(texts: list[str], name: str) -> list[float] | None:
    """p50 and p90 (bucket upper bounds, ms) of a histogram summed over the replicas."""
    counts: dict[float, float] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith(name + "_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                counts[float(le)] = counts.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    if not counts or counts[max(counts)] == 0:
        return None
    bounds = sorted(counts)
    total = counts[bounds[-1]]
    return [next(b for b in bounds if counts[b] >= q * total) * 1000 for q in (0.5, 0.9)]


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in out["records"] if r["status"] == 200 and r["ttft_s"] and r["forecast_s"]]
    if not ok:
        return {"requests": len(out["records"]), "scored": 0}
    obs = np.array([r["ttft_s"] for r in ok])
    fc = np.array([r["forecast_s"] for r in ok])
    err = np.abs(fc - obs) / obs
    on_time = np.mean([r["ttft_s"] <= r["target_s"] for r in ok])
    by_replica = {}
    for k in sorted({r["replica"] for r in ok}):
        e = err[[r["replica"] == k for r in ok]]
        by_replica[k] = float(np.median(e))
    return {"requests": len(out["records"]), "scored": len(ok),
            "errors": len(out["errors"]),
            "median_abs_err": float(np.median(err)), "p90_abs_err": float(np.quantile(err, 0.9)),
            "median_ratio": float(np.median(obs / fc)), "on_time": float(on_time),
            "median_abs_err_by_replica": by_replica, "remote_seen": out["remote_seen"],
            "staleness_ms": out["staleness_ms"], "sync_ms": out["sync_ms"],
            "served": {m: sum(r["instance"] == m for r in ok) for m in MODELS}}


async def variant(name: str, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant over fresh emulators (an emulator that served the same prompts before
    would answer from its prefix cache) and its gateways."""
    procs: list[subprocess.Popen[bytes]] = []
    emulators = {}
    for k, m in enumerate(MODELS):
        p = free_port()
        procs.append(duetime("emulate", "--profile", m, "--port", str(p), "--seed", str(k),
                             "--speed", str(args.speed), "--log-level", "error"))
        emulators[m] = f"http://127.0.0.1:{p}"
    pool = {"policy": "sfs", "state": {"source": "shadow"},
            "instances": [{"name": m, "model": m, "profile": m, "url": u}
                          for m, u in emulators.items()]}
    replicas = 1 if name == "single" else 3
    try:
        with tempfile.TemporaryDirectory() as tmp:
            async with aiohttp.ClientSession() as s:
                for u in emulators.values():
                    await wait_up(s, u, "/health")
            cfg = Path(tmp) / "pool.yaml"
            cfg.write_text(json.dumps(pool))
            ports = [free_port() for _ in range(replicas)]
            procs += [duetime("serve", "--config", str(cfg), "--port", str(p), "--log-level",
                              "error", *(["--store", redis_url] if name == "shared" else []))
                      for p in ports]
            out = await drive([f"http://127.0.0.1:{p}" for p in ports], args.requests,
                              args.rate, args.seed)
    finally:
        stop(procs)
    return {"variant": name, **summarize(out), "error_samples": out["errors"][:5],
            "records": out["records"]}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("replicas_live: redis-server is not installed "
                         "(bash scripts/system_deps.sh)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        rport = free_port()
        redis = subprocess.Popen(
            [exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for name in args.variants:
                t0 = time.monotonic()
                r = await variant(name, f"redis://127.0.0.1:{rport}/0", args)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                results.append(r)
                print(f"  {name}: {r.get('scored', 0)} scored, {r['wall_s']} s", flush=True)
        finally:
            stop([redis])
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | requests (scored) | median / p90 |error| | median observed/forecast "
             "| on time | others' requests in view (max, per replica) | served 0.6b / 8b / 32b "
             "| staleness p50 / p90 (ms, ≤) | sync p50 / p90 (ms, ≤) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r.get("scored"):
            lines.append(f"| {r['variant']} | {r['requests']} (0) | – | – | – | – | – | – | – |")
            continue
        sv = r["served"]
        lines.append(
            f"| {r['variant']} | {r['requests']} ({r['scored']}) | "
            f"{r['median_abs_err']:.1%} / {r['p90_abs_err']:.1%} | {r['median_ratio']:.2f} | "
            f"{r['on_time']:.1%} | {', '.join(map(str, r['remote_seen']))} | "
            f"{' / '.join(str(sv[m]) for m in MODELS)} | {_pair(r['staleness_ms'])} | "
            f"{_pair(r['sync_ms'])} |")
    return "\n".join(lines)


def _pair(q: list[float] | None) -> str:
    return "–" if q is None else f"{q[0]:g} / {q[1]:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="per variant (default 300)")
    ap.add_argument("--rate", type=float, default=6.0, help="arrivals per second (default 6)")
    ap.add_argument("--speed", type=float, default=1.0, help="emulator speed (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="single,independent,shared",
                    help="comma-separated: single, independent, shared")
    ap.add_argument("--quick", action="store_true",
                    help="80 requests, independent and shared only (the test's run)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the numbers here")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.quick:
        args.requests, args.variants = 80, ["independent", "shared"]
    bad = [v for v in args.variants if v not in ("single", "independent", "shared")]
    if bad:
        ap.error(f"unknown variant(s): {', '.join(bad)}")
    print(f"replicas_live: {args.requests} requests at {args.rate}/s per variant, "
          f"{os.cpu_count()} CPUs", flush=True)
    results = asyncio.run(main_async(args))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
