"""How fast does the cluster simulator run? Simulated seconds per wall second.

The issue's target: a 16,000-request point at 8.6 q/s (~31 simulated minutes) under ``sfs``
at >= 200x real time on one core. Every router is timed on the same request stream, in one run.

A second table runs ``sfs`` on bigger pools at the same load per instance (``--pools``: replicas
of each of the paper's three models; the rate scaled with them): the cost per request should
not grow with the pool. Each pool routes ``max(--requests, 60 s of arrivals)`` requests.

    python benchmarks/simulate_speed.py [--requests N] [--rate R] [--routers A,B]
                                        [--pools 1,30,100] [--split]

``--split`` then times the parts of each pool's request (the decision, stepping the engines,
handing the request over, the rest), with the calls wrapped in timers.
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
    ap.add_argument("--pools", default="1,30,100",
                    help="replicas per model of the pool table ('' for none)")
    ap.add_argument("--split", action="store_true",
                    help="then where sfs's time per request goes in those pools")
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

    if args.pools:
        pools(args.requests, args.rate, [int(r) for r in args.pools.split(",")])
        if args.split:
            split(args.requests, args.rate, [int(r) for r in args.pools.split(",")])


def pools(requests: int, rate: float, replicas: list[int]) -> None:
    """``sfs`` over pools of 3 x ``r`` instances at ``rate`` x ``r`` q/s."""
    print()
    print(f"sfs at {rate} q/s per 3 instances (the paper's three models, r replicas each)")
    print(f"{'instances':>9} {'q/s':>7} {'requests':>8} {'wall s':>7} {'us/request':>10} "
          f"{'x real time':>11} {'routing us/req (p50)':>21} {'vs first':>8}")
    first = None
    for r in replicas:
        runner = Runner(load_workload("paper").with_replicas(r), seed=0)
        q = rate * r
        n = max(requests, int(q * 60))
        row, res = runner.run(Point("sfs", q, n))
        per = row["wall_s"] / n * 1e6
        first = first or per
        print(f"{3 * r:>9} {q:>7.1f} {n:>8} {row['wall_s']:>7.2f} {per:>10.1f} "
              f"{row['simulated_s'] / row['wall_s']:>11.0f} "
              f"{float(np.median(res.overhead_s)) * 1e6:>21.1f} {per / first:>7.2f}x")


def split(requests: int, rate: float, replicas: list[int]) -> None:
    """Where ``sfs``'s time per request goes in the pool table's pools: the decision (the
    policy's ``choose``), stepping the engines to each arrival (the compiled batch step and
    one-by-one advances, the run's final drain included), handing the request to its engine,
    and the rest (building each request, bookkeeping, collecting results).
    Timed by wrapping those calls, which adds ~0.1-0.2 us a call: the total is a little above
    the pool table's."""
    import time

    from duetime.engine.batch_stepper import BatchStepper
    from duetime.sim.instance import SimInstance

    spent = {"stepping": 0.0, "submit": 0.0}

    def timed(cls: type, name: str, phase: str) -> None:
        f = getattr(cls, name)

        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[phase] += time.perf_counter() - t0

        setattr(cls, name, wrapper)

    timed(BatchStepper, "advance", "stepping")
    timed(SimInstance, "advance", "stepping")
    timed(SimInstance, "submit", "submit")
    print()
    print("where sfs's time per request goes (us; calls wrapped in timers)")
    print(f"{'instances':>9} {'total':>7} {'decision':>9} {'stepping':>9} {'submit':>7} "
          f"{'rest':>7}")
    for r in replicas:
        runner = Runner(load_workload("paper").with_replicas(r), seed=0)
        q = rate * r
        n = max(requests, int(q * 60))
        for k in spent:
            spent[k] = 0.0
        row, res = runner.run(Point("sfs", q, n))
        total = row["wall_s"] / n * 1e6
        decision = float(np.sum(res.overhead_s)) / n * 1e6
        step, submit = spent["stepping"] / n * 1e6, spent["submit"] / n * 1e6
        print(f"{3 * r:>9} {total:>7.1f} {decision:>9.1f} {step:>9.1f} {submit:>7.1f} "
              f"{total - decision - step - submit:>7.1f}")


if __name__ == "__main__":
    main()
