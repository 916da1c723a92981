"""What does a derived profile get right and wrong? Derive each measured H100 profile from
another one and compare with its measurement.

``duetime.engine.derive`` scales a measured profile's batch-time terms to other hardware or
another model (compute terms by FLOPs and active parameters, attention terms by FLOPs and
attention width, KV reads by bandwidth and KV bytes per token, a step's fixed cost split into a
host part and one read of the weights). The only measurements here are the three Qwen3 profiles
on H100s (0.6B and 8B on one, 32B on two), so each is derived from each other one and compared
with what was measured, at three levels:

1. the coefficients, derived / measured;
2. step times on batch shapes a server sees (a lone prefill, decode batches, a mixed step),
   derived / measured;
3. one instance of the model under the paper's workload (Poisson, ``round-robin`` over that
   one instance, the simulator's true engine): mean and p90 TTFT and the on-time rate with the
   derived profile against the measured one, at the rates where the measured instance is at
   40% and 80% of its on-time knee (the rate at which its on-time rate falls 0.05 below its
   light-load value, searched).

    python benchmarks/derived_profiles.py [--requests N] [--pairs REF:TARGET,...]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import numpy as np

from duetime.engine import load_profile
from duetime.engine.derive import derive
from duetime.engine.profiles import measured_option, profile_names
from duetime.experiments import Point, Runner
from duetime.workload import load_workload

# (label, decode requests, their context, prefill tokens in the step, prefill's computed)
SHAPES = [
    ("prefill 512", 0, 0, 512, 0),
    ("prefill 4096", 0, 0, 4096, 0),
    ("prefill 16384", 0, 0, 16384, 0),
    ("decode 16 x 1k", 16, 1024, 0, 0),
    ("decode 128 x 2k", 128, 2048, 0, 0),
    ("decode 256 x 4k", 256, 4096, 0, 0),
    ("mixed 64 x 2k + 2048", 64, 2048, 2048, 0),
]


def step_time(model, n_dec: int, ctx: int, pre: int, computed: int) -> float:
    """One step's duration from the batch features (engine/batch_time.py)."""
    dec_ctx = n_dec * ctx
    pre_attn = pre * computed + pre * (pre + 1) // 2 if pre else 0
    lens = [ctx + 1] * n_dec + ([computed + pre] if pre else [])
    return model.duration(n_dec, pre, pre * pre, pre_attn, dec_ctx, sum(lens),
                          sum(x * x for x in lens))


def one_instance(spec, workload, rate: float, n: int) -> dict:
    wl = replace(workload, models={spec_name(workload, spec): spec}, replicas={})
    row, res = Runner(wl, seed=0).run(Point("round-robin", rate, n))
    ttft = np.asarray(res.ttft)
    return {"mean": float(ttft.mean()), "p90": float(np.quantile(ttft, 0.9)),
            "on_time": float(row["on_time"])}


def spec_name(workload, spec) -> str:
    for name in workload.models:
        if spec.name.startswith(name):
            return name
    raise SystemExit(f"derived_profiles: {spec.name} is not a model of the workload")


def knee(spec, workload, n: int) -> float:
    """The rate at which one instance's on-time rate falls 0.05 below its value at a light
    load (bisection, 8 runs). Not a fixed 0.9: alone, 32B's prefill misses the paper's targets
    of long prompts at any load (on time ~0.85)."""
    lo, hi = 0.05, 64.0
    floor = one_instance(spec, workload, lo, n)["on_time"] - 0.05
    for _ in range(8):
        mid = (lo * hi) ** 0.5
        if one_instance(spec, workload, mid, n)["on_time"] >= floor:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000,
                    help="requests per simulated point (default 3000)")
    ap.add_argument("--pairs", default=None, metavar="REF:TARGET,...",
                    help="which derivations (default: every measured profile from every other)")
    args = ap.parse_args()
    names = profile_names()
    pairs = ([tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else
             [(r, t) for t in names for r in names if r != t])
    workload = load_workload("paper")
    print("1. coefficients, derived / measured")
    rows = []
    for ref, target in pairs:
        r, m = load_profile(ref), load_profile(target)
        d = derive(r, measured_option(ref), measured_option(target))
        ratios = {k: d.batch_time.coefficients[k] / v for k, v in m.batch_time.coefficients.items()}
        steps = [step_time(d.batch_time, *s[1:]) / step_time(m.batch_time, *s[1:])
                 for s in SHAPES]
        rows.append((ref, target, r, m, d, ratios, steps))
        print(f"  {target:>10} from {ref:<10} "
              + " ".join(f"{k}={v:.2f}" for k, v in ratios.items())
              + f"   KV blocks {d.config.num_gpu_blocks} vs {m.config.num_gpu_blocks}")
    print()
    print("2. step times, derived / measured (measured ms in brackets)")
    print(f"  {'target from ref':>24} " + " ".join(f"{s[0]:>20}" for s in SHAPES))
    for ref, target, _r, m, _d, _ratios, steps in rows:
        cells = [f"{x:.2f} ({step_time(m.batch_time, *s[1:]) * 1000:.1f})"
                 for x, s in zip(steps, SHAPES, strict=True)]
        print(f"  {target + ' from ' + ref:>24} " + " ".join(f"{c:>20}" for c in cells))
    print()
    print(f"3. one instance, the paper's workload, Poisson, {args.requests} requests a point")
    print(f"  {'target from ref':>24} {'knee q/s':>9} {'load':>5} {'rate':>6} "
          f"{'mean TTFT ms':>17} {'p90 TTFT ms':>17} {'on time':>13}  (derived / measured)")
    knees: dict[str, float] = {}
    for ref, target, _r, m, d, _ratios, _steps in rows:
        m_priced = replace(workload.models[target], batch_time=m.batch_time, config=m.config)
        d_priced = replace(m_priced, batch_time=d.batch_time, config=d.config,
                           derived_from=d.derived_from)
        if target not in knees:
            knees[target] = knee(m_priced, workload, args.requests)
        for load in (0.4, 0.8):
            rate = knees[target] * load
            a = one_instance(d_priced, workload, rate, args.requests)
            b = one_instance(m_priced, workload, rate, args.requests)
            print(f"  {target + ' from ' + ref:>24} {knees[target]:>9.2f} {load:>5.1f} "
                  f"{rate:>6.2f} {a['mean'] * 1000:>8.0f} / {b['mean'] * 1000:<6.0f} "
                  f"{a['p90'] * 1000:>8.0f} / {b['p90'] * 1000:<6.0f} "
                  f"{a['on_time']:>5.3f} / {b['on_time']:.3f}")
    errs = [abs(x - 1) for *_, steps in rows for x in steps]
    print()
    print(f"step times: median |derived / measured - 1| = {statistics.median(errs):.2f} over "
          f"{len(errs)} (pair, shape) cells")


if __name__ == "__main__":
    main()
