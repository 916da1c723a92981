"""How fast is a TTFT forecast? Microseconds per forecast by snapshot size, beside the oracle.

For each setting, snapshots with paper-like request lengths are built with
``Snapshot.from_dict`` (as an exporter's JSON would arrive), then timed in one run:

* ``from_dict``: parsing and validating the JSON form;
* ``first``: the first ``duetime.forecast`` of a snapshot (probe of 1000 tokens) — everything
  included: the replay arrays, the base replay of its workload, the probe;
* ``further``: later probes of the same snapshot with other prompt lengths (16 .. 32768);
* ``kernel``: one full compiled replay with the probe (what a fallback or ``until="finish"``
  costs);
* ``oracle``: the plain per-request Python step loop (``replay(..., reference=True)``) on the
  same snapshot and probe.

Medians over snapshots (and probes); ``p90`` of ``first`` shows the spread. The targets (DESIGN):
first <= 100 us and further <= 10 us on 200 running / 20 waiting; the released SFS C++
simulator takes ~1e-4 s per forecast.

A second table times a live engine's own forecaster (``Engine.forecaster()``: kept across the
engine's changes, its replay read straight from the engine's arrays,
:mod:`duetime.engine.live_forecast`) after one change — an arrival at the waiting tail or one
engine step — beside what the same forecast costs through a snapshot of the same state
(``forecast(engine.snapshot(), ...)``: the tables built, the replay arrays made from them).
The two are timed in alternating order on each state; ``steps``: base steps recorded.

A third table times forecasts with prefix caching: snapshots of a live engine (one that has
forecast before, a step ago, as an instance's engine in the simulator or the gateway has)
whose cache holds ``cached`` blocks (of earlier conversations, free to evict) beside 200 running / 20
waiting requests of tenants that share system prompts; every probe shares one too, with its
block keys. Such a forecast borrows the engine's cache for its base replay (and puts it back);
``kernel`` is one replay with the probe without caching on the same requests, for scale.
After one more engine step, ``live`` is the engine's own forecaster's first probe (read from the
engine's arrays, its cache borrowed) and ``snapshot+first`` the same forecast through a snapshot
built for it, each with everything it does timed, in alternating order (the second puts back
what the first kept of the cache; the two are checked equal).

A fourth table times forecasts with LoRA adapters (``max_loras``): the paper-like snapshots
of the first table (200 running, 20 waiting), the running requests on ``max_loras`` adapters
and the base model, the waiting ones on Zipf-popular adapters of a larger set (some skipped
for theirs), probes on the base model, on a running adapter and on cold ones; beside the same
snapshots without adapters, timed in alternating order (``ratio``: with / without).

    python benchmarks/forecast_speed.py [--snapshots N] [--quick] [--async-scheduling]
                                        [--lora-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from duetime.engine import (
    Engine,
    Paper4,
    SchedulerConfig,
    Snapshot,
    forecast,
    load_profile,
    replay,
)
from duetime.engine.snapshot import RequestTable
from duetime.engine.synthetic import paper_like_snapshot

FURTHER = (16, 512, 2048, 8192, 32768)


def _us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _p90(samples: list[float]) -> float:
    return sorted(samples)[int(0.9 * (len(samples) - 1))] * 1e6


def measure(model, budget: int, n_running: int, n_waiting: int, n_snapshots: int,
            kv_factor: float | None = None, asynchronous: bool = False) -> dict:
    """``kv_factor``: size the KV cache at this multiple of what the running requests hold
    (tight caches make the replay preempt), instead of 100000 blocks. ``asynchronous``:
    vLLM's asynchronous scheduling (the GPU default)."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max(256, n_running + 1),
                          max_model_len=131072, block_size=16, num_gpu_blocks=10_000_000,
                          async_scheduling=asynchronous)
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("from_dict", "first", "further", "kernel", "oracle")}
    steps = []
    for seed in range(n_snapshots):
        d = paper_like_snapshot(random.Random(seed), model, n_running=n_running,
                                n_waiting=n_waiting, config=cfg).to_dict()
        held = sum(-(-r["computed_tokens"] // 16) for r in d["running"])
        d["config"]["num_gpu_blocks"] = (int(held * kv_factor) + 16 if kv_factor
                                         else max(100_000, held + 1))  # + the null block
        t = time.perf_counter()
        snap = Snapshot.from_dict(d)
        rows["from_dict"].append(time.perf_counter() - t)
        t = time.perf_counter()
        f = forecast(snap, 1000)
        rows["first"].append(time.perf_counter() - t)
        steps.append(f.steps)
        for p in FURTHER:
            t = time.perf_counter()
            forecast(snap, p)
            rows["further"].append(time.perf_counter() - t)
        t = time.perf_counter()
        replay(snap, 1000)
        rows["kernel"].append(time.perf_counter() - t)
        t = time.perf_counter()
        replay(snap, 1000, reference=True)
        rows["oracle"].append(time.perf_counter() - t)
    return {"rows": rows, "steps": statistics.median(steps)}


def lora_twin(snap: Snapshot, rng: random.Random, max_loras: int, adapters: int) -> Snapshot:
    """The snapshot on vLLM with ``--max-loras max_loras``: its running requests on that many
    adapters (and the base model), its waiting ones on Zipf-popular ones of ``adapters``."""
    live = rng.sample(range(1, adapters + 1), max_loras)
    weights = [1.0 / (a + 1) for a in range(adapters + 1)]
    run, wait = snap.running_table, snap.waiting_table
    cfg = dataclasses.replace(snap.config, max_loras=max_loras)
    return Snapshot(cfg, snap.model, time=snap.time,
                    running=RequestTable(run.ids, run.prompt, run.computed, run.output,
                                         run.predicted, run.arrival,
                                         [rng.choice([0, *live]) for _ in range(len(run))]),
                    waiting=RequestTable(wait.ids, wait.prompt, wait.computed, wait.output,
                                         wait.predicted, wait.arrival,
                                         rng.choices(range(adapters + 1), weights,
                                                     k=len(wait))))


def measure_lora(model, budget: int, n_snapshots: int, max_loras: int, adapters: int,
                 asynchronous: bool = False) -> dict:
    """First and further probes of the same snapshots without and with adapters, alternating:
    with adapters, the first on the base model, the further ones on the base model and on
    running adapters (the same horizon as without); then one on a cold adapter, which waits
    until an adapter's requests have all finished (``steps``: the horizon its forecast
    replays)."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256,
                          max_model_len=131072, block_size=16, num_gpu_blocks=100_000,
                          async_scheduling=asynchronous)
    rows: dict[str, list[float]] = {k: [] for k in ("first", "further", "first_lora",
                                                    "further_lora", "cold", "cold_steps")}
    for seed in range(n_snapshots):
        rng = random.Random(seed)
        plain = paper_like_snapshot(rng, model, n_running=200, n_waiting=20, config=cfg)
        lora = lora_twin(plain, rng, max_loras, adapters)
        running = sorted(set(lora.running_table.lora.tolist()) - {0})
        probes = [running[0], 0, running[-1], 0, running[0]]
        for with_lora in ((False, True) if seed % 2 else (True, False)):
            snap = lora.at(lora.time) if with_lora else Snapshot(
                plain.config, plain.model, running=plain.running_table,
                waiting=plain.waiting_table)
            key = "_lora" if with_lora else ""
            t = time.perf_counter()
            forecast(snap, 1000)
            rows["first" + key].append(time.perf_counter() - t)
            for p, a in zip(FURTHER, probes, strict=True):
                t = time.perf_counter()
                forecast(snap, p, lora=a if with_lora else 0)
                rows["further" + key].append(time.perf_counter() - t)
            if with_lora:
                t = time.perf_counter()
                f = forecast(snap, 1000, lora=adapters + 1)
                rows["cold"].append(time.perf_counter() - t)
                rows["cold_steps"].append(f.steps)
    return {"rows": rows}


def live_engine(model, budget: int, seed: int, asynchronous: bool = False
                ) -> tuple[Engine, Callable[[], None]]:
    """A live engine without caching, 200 running and 20 just arrived (prompts and outputs
    log-normal, medians ~665 and ~150 tokens; predictions within 30%), and a function that
    adds one more such request."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256,
                          max_model_len=131072, block_size=16, num_gpu_blocks=100_000,
                          async_scheduling=asynchronous)
    eng = Engine(cfg, model, retain_finished=False)
    count = itertools.count()

    def add() -> None:
        p = int(rng.lognormvariate(6.5, 0.8)) + 1
        out = int(rng.lognormvariate(5.0, 0.8)) + 1
        eng.add(f"r{next(count)}", p, out,
                predicted_output_tokens=max(1, int(out * rng.uniform(0.7, 1.3))))

    while eng.num_running < 200:
        add()
        eng.step()
    for _ in range(20):
        add()
    return eng, add


def measure_live(model, budget: int, n_engines: int, asynchronous: bool = False) -> dict:
    rows: dict[str, list[float]] = {k: [] for k in ("arrival", "arrival_snap", "step",
                                                    "step_snap", "further")}
    steps: dict[str, list[int]] = {"arrival": [], "step": []}
    for seed in range(n_engines):
        eng, add = live_engine(model, budget, seed, asynchronous)
        eng.forecaster().ttft(1000)  # (an engine's first forecast allocates its buffers)
        for k in range(8):
            for change, what in ((add, "arrival"), (eng.step, "step")):
                change()
                order = (0, 1) if k % 2 else (1, 0)
                for o in order:
                    t = time.perf_counter()
                    if o == 0:
                        fc = eng.forecaster()
                        fc.ttft(1000)
                    else:
                        forecast(eng.snapshot(), 1000)
                    rows[what if o == 0 else what + "_snap"].append(time.perf_counter() - t)
                steps[what].append(fc._n)
                for p in FURTHER[:3]:
                    t = time.perf_counter()
                    eng.forecaster().ttft(p)
                    rows["further"].append(time.perf_counter() - t)
    return {"rows": rows, "steps": {k: statistics.median(v) for k, v in steps.items()}}


def caching_engine(model, budget: int, cached: int, seed: int, asynchronous: bool = False,
                   seats: int = 200) -> tuple[Engine, list[list[int]], Callable[[], None]]:
    """A live engine with caching: ``cached`` blocks left by finished requests, then 200
    running and 20 waiting requests of 8 tenants (system prompts of 1,000-4,000 tokens).
    With ``seats`` = 200 (max_num_seqs) the waiting ones wait for seats, so a probe waits for
    20 requests to finish (tens of steps); with more, they have just arrived (as the
    snapshots of the first table: a probe is admitted within a few steps). Also returns a
    function that adds one more such request."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seats,
                          max_model_len=65536, block_size=16, num_gpu_blocks=cached + 40_000,
                          async_scheduling=asynchronous, enable_prefix_caching=True)
    eng = Engine(cfg, model, retain_finished=False)
    for i in range(cached // 1000):  # old conversations: 16,000 tokens each, now free
        eng.add(f"old{i}", 16_000, 1, hashes=[rng.getrandbits(62) for _ in range(1000)])
    eng.drain()
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(60, 250))] for _ in range(8)]

    count = itertools.count()

    def add() -> None:
        keys = rng.choice(systems)
        p = len(keys) * 16 + int(rng.lognormvariate(5.5, 0.8))
        out = int(rng.lognormvariate(5.0, 0.8)) + 1
        keys = keys + [rng.getrandbits(62) for _ in range((p + out) // 16 - len(keys))]
        eng.add(f"r{next(count)}", p, out, hashes=keys)

    if seats <= 200:
        for _ in range(220):
            add()
        while eng.num_running < 200 or eng.num_waiting > 20:
            eng.step()
        return eng, systems, add
    while eng.num_running < 200 or eng.num_waiting:  # 200 running, all prefilled
        while eng.num_running + eng.num_waiting < 200:
            add()
        eng.step()
    for _ in range(20):  # just arrived
        add()
    return eng, systems, add


def measure_caching(model, budget: int, n_snapshots: int, cached: int,
                    asynchronous: bool = False, seats: int = 200) -> dict:
    rows: dict[str, list[float]] = {k: [] for k in ("first", "further", "kernel", "live",
                                                     "snap_first")}
    steps, held = [], []
    for seed in range(n_snapshots):
        eng, systems, add = caching_engine(model, budget, cached, seed, asynchronous, seats)
        rng = random.Random(~seed)  # (not the engine's stream: its keys would be cached)
        # a live engine's snapshots are forecast step after step: the engine's first forecast
        # (its arenas grow, its undo log's pages are touched) is not what a forecast costs
        forecast(eng.snapshot(), 1000)
        eng.step()
        while eng.num_waiting < 20:
            add()
        held.append(eng.cached_blocks)
        snap = eng.snapshot()

        def probe(p: int, rng=rng, systems=systems) -> np.ndarray:
            # (an int64 array, as the simulator and the gateway hold them: a list costs a
            # conversion, ~30 us for 500 keys)
            keys = rng.choice(systems)
            return np.array((keys + [rng.getrandbits(62) for _ in range(p // 16)])[:p // 16],
                            dtype=np.int64)

        keys = probe(1000)
        t = time.perf_counter()
        f = forecast(snap, 1000, prompt_hashes=keys)
        rows["first"].append(time.perf_counter() - t)
        steps.append(f.steps)
        for p in FURTHER:
            keys = probe(p)
            t = time.perf_counter()
            forecast(snap, p, prompt_hashes=keys)
            rows["further"].append(time.perf_counter() - t)
        # after one more step: the engine's own forecaster (read from its arrays), then a
        # snapshot of the same state built and forecast, everything timed
        # (in alternating order: the second puts back what the first kept of the cache)
        eng.step()
        keys = probe(1000)
        got = {}
        for what in (("live", "snap_first") if seed % 2 == 0 else ("snap_first", "live")):
            t = time.perf_counter()
            got[what] = (eng.forecaster().ttft(1000, keys) if what == "live"
                         else forecast(eng.snapshot(), 1000, prompt_hashes=keys))
            rows[what].append(time.perf_counter() - t)
        assert got["live"].estimate_s == got["snap_first"].estimate_s
        plain = Snapshot(dataclasses.replace(snap.config, enable_prefix_caching=False),
                         snap.model, time=snap.time, running=snap.running_table,
                         waiting=snap.waiting_table)
        t = time.perf_counter()
        replay(plain, 1000)
        rows["kernel"].append(time.perf_counter() - t)
    return {"rows": rows, "steps": statistics.median(steps),
            "cached": statistics.median(held)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--snapshots", type=int, default=30, help="snapshots per setting")
    ap.add_argument("--quick", action="store_true", help="fewer settings and snapshots")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="snapshots of instances that schedule asynchronously (vLLM on GPUs)")
    ap.add_argument("--lora-only", action="store_true",
                    help="only the table with LoRA adapters")
    args = ap.parse_args()
    n = 8 if args.quick else args.snapshots

    sfs6 = load_profile("qwen3-8b").batch_time
    paper4 = Paper4(b0=0.004, b1=2.0e-5, b2=5.0e-8, b3=1.0e-9)
    # Compile (or load the cached) kernel before timing anything.
    forecast(paper_like_snapshot(random.Random(0), sfs6, n_running=4, n_waiting=2), 100)
    replay(paper_like_snapshot(random.Random(0), sfs6, n_running=4, n_waiting=2), 100)

    if args.lora_only:
        return lora_table(sfs6, paper4, n, args)
    sizes = [(200, 20)] if args.quick else [(10, 2), (50, 5), (200, 20), (500, 50), (1000, 100)]
    settings = [(m, b, r, w, None) for (r, w) in sizes for m in (sfs6, paper4)
                for b in (8192, 32768)]
    settings += [(sfs6, 8192, 200, 20, 1.02), (sfs6, 8192, 200, 20, 1.2)]
    head = (f"{'running':>7} {'waiting':>7} {'model':>6} {'budget':>6} {'kv':>7} {'steps':>5} "
            f"{'from_dict':>9} {'first':>7} {'p90':>7} {'further':>7} {'kernel':>7} "
            f"{'oracle':>8} {'oracle/first':>12}")
    print("microseconds per call (median over snapshots); paper-like lengths, block_size=16;")
    print("kv: num_gpu_blocks = 100000 (or what the running requests hold, if more), or that "
          "multiple of their holding (tight: the replay preempts)")
    print(head)
    print("-" * len(head))
    gc.collect()
    for model, budget, r, w, kv in settings:
        got = measure(model, budget, r, w, n, kv, args.async_scheduling)
        rows = got["rows"]
        first = _us(rows["first"])
        kv_label = f"x{kv:g}" if kv else "100k"
        print(f"{r:>7} {w:>7} {model.name:>6} {budget:>6} {kv_label:>7} {got['steps']:>5.0f} "
              f"{_us(rows['from_dict']):>9.0f} {first:>7.1f} {_p90(rows['first']):>7.1f} "
              f"{_us(rows['further']):>7.1f} {_us(rows['kernel']):>7.1f} "
              f"{_us(rows['oracle']):>8.0f} {_us(rows['oracle']) / first:>11.1f}x")

    print()
    print("a live engine's own forecaster after one change (200 running, 20 just arrived), "
          "beside a forecast of its snapshot; microseconds per call")
    head = (f"{'model':>6} {'budget':>6} {'change':>7} {'steps':>5} {'live':>7} {'p90':>7} "
            f"{'snapshot':>8} {'p90':>7} {'further':>7}")
    print(head)
    print("-" * len(head))
    for model, budget in ((sfs6, 8192), (paper4, 8192), (sfs6, 32768)):
        got = measure_live(model, budget, max(3, n // 3), args.async_scheduling)
        rows = got["rows"]
        for what in ("arrival", "step"):
            print(f"{model.name:>6} {budget:>6} {what:>7} {got['steps'][what]:>5.0f} "
                  f"{_us(rows[what]):>7.1f} {_p90(rows[what]):>7.1f} "
                  f"{_us(rows[what + '_snap']):>8.1f} {_p90(rows[what + '_snap']):>7.1f} "
                  f"{_us(rows['further']):>7.1f}")

    print()
    print("with prefix caching: a live engine's snapshot (200 running, 20 waiting, 8 tenants' "
          "system prompts); probes share a system prompt; microseconds per call")
    print("seats: max_num_seqs; 256: the waiting requests have just arrived (as in the table "
          "above); 200: they wait for seats (the probe for 20 finishes)")
    head = (f"{'model':>6} {'budget':>6} {'seats':>5} {'cached':>7} {'steps':>5} {'first':>7} "
            f"{'p90':>7} {'further':>7} {'kernel w/o caching':>18} {'live':>7} "
            f"{'snapshot+first':>14}")
    print(head)
    print("-" * len(head))
    warm = Engine(SchedulerConfig(num_gpu_blocks=100, enable_prefix_caching=True), sfs6)
    warm.add("w", 40, 2, hashes=[1, 2])
    warm.step()
    forecast(warm.snapshot(), 40, prompt_hashes=[1, 2])  # compile (or load) the caching kernel
    replay(warm.snapshot(), 40, prompt_hashes=[1, 2])
    combos = [(sfs6, 8192, 256), (sfs6, 8192, 200)]
    if not args.quick:
        combos += [(paper4, 8192, 256), (sfs6, 32768, 256), (paper4, 8192, 200),
                   (sfs6, 32768, 200)]
    for model, budget, seats in combos:
        got = measure_caching(model, budget, max(4, n // 4), 50_000, args.async_scheduling,
                              seats)
        rows = got["rows"]
        print(f"{model.name:>6} {budget:>6} {seats:>5} {got['cached']:>7.0f} "
              f"{got['steps']:>5.0f} {_us(rows['first']):>7.1f} {_p90(rows['first']):>7.1f} "
              f"{_us(rows['further']):>7.1f} {_us(rows['kernel']):>18.1f} "
              f"{_us(rows['live']):>7.1f} {_us(rows['snap_first']):>14.1f}")
    print()
    lora_table(sfs6, paper4, n, args)


def lora_table(sfs6, paper4, n: int, args: argparse.Namespace) -> None:
    print("with LoRA adapters: paper-like snapshots (200 running on max_loras adapters and the "
          "base model, 20 waiting on Zipf-popular ones of 'adapters'), beside the same "
          "snapshots without adapters; first: a probe on the base model; further: probes on "
          "the base model and running adapters; cold: a first probe on a cold adapter, which "
          "waits for an adapter's requests to finish ('steps': its horizon); microseconds per "
          "call")
    head = (f"{'model':>6} {'budget':>6} {'max_loras':>9} {'adapters':>8} {'first':>7} "
            f"{'with':>7} {'ratio':>6} {'further':>7} {'with':>7} {'ratio':>6} {'cold':>7} "
            f"{'steps':>6} {'us/step':>7}")
    print(head)
    print("-" * len(head))
    forecast(lora_twin(paper_like_snapshot(random.Random(0), sfs6, n_running=4, n_waiting=2),
                       random.Random(0), 2, 4), 100, lora=1)  # compile the LoRA variants
    combos = [(sfs6, 8192, 4, 16), (sfs6, 8192, 8, 64), (sfs6, 8192, 16, 16)]
    if not args.quick:
        combos += [(paper4, 8192, 4, 16), (sfs6, 32768, 4, 16), (sfs6, 8192, 1, 8)]
    for model, budget, max_loras, adapters in combos:
        rows = measure_lora(model, budget, n, max_loras, adapters,
                            args.async_scheduling)["rows"]
        f0, f1 = _us(rows["first"]), _us(rows["first_lora"])
        g0, g1 = _us(rows["further"]), _us(rows["further_lora"])
        cold, steps = _us(rows["cold"]), statistics.median(rows["cold_steps"])
        print(f"{model.name:>6} {budget:>6} {max_loras:>9} {adapters:>8} {f0:>7.1f} {f1:>7.1f} "
              f"{f1 / f0:>5.2f}x {g0:>7.1f} {g1:>7.1f} {g1 / g0:>5.2f}x {cold:>7.0f} "
              f"{steps:>6.0f} {cold / steps:>7.2f}")


if __name__ == "__main__":
    main()
