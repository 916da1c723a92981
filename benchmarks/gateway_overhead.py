"""How much latency does the gateway add? Direct to an emulator vs through the gateway.

Starts, as subprocesses on loopback, one emulated instance (``duetime emulate``, Qwen3-0.6B
timing sped up ``--speed`` times, so that engine time is small beside HTTP) and a gateway
(``duetime serve``) whose pool is that one instance. Then, from this process, at each
concurrency (1, 16, 64 clients in closed loop), streams the same requests (a short chat prompt,
``max_tokens`` 8 with ``ignore_eos``) to the emulator directly and through the gateway, in
alternating rounds, and prints p50 / p99 of time to first token and of the whole response for
both, and the difference (the gateway's added latency).

The gateway runs its full hot path: prompt estimate, the policy (``--policy``, default ``sfs``:
an engine-replay forecast per candidate on the published snapshot it polls every 50 ms),
upstream stream with retries armed, pass-through, metrics and logs (at warning level, as a busy
deployment would run). On a small machine the three processes share the cores: the numbers
include that contention, and move by tens of percent from run to run — compare the columns
within one run. The LiteLLM comparison of the issue is not part of this script yet.

    python benchmarks/gateway_overhead.py [--requests N] [--speed X] [--policy NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONCURRENCY = (1, 16, 64)
BODY = {"model": "qwen3-0.6b", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "ignore_eos": True, "stream": True}


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "duetime", *args, "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].split()[0]
    proc.kill()
    raise SystemExit(f"could not start: duetime {' '.join(args)}")


async def _one(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=BODY) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for chunk in r.aiter_raw():
            if first is None and chunk:
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def _round(client: httpx.AsyncClient, url: str, conc: int, n: int,
                 out: list[tuple[float, float]]) -> None:
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            out.append(await _one(client, url))

    await asyncio.gather(*(worker() for _ in range(conc)))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc; else 0)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _measure(direct: str, gateway: str, n: int, rounds: int,
                   pids: tuple[int, int]) -> list[list[str]]:
    rows = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        for url in (direct, gateway):  # warm up both paths and their connections
            await _round(client, url + "/v1/chat/completions", 16, 64, [])
        for conc in CONCURRENCY:
            res: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
            per = max(conc, n // rounds)
            cpu = {"direct": [0.0, 0.0], "gateway": [0.0, 0.0]}  # (emulator, gateway) CPU s
            for _ in range(rounds):
                for name, url in (("direct", direct), ("gateway", gateway)):
                    before = [_cpu_s(p) for p in pids]
                    await _round(client, url + "/v1/chat/completions", conc, per, res[name])
                    for i, p in enumerate(pids):
                        cpu[name][i] += _cpu_s(p) - before[i]
            d, g = res["direct"], res["gateway"]
            dt, gt = [x[0] for x in d], [x[0] for x in g]
            de, ge = [x[1] for x in d], [x[1] for x in g]
            rows.append([str(conc), str(len(d)),
                         f"{_pct(dt, .5):.2f}", f"{_pct(gt, .5):.2f}",
                         f"{_pct(gt, .5) - _pct(dt, .5):+.2f}",
                         f"{_pct(dt, .99):.2f}", f"{_pct(gt, .99):.2f}",
                         f"{_pct(gt, .99) - _pct(dt, .99):+.2f}",
                         f"{statistics.median(ge) * 1000 - statistics.median(de) * 1000:+.2f}",
                         f"{cpu['gateway'][1] / len(g) * 1000:.2f}",
                         f"{cpu['direct'][0] / len(d) * 1000:.2f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="requests per path and "
                    "concurrency (default 600)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations direct/gateway")
    ap.add_argument("--speed", type=float, default=20.0, help="emulator speed-up (default 20)")
    ap.add_argument("--policy", default="sfs", help="gateway policy (default sfs)")
    args = ap.parse_args()

    emu, direct = _start(["emulate", "--profile", "qwen3-0.6b", "--speed", str(args.speed)])
    procs = [emu]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "pool.yaml"
            cfg.write_text(f"policy: {args.policy}\ninstances:\n  - name: emu\n"
                           f"    model: qwen3-0.6b\n    url: {direct}\n"
                           f"    profile: qwen3-0.6b\n    speed: {args.speed}\n")
            gw, gateway = _start(["serve", "--config", str(cfg)])
            procs.append(gw)
            rows = asyncio.run(_measure(direct, gateway, args.requests, args.rounds,
                                        (emu.pid, gw.pid)))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    header = ["conc", "n", "ttft p50 direct", "gateway", "added", "ttft p99 direct",
              "gateway", "added", "e2e p50 added", "gw cpu/req", "emu cpu/req"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"gateway overhead, ms (emulator qwen3-0.6b x{args.speed:g}, policy {args.policy}, "
          f"streamed chat, 8 output tokens)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    note = ("gw cpu/req: the gateway process's CPU per request through it (scrapes and probes "
            "included); emu cpu/req: the emulator's per direct request.")
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    print(note)


if __name__ == "__main__":
    main()
