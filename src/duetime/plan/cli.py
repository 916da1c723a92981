"""``duetime plan``: the cheapest pool for a workload, with the router in the loop."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from duetime.argtypes import positive_float, positive_int, unit_rate
from duetime.experiments.fanout import add_fanout_options, fanout_from


def _price(text: str) -> tuple[str, float]:
    gpu, sep, usd = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return gpu, float(usd)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want GPU=USD_PER_HOUR (e.g. h100=2.5), got {text!r}")\
            from None


QUICK = {"requests": 1000, "max_requests": 4000, "max_replicas": 3}


def plan_input(args: argparse.Namespace) -> dict[str, Any]:
    """The plan's YAML form: the file's (if given), then the flags over it."""
    import yaml

    data: dict[str, Any] = {}
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except OSError as e:
            raise ValueError(f"{args.config}: cannot read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{args.config}: not valid YAML: "
                             f"{' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: must be a mapping (workload, rate, options, ...)")
    if args.quick:
        data = {**QUICK, **data}
    for key in ("workload", "rate", "router", "requests", "max_replicas", "seed", "gpus"):
        v = getattr(args, key)
        if v is not None:
            data[key] = v
    if args.requests is not None:  # (room to lengthen its runs: --quick's cap is lower)
        data["max_requests"] = max(int(data.get("max_requests", 0)), 4 * args.requests)
    if args.options is not None:
        data["options"] = args.options
    if args.price:
        data["prices"] = {**data.get("prices", {}), **dict(args.price)}
    cons = dict(data.get("constraints") or {})
    for key in ("on_time", "quality", "budget"):
        v = getattr(args, key)
        if v is not None:
            cons[key] = v
    if cons:
        data["constraints"] = cons
    if args.objective is not None:
        data["objective"] = args.objective
    sched = dict(data.get("schedule") or {})
    if args.diurnal is not None:
        sched["diurnal"] = {**(sched.get("diurnal") or {}), "peak": args.diurnal[0],
                            "trough": args.diurnal[1]}
        sched.pop("trace", None)
    if args.rate_trace is not None:
        sched["trace"] = str(Path(args.rate_trace).resolve())
        sched.pop("diurnal", None)
    if args.interval_min is not None:
        sched["interval_min"] = args.interval_min
    if args.scale_up_delay is not None:
        sched["scale_up_delay_s"] = args.scale_up_delay
    if sched:
        data["schedule"] = sched
    elif "rate" not in data:
        data["rate"] = 8.6
    return data


def _pair(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want PEAK,TROUGH (q/s), got {text!r}") from None
    if not 0 < b <= a:
        raise argparse.ArgumentTypeError(f"want 0 < TROUGH <= PEAK, got {text!r}")
    return a, b


def _cmd_plan(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.plan.problem import PlanError, problem_from_dict
    from duetime.plan.report import write_plan
    from duetime.plan.search import enumerate_grid, search

    try:
        data = plan_input(args)
        base = Path(args.config).parent if args.config else None
        problem = problem_from_dict(data, args.config or "plan", base)
    except (PlanError, ValueError) as e:
        raise error(str(e)) from None
    print(f"plan: {len(problem.options)} deployments ({', '.join(o.name for o in problem.options)}),"
          f" up to {problem.max_replicas} replicas each; {problem.rate:g} q/s, router "
          f"{problem.router}", file=sys.stderr)
    if problem.intervals:
        return _schedule(args, problem, error)
    fanout = fanout_from(args.workers, args.ray)
    try:
        result = (enumerate_grid if args.grid else search)(problem, fanout=fanout)
    except (RuntimeError, ConnectionError) as e:
        if args.ray is None:
            raise
        raise error(f"--ray: {' '.join(str(e).split())}") from None
    data = write_plan(Path(args.out), problem, result)
    best = result.best
    if best is None:
        print("no pool of the space meets the constraints (see report.md)")
    else:
        pool = " + ".join(f"{r} x {o.name}" for o, r in best.pool)
        print(f"{pool}: {best.cost:.2f} USD/h; worst class on time {best.worst_on_time:.3f}, "
              f"quality {best.quality:.3f}")
    s = data["search"]
    print(f"{s['pools_considered']} pools considered, {s['pools_simulated']} simulated "
          f"({s['simulations']} runs, {s['wall_s']:.1f} s); wrote {args.out}/report.md, "
          "summary.json, frontier.png" + (", pool.yaml, pool-urls.yaml" if best else ""))
    return 0 if best is not None else 1


def _schedule(args: argparse.Namespace, problem, error: type[Exception]) -> int:
    from duetime.plan.report import write_schedule
    from duetime.plan.schedule import plan_schedule

    fanout = fanout_from(args.workers, args.ray)
    print(f"  {len(problem.intervals)} intervals; rate levels searched on {fanout.label}",
          file=sys.stderr)
    try:
        sched = plan_schedule(problem, progress=lambda m: print(f"  {m}", file=sys.stderr),
                              fanout=fanout)
    except (RuntimeError, ConnectionError) as e:
        raise error(f"--ray: {' '.join(str(e).split())}") from None
    data = write_schedule(Path(args.out), problem, sched)
    if data["static_gpu_hours"] is None:
        print("no pool meets the constraints at the peak rate (see report.md)")
        return 1
    print(f"schedule: {data['gpu_hours']:.1f} GPU-hours, {data['cost_usd']:.2f} USD against "
          f"the static peak pool's {data['static_gpu_hours']:.1f} GPU-hours, "
          f"{data['static_cost_usd']:.2f} USD (x{data['gpu_hours_vs_static_peak']:.3f} GPU-hours,"
          f" x{data['cost_vs_static_peak']:.3f} cost); {data['search']['levels']} rate levels "
          f"planned; wrote {args.out}/report.md, summary.json, schedule.csv, schedule.png, "
          "autoscale-table.yaml")
    return 0 if data["unplanned_intervals"] == 0 else 1


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``plan`` on the ``duetime`` parser tree."""
    p = command("plan", lambda a: _cmd_plan(a, error),
                "size a pool: which models, how many replicas, on which GPUs",
                "The cheapest pool (replicas per deployment MODEL@GPU[xN]) whose simulated "
                "on-time rate meets a floor for every class of the workload (its tasks), with "
                "the router in the loop. Pools are walked in order of cost; bounds from the "
                "profiles rule most out without a simulation (docs/plan.md). Writes "
                "report.md, summary.json, frontier.png, and pool.yaml / pool-urls.yaml for "
                "`duetime serve --config`. Flags override the YAML file's keys. Exit status "
                "1 when no pool of the space meets the constraints.")
    p.add_argument("config", nargs="?", default=None, metavar="PLAN.yaml",
                   help="the plan's input (keys: workload, rate, options, gpus, router, "
                   "constraints {on_time, quality, budget}, prices, requests, max_replicas, "
                   "seed; docs/plan.md)")
    p.add_argument("--out", default="out/plan", metavar="DIR",
                   help="output folder (default out/plan)")
    p.add_argument("--workload", default=None, metavar="NAME|FILE",
                   help="a built-in workload or a YAML profile (default paper)")
    p.add_argument("--rate", type=positive_float, default=None, metavar="R",
                   help="arrivals per second, Poisson (default 8.6)")
    p.add_argument("--options", type=lambda s: [x for x in s.split(",") if x], default=None,
                   metavar="A,B,...", help="the deployments to choose from, MODEL@GPU[xN] "
                   "(default: each model on each catalogue GPU at the fewest GPUs that hold it)")
    p.add_argument("--gpus", type=lambda s: [x for x in s.split(",") if x], default=None,
                   metavar="G,...", help="only these GPUs for the default deployments")
    p.add_argument("--router", default=None, metavar="POLICY",
                   help="the routing policy in the loop (default sfs)")
    p.add_argument("--on-time", type=unit_rate, default=None, metavar="F",
                   help="every class's on-time floor (default 0.95)")
    p.add_argument("--quality", type=unit_rate, default=None, metavar="Q",
                   help="a floor on the mean quality (default none)")
    p.add_argument("--budget", type=positive_float, default=None, metavar="USD",
                   help="the most the pool may cost per hour")
    p.add_argument("--price", type=_price, action="append", default=None, metavar="GPU=USD",
                   help="your price of a GPU-hour (repeatable; default the catalogue's, "
                   "`duetime profiles --gpus`)")
    p.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="of one deployment (default 8)")
    p.add_argument("--requests", type=positive_int, default=None, metavar="N",
                   help="requests a simulation (default 4000; longer where a decision is in "
                   "the noise)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="shorter simulations (1000 requests) and up to 3 replicas (seconds)")
    p.add_argument("--objective", choices=["cost", "gpus"], default=None,
                   help="what to minimise: USD per hour (default) or GPUs")
    p.add_argument("--diurnal", type=_pair, default=None, metavar="PEAK,TROUGH",
                   help="plan a day: the rate a cosine from TROUGH to PEAK q/s (peak at 14 h), "
                   "a pool per interval, against the static peak pool")
    p.add_argument("--rate-trace", default=None, metavar="FILE",
                   help="plan a trace of rates instead: CSV with start_s and rate columns")
    p.add_argument("--interval-min", type=positive_float, default=None, metavar="M",
                   help="a schedule's interval (default 15 minutes)")
    p.add_argument("--scale-up-delay", type=float, default=None, metavar="S",
                   help="seconds a new replica costs before it serves (default 60)")
    add_fanout_options(p, "the plan's simulations (a schedule's: its rate levels)")
    p.add_argument("--grid", action="store_true",
                   help="simulate every pool of the space instead of searching (slow; the "
                   "reference the search is tested against)")
