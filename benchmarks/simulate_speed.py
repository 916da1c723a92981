"""How fast does the cluster simulator run? Simulated seconds per wall second.

The issue's target: a 16,000-request point at 8.6 q/s (~31 simulated minutes) under ``sfs``
at >= 200x real time on one core. Every router is timed on the same request stream, in one run.

    python benchmarks/simulate_speed.py [--requests N] [--rate R]
"""

from __future__ import annotations

import argparse

import numpy as np

from duetime.experiments import Point, Runner
from duetime.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16000)
    ap.add_argument("--rate", type=float, default=8.6)
    ap.add_argument("--routers", default="sfs,round-robin,shortest-queue,load-aware,"
                    "latency-agnostic,throughput,lps")
    args = ap.parse_args()
    runner = Runner(load_workload("paper"), seed=0)
    runner.run(Point("sfs", args.rate, 200))  # compile / load the kernels first
    print(f"paper workload, {args.requests} requests at {args.rate} q/s, Poisson; one core")
    print(f"{'router':>17} {'wall s':>8} {'simulated s':>12} {'x real time':>12} "
          f"{'routing us/req (p50)':>21} {'on time':>8}")
    for router in args.routers.split(","):
        row, res = runner.run(Point(router, args.rate, args.requests))
        p50 = float(np.median(res.overhead_s)) * 1e6
        print(f"{router:>17} {row['wall_s']:>8.2f} {row['simulated_s']:>12.0f} "
              f"{row['simulated_s'] / row['wall_s']:>12.0f} {p50:>21.1f} {row['on_time']:>8.3f}")


if __name__ == "__main__":
    main()
