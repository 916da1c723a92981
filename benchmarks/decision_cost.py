"""What one ``sfs`` decision costs as the pool grows, and what each rule for choosing among
replicas gives: the paper's workload with every model replicated (pools of 3 to 999
instances), at the same load per instance as ``duetime experiment scale`` (a fraction of 9.5
q/s per replica set), simulated; per pool size and rule, measured side by side in one run:

* ``ranked`` (the default): replicas in the order of the pool's wait estimates, the first
  whose forecast meets the target;
* ``least`` (``ranked=0``): the least forecast that meets the target, forecasts pruned by
  a lower bound;
* ``sample of 2`` (``replica_sample=2``): the least among two drawn at random;
* ``deadline``: ``sfs-deadline`` (issue 36), candidates best utility first, the first whose
  forecasts meet the targets (no deadline on the paper's requests: the TTFT target decides),
  each one a TTFT forecast and a finish forecast at the predicted length (counted apart).

    python benchmarks/decision_cost.py [--replicas 1,10,33,100,333] [--load 0.9]
        [--per-instance 50] [--rules ranked,least,sample,deadline] [--seed 0]

Prints one row per pool size and rule: decision p50, mean and p99 (µs), forecasts per
decision (TTFT + finish), wall per simulated request, simulated / wall, on-time rate and
OnTimeUtility.
"""

from __future__ import annotations

import argparse

import numpy as np

from duetime.engine import warm_up
from duetime.estimate import SfsEstimator
from duetime.experiments.runner import Point, Runner
from duetime.experiments.scale import CAPACITY_QPS
from duetime.workload import load_workload

RULES = {"ranked": ("sfs", {}), "least": ("sfs", {"ranked": 0}),
         "sample": ("sfs", {"replica_sample": 2}), "deadline": ("sfs-deadline", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,10,33,100,333")
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--per-instance", type=int, default=50)
    ap.add_argument("--rules", default="ranked,least,sample")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rules = args.rules.split(",")
    for r in rules:
        if r not in RULES:
            ap.error(f"--rules: unknown rule {r!r} (known: {', '.join(RULES)})")
    print("| instances | rule | decision p50 | mean | p99 | forecasts per decision | "
          "wall per request | simulated / wall | on time | OnTimeUtility |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    warm_up()
    base = load_workload("paper")
    counted = _Counted()
    for r in (int(x) for x in args.replicas.split(",")):
        prof = base.with_replicas(r)
        size = len(prof.instance_pairs())
        runner = Runner(prof, seed=args.seed)
        rate = round(args.load * CAPACITY_QPS * r, 6)
        for rule in rules:
            counted.forecasts = counted.finishes = 0
            policy, params = RULES[rule]
            row, res = runner.run(Point(policy, rate, args.per_instance * size,
                                        params=tuple(params.items())))
            o = res.overhead_s * 1e6
            n = len(o)
            fin = f" + {counted.finishes / n:.2f}" if counted.finishes else ""
            print(f"| {size} | {rule} | {np.median(o):.0f} µs | {o.mean():.0f} µs | "
                  f"{np.percentile(o, 99):.0f} µs | {counted.forecasts / n:.2f}{fin} | "
                  f"{row['wall_s'] / n * 1e6:.0f} µs | "
                  f"{row['simulated_s'] / row['wall_s']:.1f}x | {row['on_time']:.2%} | "
                  f"{row['ontime_utility']:.4f} |", flush=True)


class _Counted:
    """Counts the SFS forecasts made (wraps the estimator's ``ttft`` and ``finishes``)."""

    def __init__(self) -> None:
        self.forecasts = self.finishes = 0
        inner, inner_finishes = SfsEstimator.ttft, SfsEstimator.finishes

        def ttft(est, *a, **kw):
            self.forecasts += 1
            return inner(est, *a, **kw)

        def finishes(est, *a, **kw):
            self.finishes += 1
            return inner_finishes(est, *a, **kw)

        SfsEstimator.ttft = ttft
        SfsEstimator.finishes = finishes


if __name__ == "__main__":
    main()
