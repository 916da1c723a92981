"""What a LoRA adapter costs on a real vLLM (CPU build): a per-load cost or a batch-time term,
for calibrating duetime's batch-time model.

    python benchmarks/lora_cost_vllm.py [--model tiny-large|tiny-small] [--rounds 8]
        [--ks 1,2,4] [--decode-tokens 48] [--reps 3] [--json FILE]

Starts the e2e suite's tiny vLLM servers one after another (``tests/e2e/conftest.py``'s flags,
engine on core 0, this client and the API process off it) with tiny random LoRA adapters
(``scripts/vllm_cpu/make_tiny_lora.py``, rank 8, all seven projections):

- ``plain``: no ``--enable-lora`` (the reference: what a server without LoRA does);
- ``slots1``: ``--enable-lora --max-loras 1 --max-cpu-loras 4`` and ``2 * (rounds + 1) + 4``
  adapters from ``--lora-modules`` (vLLM loads each at start, so all but the last four have
  left its CPU cache again when the rounds begin);
- ``slots4``: ``--enable-lora --max-loras 4`` and four adapters.

(a) TTFT of one request alone (fresh prompt: no prefix-cache hit, ``max_tokens`` 2), on
``slots1``, per round with two adapters ``x``, ``y`` never used since the start: base, ``x``
cold (first use: read from disk into the CPU cache and a slot), ``x`` warm (in its slot),
``y`` cold (takes the one slot), ``x`` evicted (back from the CPU cache into the slot, no disk),
``x`` warm again; a short and a long prompt for base and warm; then ``POST
/v1/load_lora_adapter`` of a fresh adapter and a request on it. TTFT from vLLM's own histogram
(``vllm:time_to_first_token_seconds``, its sum's step over one request: from the request's
arrival in the API process to its first token) and at the client.

(b) Decode step time of ``k`` concurrent streams (``--decode-tokens`` each, ignore_eos) all on
the base model, all on one adapter, on ``k`` distinct adapters, or one on an adapter and the
rest on the base model, on ``slots4`` (and base on ``plain``): the inter-token latency from
vLLM's histogram (its mean over a batch) and at the client (a stream's mean gap). Prints the
tables (medians and counts) and what the data supports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANK = 8
MAX_CPU_LORAS = 4
TIMEOUT = 120.0
WORDS = ["the", "answer", "of", "one", "request", "is", "a", "value", "in", "list", "two",
         "three", "four", "five", "route", "time", "token", "model", "name", "user", "system",
         "please", "explain", "what", "where", "why", "how", "fast", "slow", "key", "lookup",
         "number", "item", "hello", "world"]
_HIST = re.compile(r"^vllm:(time_to_first_token_seconds|inter_token_latency_seconds)_"
                   r"(sum|count)\{[^}]*\} (\S+)$", re.M)


@dataclass
class Samples:
    """Named lists of samples (ms), in the order they were taken."""

    by: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, key: str, value: float) -> None:
        self.by[key].append(value)

    def median(self, key: str) -> float:
        return statistics.median(self.by[key]) if self.by.get(key) else float("nan")


def histograms(client: httpx.Client) -> dict[str, float]:
    """vLLM's TTFT and ITL histograms' sums (s) and counts, over all their series."""
    out: dict[str, float] = defaultdict(float)
    for name, part, value in _HIST.findall(client.get("/metrics").text):
        out[f"{name}_{part}"] += float(value)
    return out


class Prompts:
    """Fresh prompts: each starts with its own number, so no block of it is in the prefix
    cache (vLLM keys a LoRA request's blocks by its adapter as well)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.n = 0

    def __call__(self, words: int) -> str:
        self.n += 1
        return f"{self.n} {self.n * 7919} " + " ".join(self.rng.choice(WORDS)
                                                      for _ in range(words))


def ttft(client: httpx.Client, model: str, prompt: str) -> tuple[float, float, int]:
    """One streamed request alone: (server TTFT ms, client TTFT ms, prompt tokens)."""
    before = histograms(client)
    t0 = time.perf_counter()
    first = None
    prompt_tokens = 0
    with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise SystemExit(f"lora_cost_vllm: {model}: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):  # (its text may be empty: a partial
                first = time.perf_counter()              # UTF-8 character)
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    assert first is not None, f"{model}: no token streamed"
    for _ in range(100):  # (the API process records the histogram beside streaming the answer)
        after = histograms(client)
        key = "time_to_first_token_seconds_count"
        if (n := after[key] - before[key]) >= 1:
            break
        time.sleep(0.01)
    assert n == 1, f"{model}: {n} TTFT samples for one request (another client?)"
    server_ms = 1000 * (after["time_to_first_token_seconds_sum"]
                        - before["time_to_first_token_seconds_sum"])
    return server_ms, 1000 * (first - t0), prompt_tokens


def run_ttft(client: httpx.Client, base: str, rounds: int, short: int, long: int,
             adapters: list[str], fresh_paths: list[Path]
             ) -> tuple[Samples, Samples, dict[str, int]]:
    """Part (a) on ``slots1``: returns (server, client) TTFT samples by condition, and the
    prompt lengths in tokens."""
    server, clnt = Samples(), Samples()
    lengths: dict[str, int] = {}
    prompts = Prompts(1)

    def one(key: str, model: str, words: int, record: bool) -> None:
        s, c, n = ttft(client, base if model == "base" else model, prompts(words))
        if record:
            server.add(key, s)
            clnt.add(key, c)
            lengths[key] = n

    for rnd in range(rounds + 1):  # round 0 warms the paths up and is not recorded
        x, y = adapters[2 * rnd], adapters[2 * rnd + 1]
        rec = rnd > 0
        one("base", "base", short, rec)
        one("base, long prompt", "base", long, rec)
        one("cold (disk + slot)", x, short, rec)
        one("warm (resident)", x, short, rec)
        one("warm, long prompt", x, long, rec)
        one("cold (disk + slot)", y, short, rec)
        one("evicted (CPU cache -> slot)", x, short, rec)
        one("warm (resident)", x, short, rec)
    # runtime registration: vLLM loads the adapter (disk, CPU cache, a slot) in the call
    for i, path in enumerate(fresh_paths):
        name = f"runtime-{i}"
        t0 = time.perf_counter()
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                        "lora_path": str(path)})
        if r.status_code != 200:
            raise SystemExit(f"lora_cost_vllm: load_lora_adapter: {r.status_code} {r.text}")
        if i > 0:
            clnt.add("load_lora_adapter call", 1000 * (time.perf_counter() - t0))
        one("first request after load_lora_adapter", name, short, i > 0)
    return server, clnt, lengths


