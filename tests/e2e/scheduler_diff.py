"""Differential runs: vLLM's own scheduler against duetime's engine, on the same requests.

``cases(seed, n)`` makes seeded random cases (budgets, sequence caps, thresholds, tight and ample
KV, arrivals over time); ``targeted()`` adds one case per rule. ``run_vllm`` feeds them to
``vllm_scheduler.py`` in the vLLM venv; ``run_engine`` replays them with duetime's reference
loop under the same step protocol (asynchronously, a step's first tokens and finishes are
filed under the step that made them, as the runner files vLLM's); ``compare`` says, per case,
whether every step agrees (scheduled tokens per request in order, preemption victims in order,
first tokens, finishes, and how the run ended) and where they first differ. A livelock (the
head preempting itself twice with no output in between) ends a run as "stuck" on both sides.

As a script it prints the agreement counts (the vLLM venv's python is found as in the e2e
suite: ``DUETIME_VLLM_PYTHON`` or ``.venv-vllm/bin/python``)::

    python tests/e2e/scheduler_diff.py [--cases 360] [--seed 0] [--show 3] [--modes sync,async]
                                       [--caching | --lora]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from duetime.engine import EngineStuck, Paper4, ReferenceEngine, Request, SchedulerConfig

try:  # the e2e suite's lookup of the vLLM venv
    from .conftest import find_vllm_python
except ImportError:  # run as a script
    from conftest import find_vllm_python

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_scheduler.py"
MODEL = Paper4(b0=1e-3, b1=1e-5, b2=0.0, b3=0.0)  # durations play no part in the comparison

Case = dict[str, Any]


# -- cases ------------------------------------------------------------------------------------------

def random_case(rng: random.Random, name: str, *, asynchronous: bool = False) -> Case:
    budget = rng.choice([16, 32, 64, 128, 512, 2048])
    seqs = min(budget, rng.choice([1, 2, 3, 4, 8, 32]))
    mml = rng.choice([256, 1024, 4096])
    blocks = rng.choice([3, 6, 12, 24, 48, 200, 2000])
    threshold = rng.choice([0, 0, 0, 8, 32, 100])
    n = rng.randint(1, 12)
    spread = rng.choice([0, 0, 5, 30])
    requests = []
    for i in range(n):
        hi = min(mml - 1, rng.choice([40, 300, 1500]))
        prompt = rng.randint(1, hi)
        requests.append({"id": f"r{i}", "prompt_tokens": prompt,
                         "output_tokens": rng.randint(1, rng.choice([3, 20, 60])),
                         "arrival_step": rng.randint(0, spread)})
    requests.sort(key=lambda r: r["arrival_step"])
    return {"name": name, "config": {
        "max_num_batched_tokens": budget, "max_num_seqs": seqs, "max_model_len": mml,
        "block_size": 16, "num_gpu_blocks": blocks, "long_prefill_token_threshold": threshold,
        "watermark": rng.choice([0.0, 0.0, 0.0, 0.05, 0.2]),
        "scheduler_reserve_full_isl": rng.choice([True, True, True, False]),
        "async_scheduling": asynchronous}, "requests": requests, "max_steps": 3000}


def cases(seed: int = 0, n: int = 360, *, asynchronous: bool = False) -> list[Case]:
    rng = random.Random(seed)
    mode = "async" if asynchronous else "sync"
    return [random_case(rng, f"{mode}-{seed}-{i}", asynchronous=asynchronous) for i in range(n)]


def prefix_case(rng: random.Random, name: str, *, asynchronous: bool = False) -> Case:
    """Traffic that shares prefixes, for vLLM with prefix caching on: tenants with their own
    system prompt, multi-turn sessions (each turn's prompt is the conversation so far: the
    previous prompt, its output tokens — the runner's sampled token 11 — and a new question),
    repeated identical prompts, and KV from ample to so tight that cached blocks are evicted
    and requests preempted."""
    bs = rng.choice([16, 16, 8])
    budget = rng.choice([32, 64, 256, 2048])
    cfg = {"max_num_batched_tokens": budget, "max_num_seqs": min(budget, rng.choice([2, 4, 8, 32])),
           "max_model_len": rng.choice([1024, 4096]), "block_size": bs,
           "num_gpu_blocks": rng.choice([12, 24, 40, 120, 2000]) * 16 // bs,
           "long_prefill_token_threshold": rng.choice([0, 0, 24, 64]),
           "scheduler_reserve_full_isl": rng.choice([True, True, True, False]),
           "watermark": rng.choice([0.0, 0.0, 0.05]),
           "async_scheduling": asynchronous, "enable_prefix_caching": True}
    systems = [[rng.randint(1000, 30000) for _ in range(rng.choice([20, 32, 100, 300]))]
               for _ in range(rng.randint(1, 3))]
    requests: list[dict[str, Any]] = []
    cap = cfg["max_model_len"] - 40
    for s in range(rng.randint(1, 5)):
        ids = list(rng.choice(systems))
        step = rng.randint(0, 10)
        for t in range(rng.randint(1, 4)):
            if rng.random() < 0.15 and t:  # the same prompt again
                ids = requests[-1]["prompt_ids"]
            else:
                ids = ids + [rng.randint(1000, 30000) for _ in range(rng.randint(1, 120))]
            if len(ids) >= cap:
                break
            out = rng.randint(1, 40)
            requests.append({"id": f"s{s}t{t}", "prompt_tokens": len(ids), "prompt_ids": ids,
                             "output_tokens": out, "arrival_step": step})
            ids = ids + [11] * out
            step += rng.choice([0, 1, 3, 10, 60])
    requests.sort(key=lambda r: r["arrival_step"])
    return {"name": name, "config": cfg, "requests": requests, "max_steps": 3000}


def prefix_cases(seed: int = 0, n: int = 100, *, asynchronous: bool = False) -> list[Case]:
    rng = random.Random(seed)
    mode = "async" if asynchronous else "sync"
    return [prefix_case(rng, f"{mode}-prefix-{seed}-{i}", asynchronous=asynchronous)
            for i in range(n)]


def lora_case(rng: random.Random, name: str, *, asynchronous: bool = False,
              caching: bool = False) -> Case:
    """Requests for several LoRA adapters (and the base model) on vLLM with ``--enable-lora``:
    ``max_loras`` from tight (1) to loose, adapters from two to many with skewed popularity,
    bursts that fill the waiting queue with mixed adapters (the skip), KV from ample to tight
    (preemption of one adapter's request lets another's in), seats and budgets from scarce
    to ample; with ``caching``, tenants' shared system prompts asked under different
    adapters (a prefix cached under one adapter misses under another) and repeated
    prompts."""
    bs = 16
    budget = rng.choice([16, 64, 256, 256, 2048])
    n_adapters = rng.choice([2, 3, 4, 8, 16])
    cfg = {"max_num_batched_tokens": budget,
           "max_num_seqs": min(budget, rng.choice([2, 4, 8, 32, 32])),
           "max_model_len": rng.choice([1024, 4096]), "block_size": bs,
           "num_gpu_blocks": rng.choice([12, 24, 40, 200, 2000]),
           "long_prefill_token_threshold": rng.choice([0, 0, 24, 64]),
           "scheduler_reserve_full_isl": rng.choice([True, True, True, False]),
           "watermark": rng.choice([0.0, 0.0, 0.05]), "async_scheduling": asynchronous,
           "enable_prefix_caching": caching, "max_loras": rng.choice([1, 1, 2, 2, 3, 8])}
    weights = [1.0 / (a + 1) for a in range(n_adapters + 1)]  # Zipf; index 0: the base model
    systems = [[rng.randint(1000, 30000) for _ in range(rng.choice([20, 40, 100]))]
               for _ in range(rng.randint(1, 3))]
    requests: list[dict[str, Any]] = []
    spread = rng.choice([0, 0, 3, 10, 40])
    for i in range(rng.randint(2, 16)):
        lora = rng.choices(range(n_adapters + 1), weights)[0]
        if caching and rng.random() < 0.8:
            if requests and rng.random() < 0.15:  # a prompt again, maybe under another adapter
                ids = list(rng.choice(requests)["prompt_ids"])
            else:
                ids = rng.choice(systems) + [rng.randint(1000, 30000)
                                             for _ in range(rng.randint(1, 60))]
        else:
            ids = [rng.randint(1000, 30000) for _ in range(rng.randint(1, 200))]
        requests.append({"id": f"r{i}", "prompt_tokens": len(ids), "prompt_ids": ids,
                         "output_tokens": rng.randint(1, rng.choice([3, 20, 60])),
                         "arrival_step": rng.randint(0, spread), "lora": lora})
    requests.sort(key=lambda r: r["arrival_step"])
    return {"name": name, "config": cfg, "requests": requests, "max_steps": 3000}


def lora_cases(seed: int = 0, n: int = 100, *, asynchronous: bool = False,
               caching: bool = False) -> list[Case]:
    rng = random.Random(seed)
    mode = ("async" if asynchronous else "sync") + ("-cached" if caching else "")
    return [lora_case(rng, f"{mode}-lora-{seed}-{i}", asynchronous=asynchronous,
                      caching=caching) for i in range(n)]


def skips(case: Case, result: dict) -> int:
    """Steps in which a waiting request was passed by a later one for another adapter: a
    request admitted in a step while an earlier arrival for another adapter still waits
    (what the ``max_loras`` skip makes; FCFS alone never does)."""
    arrival = {r["id"]: (r["arrival_step"], i) for i, r in enumerate(case["requests"])}
    lora = {r["id"]: r.get("lora", 0) for r in case["requests"]}
    started: set[str] = set()
    count = 0
    for k, st in enumerate(result["steps"]):
        new = [rid for rid, _ in st["scheduled"] if rid not in started]
        started.update(new)
        waiting = [rid for rid, (a, _) in arrival.items() if a <= k and rid not in started]
        if any(lora[w] != lora[n] and arrival[w] < arrival[n] for n in new for w in waiting):
            count += 1
    return count


def first_steps(result: dict) -> dict[str, int]:
    """Per request, the step that made its first token."""
    return {rid: k for k, st in enumerate(result["steps"]) for rid in st["first"]}


def _case(name: str, cfg: dict[str, Any], reqs: list[tuple[int, int, int]]) -> Case:
    base = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 1024,
            "block_size": 16, "num_gpu_blocks": 100, "long_prefill_token_threshold": 0}
    return {"name": name, "config": {**base, **cfg}, "max_steps": 3000, "requests": [
        {"id": f"r{i}", "prompt_tokens": p, "output_tokens": o, "arrival_step": a}
        for i, (p, o, a) in enumerate(reqs)]}


def targeted(*, asynchronous: bool = False) -> list[Case]:
    """One or more cases per rule (``docs/scheduling-rules.md``)."""
    out = [
        # A: the null block: 4 blocks hold 3 x 16 tokens, not 64
        _case("A-null-block", {"num_gpu_blocks": 4}, [(60, 2, 0)]),
        _case("A-null-block-decode", {"num_gpu_blocks": 4}, [(47, 4, 0), (10, 2, 0)]),
        # B: full-sequence admission: the second prompt's blocks do not fit beside the first
        _case("B-full-sequence", {"num_gpu_blocks": 20, "max_num_batched_tokens": 32},
              [(200, 5, 0), (150, 5, 0)]),
        _case("B-full-sequence-arrival", {"num_gpu_blocks": 16}, [(100, 30, 0), (150, 3, 2)]),
        _case("B-watermark", {"num_gpu_blocks": 40, "watermark": 0.25},
              [(200, 4, 0), (200, 4, 1), (16, 2, 2)]),
        _case("B-first-chunk-only", {"num_gpu_blocks": 20, "max_num_batched_tokens": 32,
                                     "scheduler_reserve_full_isl": False},
              [(200, 5, 0), (150, 5, 0)]),
        # C: a lone request ignores the threshold
        _case("C-lone-request", {"long_prefill_token_threshold": 16}, [(200, 2, 0)]),
        _case("C-lone-then-company", {"long_prefill_token_threshold": 16},
              [(300, 2, 0), (40, 2, 3)]),
        # H: a prompt larger than the whole cache blocks the queue behind it
        _case("H-never-fits", {"num_gpu_blocks": 8}, [(30, 3, 0), (500, 2, 0), (10, 2, 0)]),
        # ... and one that outgrows the cache while it decodes: kept out for good by the
        # full-sequence admission, else preempted and recomputed for ever (a livelock), while
        # a small request beside it still finishes
        _case("H-outgrows", {"num_gpu_blocks": 4, "max_num_batched_tokens": 16},
              [(40, 20, 0), (5, 3, 1)]),
        _case("H-outgrows-livelock", {"num_gpu_blocks": 4, "max_num_batched_tokens": 16,
                                      "scheduler_reserve_full_isl": False},
              [(40, 20, 0), (5, 3, 1)]),
        # preemption under tight KV
        _case("tight-kv-preemption", {"num_gpu_blocks": 12, "max_num_batched_tokens": 128},
              [(60, 40, 0), (60, 40, 0), (60, 40, 0), (20, 40, 1)]),
        # max_model_len ends a request
        _case("max-model-len", {"max_model_len": 256}, [(250, 20, 0), (100, 200, 0)]),
    ]
    for c in out:
        c["config"]["async_scheduling"] = asynchronous
        c["name"] = ("async-" if asynchronous else "sync-") + c["name"]
    return out


# -- the two sides ----------------------------------------------------------------------------------

def run_vllm(python: Path, batch: list[Case], timeout_s: float = 900.0) -> list[dict]:
    """vLLM's results for the cases, in order (one subprocess for all of them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(python), str(RUNNER)], input="".join(
        json.dumps(c) + "\n" for c in batch), capture_output=True, text=True, env=env,
        timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm_scheduler.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def engine_config(cfg: dict[str, Any]) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=cfg["max_num_batched_tokens"],
                           max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
                           block_size=cfg.get("block_size", 16),
                           num_gpu_blocks=cfg["num_gpu_blocks"],
                           long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
                           scheduler_reserve_full_isl=cfg.get("scheduler_reserve_full_isl", True),
                           watermark=cfg.get("watermark", 0.0),
                           async_scheduling=cfg.get("async_scheduling", False),
                           enable_prefix_caching=cfg.get("enable_prefix_caching", False),
                           max_loras=cfg.get("max_loras", 0))


