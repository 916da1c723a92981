"""Does a plan's predicted attainment hold when its pool is served?

`duetime plan`'s search on a stream of requests (the paper's workload at --rate, each request's
output the same for every model so that a client can ask for it: ``max_tokens`` with
``ignore_eos``), then the pool it picks written as `pool.yaml` (emulated instances) and served
by `duetime serve --config pool.yaml` (its own process); the same stream replayed against it
in real time by a client in this process (aiohttp, streamed completions whose prompts are token
ids of the request's length, its task and TTFT target in the headers). Prints, per class and
overall, the on-time rate the plan predicted and the one the client measured (TTFT from
sending a request to its first token), and their difference in points.

    python benchmarks/plan_vs_serve.py [--rate 4] [--requests 1200] [--gpus h100]
        [--quality 0.8] [--on-time 0.95] [--seed 0]

One run, on a shared 2-core machine: the gateway, its emulated instances and the client share
the cores; the client's CPU time is printed beside the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np

from duetime.experiments.runner import Point
from duetime.plan.evaluate import Evaluator, pool_label
from duetime.plan.problem import problem_from_dict
from duetime.plan.report import write_pools
from duetime.plan.search import search

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 150_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_output_per_request(reqs, column: int):
    """The stream with every model's output set to one model's (a client can ask for it)."""
    out = np.repeat(reqs.output[:, column:column + 1], reqs.output.shape[1], axis=1)
    return replace(reqs, output=out)


async def send(c: aiohttp.ClientSession, url: str, prompt: list[int], out: int, task: str,
               target_ms: float) -> float:
    """TTFT (s) of one streamed completion, from sending it to its first token's chunk."""
    body = {"model": "auto", "prompt": prompt, "max_tokens": int(out), "ignore_eos": True,
            "stream": True}
    headers = {"x-duetime-task": task, "x-duetime-ttft-ms": f"{target_ms:.3f}"}
    t0 = time.monotonic()
    first = math.inf
    async with c.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if first == math.inf and line.startswith(b"data: {"):
                first = time.monotonic() - t0
    return first


async def replay(url: str, reqs, tasks: list[str], seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as c:
        for _ in range(600):
            with contextlib.suppress(aiohttp.ClientError):
                async with c.get(f"{url}/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.1)
        t0 = time.monotonic()
        jobs = []
        for i in range(len(reqs.arrival)):
            delay = reqs.arrival[i] - reqs.arrival[0] - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = rng.integers(1, VOCAB, int(reqs.prompt[i])).tolist()
            jobs.append(asyncio.create_task(send(
                c, url, prompt, int(reqs.output[i, 0]), tasks[reqs.task[i]],
                float(reqs.target[i]) * 1000)))
        return await asyncio.gather(*jobs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--gpus", default="h100")
    ap.add_argument("--quality", type=float, default=0.8)
    ap.add_argument("--on-time", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prob = problem_from_dict({
        "rate": args.rate, "gpus": args.gpus.split(","), "max_replicas": 4,
        "requests": args.requests, "max_requests": args.requests, "seed": args.seed,
        "constraints": {"on_time": args.on_time, "quality": args.quality}})
    ev = Evaluator(prob)
    full = ev.requests()
    stream = one_output_per_request(full, full.models.index("qwen3-8b"))
    for n in {args.requests, max(250, args.requests // 4)}:  # the screening run's too
        ev.runner.set_stream(Point(prob.router, prob.rate, n), stream.head(n))
    t0 = time.perf_counter()
    found = search(prob, ev)
    print(f"plan: {time.perf_counter() - t0:.1f} s, {found.simulations} simulations",
          file=sys.stderr)
    if found.best is None:
        raise SystemExit("no pool meets the constraints; try a lower --rate")
    best = found.best
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        write_pools(Path(tmp), prob, best.pool)
        proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--config",
                                 str(Path(tmp) / "pool.yaml"), "--port", str(port),
                                 "--log-level", "error"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            cpu0, w0 = time.process_time(), time.monotonic()
            ttft = np.array(asyncio.run(replay(f"http://127.0.0.1:{port}", stream,
                                               prob.classes, args.seed)))
            cpu, wall = time.process_time() - cpu0, time.monotonic() - w0
        finally:
            proc.terminate()
            proc.wait(30)
    hit = ttft <= stream.target
    rows = []
    for k, name in enumerate(prob.classes):
        mine = stream.task == k
        rows.append((name, int(mine.sum()), best.on_time[name], float(hit[mine].mean())))
    rows.append(("all", len(hit), best.on_time_all, float(hit.mean())))
    print(f"\nthe paper's workload at {args.rate:g} q/s, {len(hit)} requests "
          f"({stream.arrival[-1] - stream.arrival[0]:.0f} s); plan: {pool_label(best.pool)}, "
          f"{best.cost:.2f} USD/h; served by duetime serve (emulated), {os.cpu_count()} CPUs; "
          f"client {cpu:.0f} CPU-s over {wall:.0f} s\n")
    print("| class | requests | predicted on time | served on time | difference (points) |")
    print("|---|---|---|---|---|")
    for name, n, pred, got in rows:
        print(f"| {name} | {n} | {pred:.3f} | {got:.3f} | {100 * (got - pred):+.1f} |")
    print(f"\nTTFT p50 / p90 served: {np.median(ttft) * 1000:.0f} / "
          f"{np.quantile(ttft, 0.9) * 1000:.0f} ms")
    print(json.dumps({"worst_abs_difference_points": max(abs(100 * (g - p))
                                                         for _, _, p, g in rows)}))


if __name__ == "__main__":
    main()
