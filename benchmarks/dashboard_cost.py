"""What the dashboard costs the gateway, and how fast it first paints.

A ``duetime serve`` over three ``duetime emulate`` processes (so that the gateway's process
is the gateway alone) takes an open-loop Poisson load (``--rate`` req/s, streamed text
completions); phases without and with dashboards watching alternate (``--pairs``), each
``--phase-s`` long. Per phase: the gateway's CPU (from /proc, % of one core), its CPU per
request, and its own count of the time spent for dashboards
(``duetime_dashboard_seconds_total``: the CPU time of building the updates and of explaining
the sampled decisions) as a share of its CPU. Then ``--paints`` fresh loads of ``/dashboard`` in headless
chromium (Debian's, through Playwright): first contentful paint and the first update drawn,
from navigation start.

    python benchmarks/dashboard_cost.py                  # 50 req/s, 2 pairs of 20 s phases
    python benchmarks/dashboard_cost.py --watchers 5 --rate 50 --phase-s 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replicas_live import MODELS, duetime, free_port, stop, wait_up


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def dashboard_seconds(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The gateway's CPU seconds for dashboards so far, by part (update, explain)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^duetime_dashboard_seconds_total\{part="(\w+)"\} (\S+)$', text, re.M)}


async def load(session: aiohttp.ClientSession, url: str, rate: float, seconds: float,
               rng: random.Random) -> int:
    """Poisson arrivals for ``seconds``; returns the requests answered with 200."""
    done = 0

    async def one() -> None:
        nonlocal done
        body = {"model": "auto", "prompt": [rng.randrange(1000, 30000) for _ in range(200)],
                "max_tokens": 16, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                pass
            done += r.status == 200

    tasks = []
    end = time.monotonic() + seconds
    t = time.monotonic()
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return done


async def watch(session: aiohttp.ClientSession, url: str, counter: list[int]) -> None:
    async with session.get(url + "/duetime/dashboard/events") as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                counter[0] += 1


async def measure(url: str, pid: int, args: argparse.Namespace) -> list[dict]:
    rows = []
    rng = random.Random(args.seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(120)) as s:
        await load(s, url, args.rate, 3.0, rng)  # (warm-up)
        for _ in range(args.pairs):
            for watchers in (0, args.watchers):
                counter = [0]
                ws = [asyncio.create_task(watch(s, url, counter)) for _ in range(watchers)]
                await asyncio.sleep(0.2)
                c0, d0, t0 = cpu_s(pid), await dashboard_seconds(s, url), time.monotonic()
                n = await load(s, url, args.rate, args.phase_s, rng)
                c1, d1, t1 = cpu_s(pid), await dashboard_seconds(s, url), time.monotonic()
                for w in ws:
                    w.cancel()
                await asyncio.gather(*ws, return_exceptions=True)
                wall, cpu = t1 - t0, c1 - c0
                parts = {k: v - d0.get(k, 0.0) for k, v in d1.items()}
                dash = sum(parts.values())
                rows.append({"watchers": watchers, "requests": n, "req_s": n / wall,
                             "cpu_pct": 100 * cpu / wall, "cpu_ms_per_req": 1e3 * cpu / n,
                             "dashboard_ms_s": 1e3 * dash / wall,
                             "update_ms_s": 1e3 * parts.get("update", 0.0) / wall,
                             "explain_ms_s": 1e3 * parts.get("explain", 0.0) / wall,
                             "dashboard_pct_of_gateway": 100 * dash / cpu,
                             "updates": counter[0]})
    return rows


def paints(url: str, n: int) -> list[tuple[float, float]]:
    from playwright.sync_api import sync_playwright

    exe = os.environ.get("DUETIME_CHROMIUM") or shutil.which("chromium")
    out = []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        for _ in range(n):
            page = b.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url + "/dashboard")
            page.wait_for_function("document.body.dataset.firstUpdateMs", timeout=30_000)
            fcp = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0]"
                                ".startTime")
            first = float(page.evaluate("document.body.dataset.firstUpdateMs"))
            out.append((fcp, first))
            page.close()
        b.close()
    return out


async def main_async(args: argparse.Namespace) -> None:
    procs = []
    emulators = {}
    for k, m in enumerate(MODELS):
        p = free_port()
        procs.append(duetime("emulate", "--profile", m, "--port", str(p), "--seed", str(k),
                             "--log-level", "error"))
        emulators[m] = f"http://127.0.0.1:{p}"
    pool = {"policy": args.policy, "instances": [{"name": m, "model": m, "profile": m,
                                                  "url": u} for m, u in emulators.items()]}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            async with aiohttp.ClientSession() as s:
                for u in emulators.values():
                    await wait_up(s, u, "/health")
            cfg = Path(tmp) / "pool.yaml"
            cfg.write_text(json.dumps(pool))
            port = free_port()
            gw = duetime("serve", "--config", str(cfg), "--port", str(port), "--log-level",
                         "error")
            procs.append(gw)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as s:
                await wait_up(s, url, "/health")
            rows = await measure(url, gw.pid, args)
            painted = await asyncio.to_thread(paints, url, args.paints) if args.paints else []
    finally:
        stop(procs)
    print(f"\n## Dashboard cost: policy {args.policy}, {args.rate:g} req/s offered, "
          f"{args.phase_s:g} s phases, {args.watchers} watcher(s) when on\n")
    print("| dashboards | req/s | gateway CPU (% of a core) | CPU ms/req | dashboard's own "
          "CPU (ms/s): updates + explanations | its share of the gateway's CPU | "
          "updates received |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['watchers']} | {r['req_s']:.1f} | {r['cpu_pct']:.1f}% | "
              f"{r['cpu_ms_per_req']:.2f} | {r['dashboard_ms_s']:.2f} = "
              f"{r['update_ms_s']:.2f} + {r['explain_ms_s']:.2f} | "
              f"{r['dashboard_pct_of_gateway']:.2f}% | {r['updates']} |")
    on = [r for r in rows if r["watchers"]]
    off = [r for r in rows if not r["watchers"]]
    share = statistics.mean(r["dashboard_pct_of_gateway"] for r in on)
    diff = (statistics.mean(r["cpu_ms_per_req"] for r in on)
            / statistics.mean(r["cpu_ms_per_req"] for r in off) - 1)
    print(f"\ndashboard's own time, mean share of the gateway's CPU while watched: "
          f"{share:.2f}% (target <= 1%)")
    print(f"gateway CPU per request, watched vs not (side by side, noisy): {diff:+.1%}")
    if painted:
        fcp = statistics.median(p[0] for p in painted)
        first = statistics.median(p[1] for p in painted)
        print(f"\n/dashboard over loopback, {len(painted)} fresh loads in headless chromium: "
              f"first contentful paint median {fcp:.0f} ms (max {max(p[0] for p in painted):.0f}),"
              f" first update drawn median {first:.0f} ms (max "
              f"{max(p[1] for p in painted):.0f}) (target <= 1000 ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--watchers", type=int, default=1)
    ap.add_argument("--paints", type=int, default=5)
    ap.add_argument("--policy", default="sfs")
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