def block_keys(request: dict[str, Any], block_size: int) -> list[int]:
    """Chained keys of the full blocks of a request's whole sequence as the runner makes it
    (its prompt, then ``output_tokens`` sampled tokens 11), with its adapter in every block's
    key as vLLM's extra keys: equal exactly when vLLM's block hashes are."""
    ids = (request.get("prompt_ids") or [7] * request["prompt_tokens"]) + [11] * request[
        "output_tokens"]
    lora = request.get("lora", 0)
    keys, parent = [], 0
    for k in range(len(ids) // block_size):
        parent = hash((parent, tuple(ids[k * block_size:(k + 1) * block_size]), lora))
        keys.append(parent)
    return keys


def run_engine(case: Case) -> dict:
    """duetime's reference loop on the case, step by step as the vLLM runner steps."""
    cfg = engine_config(case["config"])
    eng = ReferenceEngine(cfg, MODEL)
    caching = cfg.enable_prefix_caching
    arrivals: dict[int, list[dict]] = {}
    for r in case["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(r)
    last = max(arrivals, default=0)
    steps: list[dict] = []
    end = "max_steps"
    for k in range(case.get("max_steps", 5000)):
        for r in arrivals.get(k, ()):
            eng.add(Request(r["id"], r["prompt_tokens"], r["output_tokens"],
                            hashes=block_keys(r, cfg.block_size) if caching else (),
                            lora=r.get("lora", 0)))
        eng.watch_livelock = k >= last  # as the vLLM runner watches
        if eng.idle:
            if k > last:
                end = "done"
                break
            steps.append({"scheduled": [], "preempted": [], "first": [], "finished": [],
                          **({"hits": []} if caching else {})})
            continue
        try:
            rec = eng.step()
        except EngineStuck:  # nothing can be scheduled now, or a livelock: stuck for good
            if k >= last:    # unless a request still to come changes that (as in vLLM)
                end = "stuck"
                break
            steps.append({"scheduled": [], "preempted": [], "first": [], "finished": [],
                          **({"hits": []} if caching else {})})
            continue
        assert rec is not None
        steps.append({"scheduled": [[rid, n] for rid, n in rec.scheduled],
                      "preempted": list(rec.preempted), "first": [], "finished": [],
                      **({"hits": [[rid, n] for rid, n in rec.hits]} if caching else {})})
        made = steps[k if rec.outputs_of is None else k - 1]  # async: the previous step's
        made["first"] += rec.first_token_ids
        made["finished"] += rec.finished_ids
    while steps and not any(steps[-1].values()):
        steps.pop()
    return {"name": case.get("name", ""), "steps": steps, "end": end}


def compare(want: dict, got: dict) -> str | None:
    """None if the two runs agree step for step; else where they first differ."""
    for k in range(max(len(want["steps"]), len(got["steps"]))):
        if k >= len(want["steps"]) or k >= len(got["steps"]):
            return f"step {k}: one run ended ({len(want['steps'])} vs {len(got['steps'])} steps)"
        a, b = want["steps"][k], got["steps"][k]
        for key in ("scheduled", "preempted", "hits"):
            if a.get(key) != b.get(key):
                return f"step {k} {key}: vLLM {a[key]} engine {b[key]}"
        for key in ("first", "finished"):
            if sorted(a[key]) != sorted(b[key]):
                return f"step {k} {key}: vLLM {sorted(a[key])} engine {sorted(b[key])}"
    if want["end"] != got["end"]:
        return f"end: vLLM {want['end']} engine {got['end']}"
    return None


def preemptions(result: dict) -> int:
    return sum(len(s["preempted"]) for s in result["steps"])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=360)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=3, help="first differences shown per mode")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--caching", action="store_true",
                    help="shared-prefix cases with prefix caching on (and what a replay without "
                    "caching would miss)")
    ap.add_argument("--lora", action="store_true",
                    help="requests for several LoRA adapters on vLLM with --enable-lora "
                    "(max_loras 1-8), prefix caching off and on")
    args = ap.parse_args()
    python = find_vllm_python()
    if python is None or not python.exists():
        raise SystemExit("no vLLM venv: run scripts/vllm_cpu/setup_env.sh or set "
                         "DUETIME_VLLM_PYTHON")
    if args.caching:
        return _report_caching(python, args)
    if args.lora:
        return _report_lora(python, args)
    for mode in args.modes.split(","):
        asyn = mode == "async"
        batch = cases(args.seed, args.cases, asynchronous=asyn) + targeted(asynchronous=asyn)
        wants = run_vllm(python, batch)
        diffs, pre_v, pre_e = [], 0, 0
        for case, want in zip(batch, wants, strict=True):
            got = run_engine(case)
            pre_v += preemptions(want)
            pre_e += preemptions(got)
            why = compare(want, got)
            if why:
                diffs.append((case["name"], why))
        print(f"{mode}: {len(batch) - len(diffs)} of {len(batch)} cases agree step for step "
              f"({args.cases} random, seed {args.seed}, + {len(batch) - args.cases} targeted); "
              f"preemptions vLLM {pre_v}, engine {pre_e}")
        for name, why in diffs[:args.show]:
            print(f"  {name}: {why}")
        rules = [n for n, _ in diffs if not n.split("-", 1)[1][0].isdigit()]
        if rules:
            print(f"  targeted cases that differ: {', '.join(rules)}")


