"""How far a finish forecast is from the finish, with and without sfs-deadline's steady decode.

The ``deadlines`` experiment's pool and requests (``duetime.experiments.deadlines``), every
request's exact output length told to the router (so what remains is the forecast's own
error), routed by ``sfs-deadline``; at each decision the chosen instance's finish is forecast
two ways: the replay as is (its batch drains as the requests beside the probe end) and with
the steady decode (the time per token at least that of the next ``STEADY_TOKENS`` tokens:
arrivals refill the batch). Printed per rate: the error (real - forecast) / forecast time
from the decision, median, p10 and p90, for each.

    python benchmarks/finish_forecast_error.py [--rates 5,9] [--requests 2000] [--seed 0]
"""

from __future__ import annotations

import argparse

import numpy as np

from duetime.experiments.deadlines import exact_lengths, make_stream
from duetime.policy import make_policy
from duetime.policy.deadline import STEADY_TOKENS
from duetime.sim import ClusterSim
from duetime.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="5,9")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prof = load_workload("paper")
    print("| rate | forecast | error p50 | p10 | p90 |")
    print("|---|---|---|---|---|")
    for rate in (float(x) for x in args.rates.split(",")):
        reqs = make_stream(prof, rate, args.requests, args.seed)
        policy = make_policy("sfs-deadline", defaults={"lambda": prof.lam})
        made: dict[int, tuple[float, float]] = {}
        choose = policy.choose

        def recording(req, cands, now, choose=choose, made=made, policy=policy):
            d = choose(req, cands, now)
            n = int(req.output_tokens[d.index])
            k = min(n, STEADY_TOKENS + 1)
            first, near, end = policy.estimator.finishes(cands[d.index].view, req.prompt_tokens,
                                                         [1, k, n], now)
            per = max((end - first) / max(n - 1, 1), (near - first) / max(k - 1, 1))
            made[int(req.id)] = (now + end, now + first + per * (n - 1))
            return d

        policy.choose = recording
        res = ClusterSim(prof, policy, length_model=exact_lengths).run(reqs)
        for j, name in ((0, "draining"), (1, "steady")):
            fc = np.array([made[i][j] for i in range(len(reqs))])
            err = (res.finish - fc) / (fc - reqs.arrival)
            print(f"| {rate:g} | {name} | {np.median(err):+.1%} | {np.percentile(err, 10):+.1%} "
                  f"| {np.percentile(err, 90):+.1%} |")


if __name__ == "__main__":
    main()