async def _stream_step(client: httpx.AsyncClient, model: str, prompt: str, tokens: int
                       ) -> float:
    """One stream's mean gap (ms) from its second chunk to its last: chunks that the API
    process sends together arrive together, so single gaps say little, their mean does."""
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        if r.status_code != 200:
            raise SystemExit(f"lora_cost_vllm: {model}: {r.status_code} {await r.aread()!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    # (the first gap left out: the step after a stream's prefill may hold another's prefill)
    return 1000 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def run_decode(base_url: str, ks: list[int], tokens: int, reps: int,
               conditions: dict[str, Any]) -> tuple[Samples, Samples]:
    """Part (b): for each condition (name -> function of k giving the k streams' models, or
    None to skip that k) and k, ``reps`` batches of k concurrent streams. Returns (server mean
    ITL per batch, client mean gap per stream) by "condition, k"."""
    server, clnt = Samples(), Samples()
    prompts = Prompts(2)

    async def batch(models: list[str]) -> list[float]:
        async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(_stream_step(c, m, prompts(24), tokens)
                                          for m in models))

    combos = [(f"{name}, k={k}", models) for name, models_for in conditions.items()
              for k in ks if (models := models_for(k)) is not None]
    with httpx.Client(base_url=base_url, timeout=TIMEOUT) as client:
        for _, models in combos:
            asyncio.run(batch(models))  # (warm-up: every adapter in its slot)
        for _ in range(reps):  # interleaved: a drift of the machine spreads over all of them
            for key, models in combos:
                before = histograms(client)
                steps = asyncio.run(batch(models))
                after = histograms(client)
                n = (after["inter_token_latency_seconds_count"]
                     - before["inter_token_latency_seconds_count"])
                s = (after["inter_token_latency_seconds_sum"]
                     - before["inter_token_latency_seconds_sum"])
                server.add(key, 1000 * s / n)
                for v in steps:
                    clnt.add(key, v)
    return server, clnt


