"""What one ``sfs`` decision costs as the pool grows: the paper's workload with every model
replicated, the rate scaled with the pool (the same load per instance), simulated; per pool
size, the decision time (the simulator's wall time per routing call) with the forecasts' lower
bound (the default), without it (every replica of a tier forecast), and with a sample of two
replicas, measured side by side in one run.

    python benchmarks/decision_cost.py [--replicas 1,10,30] [--requests 8000] [--seed 0]

Prints one row per pool size and rule: decision p50 and mean (µs), wall per simulated request,
and the on-time rate (the bound must not change it).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from duetime.estimate import SfsEstimator
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.workload import Poisson, load_workload, sample_requests

RATE_PER_MODEL = 8.6  # q/s per replica of each of the paper's three models (its load sweep's middle)


class Unbounded:
    """The SFS estimator without its lower bound: every replica of a tier is forecast."""

    name = "sfs"

    def __init__(self) -> None:
        self.inner = SfsEstimator()

    def ttft(self, *a, **kw) -> float:
        return self.inner.ttft(*a, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,10,30")
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| instances | rule | decision p50 | decision mean | wall per request | on time |")
    print("|---|---|---|---|---|---|")
    for r in (int(x) for x in args.replicas.split(",")):
        prof = load_workload("paper").with_replicas(r)
        rng = np.random.default_rng(args.seed)
        reqs = sample_requests(prof, Poisson(RATE_PER_MODEL * r).times(args.requests, rng),
                               rng)
        for rule in ("bounded", "unbounded", "sample of 2"):
            pol = make_policy("sfs", {"replica_sample": 2} if rule == "sample of 2" else {})
            if rule == "unbounded":
                pol.estimator = Unbounded()
            t = time.perf_counter()
            res = ClusterSim(prof, pol, seed=args.seed).run(reqs)
            wall = time.perf_counter() - t
            o = res.overhead_s * 1e6
            print(f"| {len(prof.instance_pairs())} | {rule} | {np.median(o):.0f} µs | "
                  f"{o.mean():.0f} µs | {wall / len(reqs) * 1e6:.0f} µs | "
                  f"{np.mean(res.ttft <= res.requests.target):.2%} |", flush=True)


if __name__ == "__main__":
    main()
