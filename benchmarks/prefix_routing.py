"""Routing a shared-prefix load over two real vLLM servers: sfs vs prefix-load vs load-aware.

Starts the e2e suite's two tiny vLLM servers (CPU build, ``scripts/vllm_cpu/setup_env.sh``;
prefix caching on, KV events published, each engine on its own core), calibrates them with
``duetime calibrate``'s code, then, for each policy in turn, runs a duetime gateway over them
(in this process; the pool of ``tests/e2e/gateway_pool.py``: KV events, the models' tokenizer
folder) and drives it with the same shared-prefix load:

* conversations arrive as a Poisson process (``--rate`` per second); pairs share a system
  prompt of ``--system-words`` words; each has ``--turns`` user turns, the next sent a
  think time (exponential, mean ``--think`` s) after the previous answer ended, with the
  answer in its history (multi-turn chat);
* every request is ``model: auto``, streamed, ``max_tokens`` 16 with ``ignore_eos``, and
  carries the pool's default TTFT target (``ttft_target``; its own ``x-duetime-ttft-ms``
  with ``--target-ms``).

The arrival trace (times, lengths, think times) is the same for every policy; the words are
new for each, so no policy finds another's prompts cached. Prints, per policy: TTFT p50 / p90,
the on-time rate (first token within the request's target), throughput, the prefix-cache hit
rate (vLLM's own ``usage.prompt_tokens_details.cached_tokens`` over prompt tokens), the mean
quality of the models answering (the pool's table) and where requests went.

    python benchmarks/prefix_routing.py [--policies sfs,prefix-load,load-aware]
        [--rate R] [--duration S] [--turns N] [--system-words N] [--seed N]

No public benchmark client drives this load here: inference-perf's ``shared_prefix`` and
``vllm bench serve --dataset-name prefix_repetition`` send independent requests (no
conversation grows turn by turn), which leaves out what a multi-turn session makes a router
decide. (The note of the issue says which was tried.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("tea", "leaf", "green", "black", "water", "cup", "pot", "steam", "china", "india",
         "trade", "ship", "port", "silver", "spice", "route", "garden", "hill", "rain", "sun",
         "north", "south", "river", "market", "price", "boat", "sail", "wind", "cloud", "stone")


@dataclass
class Conversation:
    start: float
    group: int
    user_words: list[int]
    think: list[float]


@dataclass
class Result:
    policy: str
    ttft: list[float] = field(default_factory=list)
    on_time: list[bool] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0
    quality: list[float] = field(default_factory=list)
    where: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    wall: float = 0.0


def trace(rate: float, duration: float, turns: int, think: float,
          seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        out.append(Conversation(t, len(out) // 2, [rng.randint(15, 60) for _ in range(turns)],
                                [rng.expovariate(1 / think) for _ in range(turns)]))


async def play(session: aiohttp.ClientSession, url: str, conv: Conversation, systems: list[str],
               rng: random.Random, res: Result, quality: dict[str, float],
               target_ms: float | None, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start - time.monotonic()))
    history: list[dict[str, str]] = [{"role": "system", "content": systems[conv.group]}]
    for n, think in zip(conv.user_words, conv.think, strict=True):
        history.append({"role": "user", "content": " ".join(rng.choice(WORDS)
                                                           for _ in range(n))})
        body = {"model": "auto", "messages": history, "max_tokens": 16, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        headers = {} if target_ms is None else {"x-duetime-ttft-ms": f"{target_ms:g}"}
        sent = time.monotonic()
        first = None
        text, usage = [], None
        try:
            async with session.post(url + "/v1/chat/completions", json=body,
                                    headers=headers) as r:
                if r.status != 200:
                    res.errors += 1
                    return
                target = float(r.headers["x-duetime-ttft-target-ms"]) / 1000
                model = r.headers["x-duetime-model"]
                inst = r.headers["x-duetime-instance"]
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    for ch in d.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            if first is None:
                                first = time.monotonic()
                            text.append(piece)
                    if d.get("usage"):
                        usage = d["usage"]
        except aiohttp.ClientError:
            res.errors += 1
            return
        if first is None or usage is None:
            res.errors += 1
            return
        ttft = first - sent
        res.ttft.append(ttft)
        res.on_time.append(ttft <= target)
        res.prompt += usage["prompt_tokens"]
        res.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        res.quality.append(quality[model])
        res.where[inst] = res.where.get(inst, 0) + 1
        history.append({"role": "assistant", "content": "".join(text)})
        await asyncio.sleep(think)


async def run_policy(cfg: dict[str, Any], policy: str, convs: list[Conversation],
                     system_words: int, seed: int, target_ms: float | None) -> Result:
    from duetime.gateway import pool_from_dict
    from duetime.service import Service

    quality = cfg["quality"]["tasks"]["default"]
    svc = await Service(pool_from_dict({**cfg, "policy": policy}, policy)).start()
    rng = random.Random(seed)
    groups = max(c.group for c in convs) + 1
    systems = [f"{rng.getrandbits(48)} " + " ".join(rng.choice(WORDS)
                                                    for _ in range(system_words))
               for _ in range(groups)]
    res = Result(policy)
    try:
        await asyncio.sleep(1.0)  # (the KV-event subscriptions connect)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            t0 = time.monotonic()
            await asyncio.gather(*(play(s, svc.url, c, systems, random.Random(seed + i), res,
                                        quality, target_ms, t0)
                                   for i, c in enumerate(convs)))
            res.wall = time.monotonic() - t0
    finally:
        await svc.stop()
    return res


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 \
        else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="sfs,prefix-load,load-aware")
    ap.add_argument("--rate", type=float, default=0.5, help="conversations per second")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think", type=float, default=1.0, help="mean think time, s")
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--target-ms", type=float, default=None,
                    help="every request's TTFT target (default: the pool's rule)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import tempfile

    from tests.e2e import conftest as fx
    from tests.e2e.gateway_pool import pool_config

    python = fx.find_vllm_python()
    if python is None or not python.exists():
        raise SystemExit(f"prefix_routing: no vLLM venv ({fx.SETUP_HINT})")
    cache = REPO / ".cache" / "vllm-models"
    dirs = fx._build_models(python, cache)
    cores = fx._cores()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [fx._Proc(name, size, dirs[name], fx._free_port(), cores[i % len(cores)],
                          Path(tmp) / f"{name}.log")
                 for i, (name, size) in enumerate(fx.MODELS.items())]
        try:
            for p in procs:
                p.start(python)
            fx._wait_healthy(procs, fx.START_TIMEOUT_S)
            servers = [fx._calibrate(fx._describe(p)) for p in procs]
            cfg = pool_config(servers)
            convs = trace(args.rate, args.duration, args.turns, args.think, args.seed)
            results = []
            for k, policy in enumerate(args.policies.split(",")):
                print(f"prefix_routing: {policy}: {len(convs)} conversations x {args.turns} "
                      "turns ...", file=sys.stderr)
                results.append(asyncio.run(run_policy(cfg, policy, convs, args.system_words,
                                                      args.seed * 1000 + k, args.target_ms)))
        finally:
            for p in procs:
                p.stop()
    print(f"\nshared-prefix load over two vLLM servers (tiny-small, tiny-large; CPU): "
          f"{len(convs)} conversations at {args.rate:g}/s x {args.turns} turns, system prompts "
          f"of {args.system_words} words shared by pairs, 16 output tokens")
    header = ["policy", "requests", "errors", "ttft p50 ms", "ttft p90 ms", "on time",
              "req/s", "cache hit", "quality", "small/large"]
    rows = []
    for r in results:
        rows.append([r.policy, str(len(r.ttft)), str(r.errors),
                     f"{pct(r.ttft, 50) * 1000:.0f}", f"{pct(r.ttft, 90) * 1000:.0f}",
                     f"{sum(r.on_time) / max(1, len(r.on_time)):.1%}",
                     f"{len(r.ttft) / r.wall:.2f}",
                     f"{r.cached / max(1, r.prompt):.1%}",
                     f"{statistics.fmean(r.quality) if r.quality else float('nan'):.3f}",
                     f"{r.where.get('small', 0)}/{r.where.get('large', 0)}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