def _report_lora(python: Path, args) -> None:
    """vLLM with ``--enable-lora`` against the engine, per mode, caching off and on: cases
    that agree step for step, and how many of them skip a request for its adapter."""
    for mode in args.modes.split(","):
        for caching in (False, True):
            batch = lora_cases(args.seed, args.cases, asynchronous=mode == "async",
                               caching=caching)
            wants = run_vllm(python, batch)
            diffs = [(case["name"], why) for case, want in zip(batch, wants, strict=True)
                     if (why := compare(want, run_engine(case)))]
            skipping = sum(1 for case, want in zip(batch, wants, strict=True)
                           if skips(case, want))
            print(f"{mode} with LoRA, prefix caching {'on' if caching else 'off'}: "
                  f"{len(batch) - len(diffs)} of {len(batch)} cases agree step for step "
                  f"(seed {args.seed}; {skipping} skip a request for its adapter; preemptions "
                  f"{sum(preemptions(w) for w in wants)})")
            for name, why in diffs[:args.show]:
                print(f"  {name}: {why}")


def _report_caching(python: Path, args) -> None:
    """vLLM with prefix caching on shared-prefix cases, against the engine with caching (per
    step agreement) and without it (how late a replay that ignores the cache puts first
    tokens, in steps); and the share of prompt tokens that hit."""
    import statistics

    for mode in args.modes.split(","):
        batch = prefix_cases(args.seed, args.cases, asynchronous=mode == "async")
        wants = run_vllm(python, batch)
        prompt = hit = agree = blind = 0
        late: list[int] = []
        diffs = []
        for case, want in zip(batch, wants, strict=True):
            prompt += sum(r["prompt_tokens"] for r in case["requests"])
            hit += sum(n for st in want["steps"] for _, n in st.get("hits", ()))
            why = compare(want, run_engine(case))
            agree += why is None
            if why:
                diffs.append((case["name"], why))
            off = {**case, "config": {**case["config"], "enable_prefix_caching": False}}
            got = run_engine(off)
            blind += compare({**want, "steps": [{k: v for k, v in st.items() if k != "hits"}
                                                for st in want["steps"]]}, got) is None
            fw, fg = first_steps(want), first_steps(got)
            late += [fg[r] - fw[r] for r in fw if r in fg]
        late.sort()
        p90 = late[int(0.9 * (len(late) - 1))] if late else 0
        print(f"{mode} with prefix caching ({len(batch)} cases, seed {args.seed}): the engine "
              f"agrees step for step in {agree}; hits cover {hit / max(prompt, 1):.0%} of "
              f"prompt tokens; a replay without caching agrees in {blind} and puts first "
              f"tokens a median {statistics.median(late or [0]):g} steps late (p90 {p90})")
        for name, why in diffs[:args.show]:
            print(f"  {name}: {why}")


if __name__ == "__main__":
    sys.exit(main())
