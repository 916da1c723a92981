"""Does `duetime plan`'s search find what exhaustive enumeration finds, with few simulations?

For each rate, the same plan is solved twice: by the search (pools in order of cost, bounds
from the profiles rule most out without a simulation: duetime.plan.search) and by simulating
every pool of the space (`enumerate_grid`). Both share nothing but the problem; a pool is
simulated the same way by both (the same stream, the same screening and lengthening rules).
Prints the two answers, their costs, and the simulations each needed.

    python benchmarks/plan_search.py [--rates 4,8.6,12] [--gpus h100,l40s] [--max-replicas 4]
        [--requests 2000] [--quality 0.8] [--on-time 0.95]
"""

from __future__ import annotations

import argparse
import time

from duetime.plan.evaluate import pool_label
from duetime.plan.problem import problem_from_dict
from duetime.plan.search import enumerate_grid, search


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="4,8.6,12")
    ap.add_argument("--gpus", default="h100,l40s")
    ap.add_argument("--max-replicas", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--quality", type=float, default=0.8)
    ap.add_argument("--on-time", type=float, default=0.95)
    args = ap.parse_args()
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        problem = problem_from_dict({
            "rate": rate, "gpus": args.gpus.split(","), "max_replicas": args.max_replicas,
            "requests": args.requests, "max_requests": 8 * args.requests,
            "constraints": {"on_time": args.on_time, "quality": args.quality}})
        t0 = time.perf_counter()
        s = search(problem)
        ts = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = enumerate_grid(problem)
        tg = time.perf_counter() - t0
        rows.append((rate, s, ts, g, tg))
        print(f"rate {rate:g} q/s: {len(problem.options)} deployments, "
              f"{g.pools_considered} pools in the space")
        for name, r, t in (("search", s, ts), ("grid", g, tg)):
            best = r.best
            print(f"  {name:<6} {pool_label(best.pool) if best else '(none)':<58} "
                  f"{best.cost if best else float('nan'):7.2f} USD/h  "
                  f"{len(r.outcomes):5d} pools simulated, {r.simulations:5d} runs, "
                  f"{sum(o.requests for o in r.outcomes):9d} requests, {t:7.1f} s")
    print()
    print(f"{'rate':>5} {'search/grid cost':>17} {'search/grid runs':>17} "
          f"{'search/grid requests':>21}")
    for rate, s, _ts, g, _tg in rows:
        cost = (s.best.cost / g.best.cost) if s.best and g.best else float("nan")
        req = sum(o.requests for o in s.outcomes) / max(1, sum(o.requests for o in g.outcomes))
        print(f"{rate:>5g} {cost:>17.3f} {s.simulations / g.simulations:>17.3f} {req:>21.3f}")


if __name__ == "__main__":
    main()
