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

``--client vllm-bench`` drives the gateways with a public client instead: ``vllm bench serve
--dataset-name prefix_repetition`` (vLLM's own benchmark, run from the vLLM venv through a
small wrapper: its script asks ``importlib.metadata.version("vllm")``, which the ``vllm-cpu``
distribution does not answer): ``--prefixes`` random prefixes of ``--prefix-len`` tokens, each
followed by a random suffix of ``--suffix-len``, ``--num-prompts`` completions at ``--rate``
per second (Poisson), 16 output tokens with ``ignore_eos``; a new ``--seed`` per policy, so no
policy finds another's prefixes cached. It sends independent requests (no conversation grows
turn by turn): the groups-sharing-a-prompt half of the load. Its TTFT percentiles and
throughput are vLLM's own; the on-time rate is the gateway's ``duetime_ttft_target_total``,
the hit rate the servers' ``vllm:prefix_cache_hits_total`` / ``queries_total`` over the run.
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
    why: dict[str, int] = field(default_factory=dict)  # error -> count
    wall: float = 0.0

    def fail(self, why: str) -> None:
        self.errors += 1
        self.why[why] = self.why.get(why, 0) + 1


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
                    res.fail(f"{r.status}: {(await r.text())[:120]}")
                    return
                target = float(r.headers["x-duetime-ttft-target-ms"]) / 1000
                model = r.headers["x-duetime-model"]
                inst = r.headers["x-duetime-instance"]
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    for ch in d.get("choices") or []:
                        if first is None:  # (a token whose text is empty is a token too)
                            first = time.monotonic()
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            text.append(piece)
                    if d.get("usage"):
                        usage = d["usage"]
        except (aiohttp.ClientError, TimeoutError) as e:
            res.fail(f"{type(e).__name__}: {e}"[:120])
            return
        if first is None or usage is None:
            res.fail("a stream without " + ("tokens" if first is None else "usage"))
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


# vllm bench serve from the vLLM venv: the vllm-cpu distribution is not named "vllm"
_BENCH = ("import importlib.metadata as m, sys\n"
          "_v = m.version\n"
          "m.version = lambda n: _v('vllm-cpu') if n == 'vllm' else _v(n)\n"
          "sys.argv = ['vllm', *sys.argv[1:]]\n"
          "from vllm.entrypoints.cli.main import main\n"
          "main()\n")


def _metric_lines(url: str) -> list[str]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode().splitlines()


def _counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    out = dict.fromkeys(names, 0.0)
    for line in _metric_lines(url):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_vllm_bench(cfg: dict[str, Any], policy: str, servers: list[Any], python: Path,
                   args: argparse.Namespace, seed: int, tmp: Path) -> dict[str, Any]:
    """One policy's gateway (on a thread) driven by ``vllm bench serve`` (a subprocess)."""
    import os
    import subprocess
    import threading

    from duetime.gateway import pool_from_dict
    from duetime.service import Service

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    svc = asyncio.run_coroutine_threadsafe(
        Service(pool_from_dict({**cfg, "policy": policy}, policy)).start(), loop).result(60)
    vllm_names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    try:
        time.sleep(1.0)  # (the KV-event subscriptions connect)
        before = [_counters(s.base_url, vllm_names) for s in servers]
        model = str(servers[0].model_dir)
        out = tmp / f"{policy}.json"
        cmd = [str(python), "-c", _BENCH, "bench", "serve", "--backend", "openai",
               "--base-url", svc.url, "--endpoint", "/v1/completions", "--model", model,
               "--tokenizer", model, "--served-model-name", "auto",
               "--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.suffix_len),
               "--prefix-repetition-num-prefixes", str(args.prefixes),
               "--prefix-repetition-output-len", "16", "--ignore-eos",
               "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate),
               "--seed", str(seed), "--percentile-metrics", "ttft,e2el",
               "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(tmp),
               "--result-filename", out.name, "--disable-tqdm"]
        if args.target_ms is not None:
            cmd += ["--header", f"x-duetime-ttft-ms={args.target_ms:g}"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"prefix_routing: vllm bench serve failed:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
        after = [_counters(s.base_url, vllm_names) for s in servers]
        lines = _metric_lines(svc.url)
        on_time = total = 0.0
        decisions: dict[str, float] = {}
        for x in lines:
            value = x.rsplit(" ", 1)[-1]
            if x.startswith("duetime_ttft_target_total{"):
                total += float(value)
                on_time += float(value) if 'outcome="on_time"' in x else 0.0
            elif x.startswith("duetime_decisions_total{"):
                inst = x.split('instance="', 1)[1].split('"', 1)[0]
                decisions[inst] = decisions.get(inst, 0.0) + float(value)
    finally:
        asyncio.run_coroutine_threadsafe(svc.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    hits = sum(a[vllm_names[0]] - b[vllm_names[0]] for a, b in zip(after, before, strict=True))
    queries = sum(a[vllm_names[1]] - b[vllm_names[1]]
                  for a, b in zip(after, before, strict=True))
    return {"policy": policy, "completed": result.get("completed"),
            "failed": result.get("failed", 0), "ttft_p50": result.get("p50_ttft_ms"),
            "ttft_p90": result.get("p90_ttft_ms"), "req_s": result.get("request_throughput"),
            "on_time": on_time / max(1.0, total),
            "hit": hits / max(1.0, queries), "where": decisions}


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
    ap.add_argument("--client", choices=("own", "vllm-bench"), default="own",
                    help="own: the multi-turn driver here; vllm-bench: vllm bench serve's "
                    "prefix_repetition dataset")
    ap.add_argument("--prefixes", type=int, default=8, help="vllm-bench: shared prefixes")
    ap.add_argument("--prefix-len", type=int, default=400, help="vllm-bench: prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=40, help="vllm-bench: suffix tokens")
    ap.add_argument("--num-prompts", type=int, default=120, help="vllm-bench: requests")
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
            if args.client == "vllm-bench":
                rows = [run_vllm_bench(cfg, policy, servers, python, args,
                                       args.seed * 1000 + k, Path(tmp))
                        for k, policy in enumerate(args.policies.split(","))]
                print_bench(rows, args)
                return
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
    for r in results:
        for why, n in r.why.items():
            print(f"{r.policy}: {n} x {why}")


def print_bench(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nvllm bench serve --dataset-name prefix_repetition through duetime over two vLLM "
          f"servers (tiny-small, tiny-large; CPU): {args.num_prompts} completions at "
          f"{args.rate:g}/s, {args.prefixes} prefixes of {args.prefix_len} tokens + "
          f"{args.suffix_len}-token suffixes, 16 output tokens")
    header = ["policy", "completed", "failed", "ttft p50 ms", "ttft p90 ms", "on time",
              "req/s", "cache hit", "small/large"]
    table = [[r["policy"], str(r["completed"]), str(r["failed"]), f"{r['ttft_p50']:.0f}",
              f"{r['ttft_p90']:.0f}", f"{r['on_time']:.1%}", f"{r['req_s']:.2f}",
              f"{r['hit']:.1%}",
              f"{r['where'].get('small', 0):.0f}/{r['where'].get('large', 0):.0f}"]
             for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