def make_adapters(python: Path, model_dir: Path, count: int) -> list[Path]:
    out = model_dir.with_name(model_dir.name + "-lora")
    proc = subprocess.run([str(python), str(REPO / "scripts/vllm_cpu/make_tiny_lora.py"),
                           str(model_dir), str(out), "--count", str(count), "--rank", str(RANK)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lora_cost_vllm: make_tiny_lora failed:\n{proc.stderr[-3000:]}")
    return [Path(line.split("=", 1)[1]) for line in proc.stdout.splitlines() if "=" in line]


def lora_flags(max_loras: int, adapters: dict[str, Path], cpu_loras: int | None = None
               ) -> tuple[str, ...]:
    extra = ("--max-cpu-loras", str(cpu_loras)) if cpu_loras else ()
    return ("--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(RANK),
            *extra, "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))


def table(title: str, rows: list[tuple[str, Samples, Samples, str]], unit: str) -> str:
    out = [f"\n{title}\n", f"| condition | server median {unit} | n | client median {unit} | n |"
           " note |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for key, server, clnt, note in rows:
        s = f"{server.median(key):.2f}" if server.by.get(key) else "-"
        out.append(f"| {key} | {s} | {len(server.by.get(key, []))} | "
                   f"{clnt.median(key):.2f} | {len(clnt.by.get(key, []))} | {note} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-large", choices=("tiny-large", "tiny-small"))
    ap.add_argument("--rounds", type=int, default=8, help="TTFT rounds, each with 2 fresh "
                    "adapters (default %(default)s)")
    ap.add_argument("--short", type=int, default=24, help="words of a short prompt")
    ap.add_argument("--long", type=int, default=300, help="words of a long prompt")
    ap.add_argument("--ks", default="1,2,4", help="decode batch sizes (at most 4)")
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5, help="batches per decode condition")
    ap.add_argument("--json", type=Path, default=None, help="write the samples here")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if max(ks) > 4 or min(ks) < 1:
        raise SystemExit("lora_cost_vllm: --ks: each k in 1..4 (--max-loras 4)")

    from tests.e2e import conftest as fx

    python = fx.find_vllm_python()
    if python is None or not python.exists():
        raise SystemExit(f"lora_cost_vllm: no vLLM venv ({fx.SETUP_HINT})")
    model_dir = fx._build_models(python, REPO / ".cache" / "vllm-models")[args.model]
    n_round = 2 * (args.rounds + 1)
    paths = make_adapters(python, model_dir, n_round + MAX_CPU_LORAS + args.rounds + 1)
    registered = {f"l{i + 1}": p for i, p in enumerate(paths[:n_round + MAX_CPU_LORAS])}
    fresh = paths[n_round + MAX_CPU_LORAS:]  # for load_lora_adapter (not registered)
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # (read by the servers at start)
    t_start = time.monotonic()
    base = args.model

    def started(flags: tuple[str, ...], what: str) -> Any:
        print(f"lora_cost_vllm: starting {what} ({args.model})", file=sys.stderr)
        return fx.one_server(args.model, "lora_cost_vllm", flags)

    # (a) TTFT: one slot, a CPU cache of four
    with started(lora_flags(1, registered, MAX_CPU_LORAS), "slots1") as server, \
            fx.off_core(server.engine_core, [server.pid]), \
            httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
        names = list(registered)
        a_server, a_client, lengths = run_ttft(
            client, base, args.rounds, args.short, args.long, names, fresh)

    # (b) decode: four slots; base on a plain server too
    adapters4 = {n: registered[n] for n in list(registered)[-4:]}
    a4 = list(adapters4)
    conditions = {
        "base": lambda k: [base] * k,
        "one adapter": lambda k: [a4[0]] * k,
        "k distinct adapters": lambda k: a4[:k] if k > 1 else None,  # (k=1: one adapter)
        "1 adapter + k-1 base": lambda k: [a4[0]] + [base] * (k - 1) if k > 1 else None,
    }
    with started(lora_flags(4, adapters4), "slots4") as server, \
            fx.off_core(server.engine_core, [server.pid]):
        b_server, b_client = run_decode(server.base_url, ks, args.decode_tokens, args.reps,
                                        conditions)
    with started((), "plain") as server, fx.off_core(server.engine_core, [server.pid]):
        p_server, p_client = run_decode(server.base_url, ks, args.decode_tokens, args.reps,
                                        {"base, no --enable-lora": conditions["base"]})
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
            prompts = Prompts(3)
            for rnd in range(args.rounds + 1):
                for key, words in (("base, no --enable-lora", args.short),
                                   ("base, no --enable-lora, long prompt", args.long)):
                    s, c, n = ttft(client, base, prompts(words))
                    if rnd:
                        a_server.add(key, s)
                        a_client.add(key, c)
                        lengths[key] = n
    for key in list(p_server.by):
        b_server.by[key] = p_server.by[key]
        b_client.by[key] = p_client.by[key]

    report(args, a_server, a_client, lengths, b_server, b_client, ks)
    print(f"\n(lora_cost_vllm: {time.monotonic() - t_start:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "prompt_tokens": lengths,
            "ttft_server_ms": a_server.by, "ttft_client_ms": a_client.by,
            "itl_server_ms": b_server.by, "itl_client_ms": b_client.by}, indent=1))


def report(args: argparse.Namespace, a_server: Samples, a_client: Samples,
           lengths: dict[str, int], b_server: Samples, b_client: Samples, ks: list[int]) -> None:
    """The tables, and the terms the medians support."""
    m = a_server.median
    rows = [(k, a_server, a_client, f"{lengths.get(k, '')} prompt tokens")
            for k in ("base, no --enable-lora", "base", "warm (resident)",
                      "evicted (CPU cache -> slot)", "cold (disk + slot)",
                      "first request after load_lora_adapter",
                      "base, no --enable-lora, long prompt", "base, long prompt",
                      "warm, long prompt")]
    rows.append(("load_lora_adapter call", a_server, a_client, "the POST itself (client)"))
    print(f"# LoRA cost on vLLM 0.32 CPU, {args.model}, rank {RANK}, seven projections")
    print(table("(a) TTFT of a request alone, ms (server: vLLM's histogram; slots1 = "
                "--max-loras 1 --max-cpu-loras 4)", rows, "ms"))
    brows = []
    for name in ("base, no --enable-lora", "base", "one adapter", "k distinct adapters",
                 "1 adapter + k-1 base"):
        for k in ks:
            if f"{name}, k={k}" not in b_server.by:
                continue
            brows.append((f"{name}, k={k}", b_server, b_client,
                          "server: mean ITL of a batch; client: mean gap of a stream"))
    print(table(f"(b) decode step (inter-token latency) of k concurrent streams, ms "
                f"({args.decode_tokens} tokens each, --max-loras 4)", brows, "ms"))
    if any(b_client.median(k) < b_server.median(k) / 2 for k, *_ in brows):
        print("\n(some client gaps collapsed: the API process sent those streams in bursts, as "
              "it does when the engine's steps are short; read the server's column)")

    short = lengths.get("base", 0)
    long = lengths.get("base, long prompt", 0)
    cold = m("cold (disk + slot)") - m("warm (resident)")
    evicted = m("evicted (CPU cache -> slot)") - m("warm (resident)")
    warm_short = m("warm (resident)") - m("base")
    warm_long = m("warm, long prompt") - m("base, long prompt")
    per_token = (warm_long - warm_short) / (long - short) if long > short else float("nan")
    enable = m("base") - m("base, no --enable-lora")
    enable_long = m("base, long prompt") - m("base, no --enable-lora, long prompt")
    print("\nWhat the medians say (server TTFT):")
    print(f"- a cold adapter (disk -> CPU cache -> slot) adds {cold:.2f} ms once, in the step "
          f"that first schedules it; an evicted one (CPU cache -> slot) {evicted:.2f} ms; "
          f"load_lora_adapter takes {a_client.median('load_lora_adapter call'):.2f} ms in the "
          "call and its first request is then warm")
    print(f"- a resident adapter adds {warm_short:.2f} ms to a {short}-token prefill and "
          f"{warm_long:.2f} ms to a {long}-token one: {1000 * per_token:.1f} us per prompt token")
    print(f"- --enable-lora alone (base requests) adds {enable:.2f} ms to a {short}-token "
          f"prefill, {enable_long:.2f} ms to a {long}-token one")
    d = b_server.median
    for k in ks:
        if k == 1:
            plain, b, one = (d(f"{c}, k=1") for c in ("base, no --enable-lora", "base",
                                                      "one adapter"))
            print(f"- decode k=1: plain {plain:.2f} ms, base with LoRA enabled {b:.2f} ms "
                  f"({b / plain - 1:+.0%}), one adapter {one:.2f} ms ({one / b - 1:+.0%} over "
                  "base)")
            continue
        plain, b = d(f"base, no --enable-lora, k={k}"), d(f"base, k={k}")
        one, dist = d(f"one adapter, k={k}"), d(f"k distinct adapters, k={k}")
        mixed = d(f"1 adapter + k-1 base, k={k}")
        print(f"- decode k={k}: plain {plain:.2f} ms, base with LoRA enabled {b:.2f} ms "
              f"({b / plain - 1:+.0%}), one adapter {one:.2f} ms ({one / b - 1:+.0%} over base), "
              f"{k} distinct {dist:.2f} ms ({dist / one - 1:+.0%} over one adapter), 1 adapter "
              f"+ {k - 1} base {mixed:.2f} ms ({mixed / b - 1:+.0%} over base)")


if __name__ == "__main__":
    main()
