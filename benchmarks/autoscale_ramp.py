"""The autoscalers side by side on one ramp in the simulator (a first comparison, before the
``autoscale`` experiment): the paper's workload at 4 q/s for 300 s, 14 q/s for 600 s, 3 q/s
for 900 s, routed by ``sfs`` over a pool that starts at one replica per model; a tick every
15 s, 60 s scale-up delay, up to 12 replicas a model. Prints each autoscaler's on-time rate,
instance-hours, scale events and most replicas, and a static pool of six (4 x 8B) for
reference. Capacities for the rate-based ones, and the planner's table (``duetime plan`` at
rates 10% apart, fewest GPUs, quality >= 0.8) for duetime's second variant, from
``duetime.experiments.capacity``.

    python benchmarks/autoscale_ramp.py
"""

from __future__ import annotations

import numpy as np

from duetime.autoscale import make_autoscaler
from duetime.experiments.capacity import planner_table, replica_capacity
from duetime.experiments.fanout import Fanout
from duetime.policy import make_policy
from duetime.sim import ClusterSim, Scaling
from duetime.workload import load_workload, sample_requests

PHASES = [(4.0, 300), (14.0, 600), (3.0, 900)]


def main() -> None:
    paper = load_workload("paper")
    cap = replica_capacity(paper, "sfs")
    rng = np.random.default_rng(7)
    times, t0 = [], 0.0
    for rate, secs in PHASES:
        times.append(t0 + np.sort(rng.uniform(0, secs, int(rate * secs))))
        t0 += secs
    arrivals = np.concatenate(times)
    reqs = sample_requests(paper, arrivals, rng)

    def run(scaling=None, instances=None):
        pol = make_policy("sfs", defaults={"lambda": paper.lam, "seed": 0, "delta": 1e-6})
        return ClusterSim(paper, pol, seed=0, scaling=scaling, instances=instances).run(reqs)

    print("capacity (q/s per replica at 95% on time): "
          + ", ".join(f"{m} {c:.2f}" for m, c in cap.items()) + "\n")
    print("| autoscaler | on time | instance-hours | scale events | most replicas |")
    print("|---|---|---|---|---|")
    table = planner_table([round(1.1 ** k, 3) for k in range(33)], fanout=Fanout.local())
    rows = [(n, make_autoscaler(n, capacity=cap if n in ("duetime", "throughput-planner")
                                else None))
            for n in ("queue-threshold", "llm-d-saturation", "throughput-planner", "duetime")]
    rows.append(("duetime, planner's table", make_autoscaler("duetime", table=table)))
    for name, auto in rows:
        res = run(Scaling(auto, interval_s=15.0, scale_up_delay_s=60.0, max_replicas=12))
        rec = res.scaling
        print(f"| {name} | {(res.ttft <= reqs.target).mean():.3f} | "
              f"{rec.instance_hours():.2f} | {len(rec.events)} | "
              f"{max(sum(n.values()) for _, n in rec.timeline)} |")
    pool = ([("qwen3-0.6b", "qwen3-0.6b")] + [(f"qwen3-8b.{k}", "qwen3-8b") for k in range(4)]
            + [("qwen3-32b", "qwen3-32b")])
    res = run(instances=pool)
    hours = 6 * (np.nanmax(res.finish) - arrivals[0]) / 3600
    print(f"| static, 6 replicas | {(res.ttft <= reqs.target).mean():.3f} | {hours:.2f} | 0 | 6 |")


if __name__ == "__main__":
    main()
