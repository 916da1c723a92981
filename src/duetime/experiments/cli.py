"""``duetime experiment`` and ``duetime simulate``."""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from duetime.argtypes import frontend, key_value, positive_float, positive_int
from duetime.experiments import report as rp
from duetime.experiments.catalog import EXPERIMENTS, run_experiment
from duetime.experiments.fanout import add_fanout_options, fanout_from
from duetime.experiments.runner import Point, Runner
from duetime.policy import PolicyError, check_params, policy_names
from duetime.sim import SimResult
from duetime.sim.cache_view import CACHE_VIEWS
from duetime.sim.fleet import SHARING, SPREADS, FleetSpec
from duetime.workload import (
    ProfileError,
    RequestSet,
    WorkloadProfile,
    builtin_profiles,
    load_mooncake_trace,
    load_trace,
    load_workload,
    make_arrivals,
    multi_turn,
    shared_prefix,
    tenants,
)

PREFIX_WORKLOADS = ("multi-turn", "tenants", "shared-prefix")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Bar:
    """A progress bar on a terminal (rich), plain lines otherwise (logs, CI)."""

    def __init__(self) -> None:
        self.progress = None
        self.task = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"),
                                     TimeElapsedColumn(), transient=True)

    def __call__(self, msg: str) -> None:
        if self.progress is None:
            _log(msg)
            return
        done, total = msg[1:msg.index("]")].split("/") if msg.startswith("[") else (0, 0)
        if self.task is None or self.progress.tasks[self.task].total != int(total):
            self.progress.start()
            self.task = self.progress.add_task("", total=int(total))
        self.progress.update(self.task, completed=int(done),
                             description=msg[msg.index("]") + 2:][:60])

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _cmd_experiment(args: argparse.Namespace, error: type[Exception]) -> int:
    fanout = fanout_from(args.workers, args.ray)
    _log(f"simulations on {fanout.label}")
    bar = _Bar()
    try:
        o = run_experiment(args.name, Path(args.out), quick=args.quick, seed=args.seed,
                           log=bar, fanout=fanout)
    except (RuntimeError, ConnectionError) as e:
        if args.ray is None:
            raise
        raise error(f"--ray: {' '.join(str(e).split())}") from None
    finally:
        bar.close()
    _log(f"wrote {args.out}/results.csv, summary.json, report.md and plots "
         f"({o.summary['wall_s']:.0f} s)")
    return 0


def _cmd_simulate(args: argparse.Namespace, error: type[Exception]) -> int:
    try:
        profile = load_workload(args.workload)
        if args.replicas is not None:
            profile = profile.with_replicas(args.replicas)
    except ProfileError as e:
        raise error(str(e)) from None
    if args.frontend is not None:
        profile = replace(profile, models={m: replace(s, frontend=args.frontend)
                                           for m, s in profile.models.items()})
    replay = args.trace or args.mooncake
    if sum(1 for x in (args.trace, args.mooncake, args.prefix_workload) if x) > 1:
        raise error("give at most one of --trace, --mooncake, --prefix-workload")
    if not replay and args.requests is None:
        raise error("--requests is required (unless --trace or --mooncake replays a file)")
    if not replay and args.clients is None and args.rate is None:
        raise error("--rate is required (unless --trace or --mooncake replays a file or "
                    "--clients runs a closed loop)")
    if (args.rate is not None and args.rate <= 0) or (args.requests is not None
                                                      and args.requests < 1):
        raise error("--rate must be > 0 and --requests >= 1")
    args.rate = args.rate or 1.0
    args.requests = args.requests or 1
    fleet = _fleet(args, profile, error)
    if args.admission_queue is not None:
        if args.admission_queue < 0:
            raise error(f"--admission-queue must be >= 0, got {args.admission_queue}")
        if args.clients is not None or fleet is not None:
            raise error("--admission-queue runs an open loop with one router: drop --clients "
                        "and --routers")
    runner = Runner(profile, seed=args.seed, noise=args.noise,
                    length_error=args.length_error, quality=args.quality,
                    charge_overhead=args.charge_overhead, prefix_caching=args.prefix_caching,
                    cache_view=args.cache_view, step_scale=args.step_scale,
                    admission_queue=args.admission_queue)
    try:
        params = check_params(args.policy, dict(args.policy_param or ()), "--policy-param")
    except PolicyError as e:
        raise error(str(e).replace("--policy-param.", "--policy-param ")) from None
    point = Point(args.policy, args.rate, args.requests, args.arrivals, delta=args.delta,
                  params=tuple(params.items()), fleet=fleet)
    rng = np.random.default_rng(args.seed)
    try:
        if args.trace:
            runner.set_stream(point, load_trace(args.trace, profile, rng))
        elif args.mooncake:
            runner.set_stream(point, load_mooncake_trace(args.mooncake, profile, rng))
        elif args.prefix_workload:
            runner.set_stream(point, _prefix_stream(args.prefix_workload, profile, point, rng))
    except ProfileError as e:
        raise error(str(e)) from None
    row, res = runner.run(point, closed_loop=args.clients)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rp.write_csv(out / "results.csv", [row])
    _write_requests(out / "requests.csv", res)
    summary: dict[str, Any] = dict(row, workload=profile.name, seed=args.seed,
                                   realtime_factor=row["simulated_s"] / row["wall_s"])
    cols = ["router", "rate", "requests", "mean_ttft_s", "p95_ttft_s", "on_time", "utility",
            "ontime_utility", "wall_s", "simulated_s"]
    if fleet is not None:
        cols[1:1] = ["routers", "router_view", "staleness_s", "view_share"]
        if "step_factor" in row:
            cols[cols.index("mean_ttft_s"):cols.index("mean_ttft_s")] = [
                "step_scale", "step_factor", "forecast_mape"]
    if args.admission_queue is not None:
        cols[cols.index("wall_s"):cols.index("wall_s")] = ["queued", "p90_queue_s"]
    per_instance = res.instance_cache_hit_rate
    if per_instance is not None:  # some instance caches prefixes
        summary["cache_view"] = args.cache_view
        summary["cache_hit_rate_by_instance"] = {
            name: None if np.isnan(r) else float(r)
            for name, r in zip(res.instance_names, per_instance.tolist(), strict=True)}
        cols.insert(cols.index("wall_s"), "cache_hit_rate")
    rp.write_json(out / "summary.json", summary)
    print(rp.md_table([row], cols), end="")
    return 0


def _fleet(args: argparse.Namespace, profile: WorkloadProfile,
           error: type[Exception]) -> FleetSpec | None:
    """``--routers`` and its options as a fleet (None: one router reading the true state)."""
    if args.routers is None:
        for flag, value in (("--router-view", args.router_view), ("--staleness", args.staleness),
                            ("--router-spread", args.router_spread),
                            ("--step-correction", args.step_correction or None),
                            ("--step-scale", None if args.step_scale == 1.0 else 1)):
            if value is not None:
                raise error(f"{flag} needs --routers N (routers with shadow views of their own: "
                            "one router without it reads the instances' true state)")
        return None
    view = args.router_view or "shared"
    if args.staleness is not None and view != "shared":
        raise error("--staleness applies to --router-view shared only")
    if args.staleness is not None and not 0 <= args.staleness < float("inf"):
        raise error(f"--staleness must be a number of seconds >= 0, got {args.staleness:g}")
    if args.clients is not None:
        raise error("--routers runs an open loop: drop --clients")
    caching = [m for m, spec in profile.models.items() if spec.config.enable_prefix_caching]
    if args.prefix_caching or (caching and args.prefix_caching is None):
        raise error("--routers does not model prefix caching yet: add --no-prefix-caching")
    return FleetSpec(args.routers, view, args.staleness or 0.0, args.router_spread or "random",
                     step_correction=args.step_correction)


def _prefix_stream(kind: str, profile: WorkloadProfile, point: Point,
                   rng: np.random.Generator) -> RequestSet:
    """A shared-prefix request stream drawn by one of the generators of
    :mod:`duetime.workload.prefix` with its defaults: ``point.requests`` requests at
    ``point.rate`` (for ``multi-turn``: sessions started per second, and the first
    ``point.requests`` turns in arrival order)."""
    arrivals = make_arrivals(point.arrivals, point.rate)
    if kind == "multi-turn":
        return multi_turn(profile, arrivals, rng, n_sessions=point.requests).head(point.requests)
    if kind == "tenants":
        return tenants(profile, arrivals, point.requests, rng)
    return shared_prefix(profile, arrivals, point.requests, rng)


def _write_requests(path: Path, res: SimResult) -> None:
    """Every request's record: arrival, instance, model, target, first token, finish,
    realised quality and cost, and the policy's forecast."""
    rs = res.requests
    cols = {"id": np.arange(len(rs)), "arrival_s": rs.arrival,
            "task": np.array(rs.tasks)[rs.task], "prompt_tokens": rs.prompt,
            "instance": np.array(res.instance_names)[res.instance],
            "model": np.array(rs.models)[res.model], "output_tokens": res.output_tokens,
            "ttft_target_s": rs.target, "first_token_s": res.first_token,
            "finish_s": res.finish, "ttft_s": res.ttft, "quality": res.quality,
            "cost_micro_usd": res.cost, "forecast_ttft_s": res.forecast}
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(zip(*(c.tolist() for c in cols.values()), strict=True))


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``experiment`` and ``simulate`` on the ``duetime`` parser tree."""
    p = command("experiment", lambda a: _cmd_experiment(a, error),
                "run one of the papers' experiments (or the prefix-caching one) in simulation",
                "Run a named experiment over the simulated pool and write results.csv, "
                "summary.json, PNG plots and report.md into --out. Experiments: "
                + ", ".join(EXPERIMENTS) + ".")
    p.add_argument("name", choices=list(EXPERIMENTS), metavar="NAME",
                   help=f"one of: {', '.join(EXPERIMENTS)}")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
    p.add_argument("--quick", action="store_true",
                   help="fewer requests and rates (seconds to a few minutes)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    add_fanout_options(p, "the experiment's simulations")

    p = command("simulate", lambda a: _cmd_simulate(a, error),
                "simulate one router on one request stream",
                "Route a stream of requests over the simulated pool (one instance per model of "
                "the workload) with one policy; print the headline numbers and write "
                "results.csv, requests.csv (every request's record) and summary.json (with "
                "wall_s and simulated_s) into --out.")
    p.add_argument("--policy", required=True, choices=policy_names(), metavar="P",
                   help=f"one of: {', '.join(policy_names())} (`duetime policies` describes "
                   "them)")
    p.add_argument("--policy-param", type=key_value, action="append", default=None,
                   metavar="NAME=VALUE", help="a parameter of the policy, e.g. k=25 for lps "
                   "(repeatable; `duetime policies` lists each policy's)")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="arrivals per second")
    p.add_argument("--requests", type=int, default=None, metavar="N", help="requests")
    p.add_argument("--workload", default="paper", metavar="NAME|FILE",
                   help=f"a built-in workload ({', '.join(builtin_profiles())}) or a YAML "
                   "profile (default paper)")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="N instances of every model of the workload (default: the profile's "
                   "replicas, one each unless it says)")
    p.add_argument("--arrivals", default="poisson", choices=["poisson", "mmpp2", "deterministic"],
                   help="arrival process (default poisson)")
    p.add_argument("--delta", type=float, default=1e-6,
                   help="sfs-soft's delta (per us; the same as --policy-param delta=...)")
    p.add_argument("--frontend", type=frontend, default=None, metavar="REQ_MS,CHUNK_MS[,N]",
                   help="an API server in front of every instance, as vLLM's: milliseconds of "
                   "its work per request and per output chunk, N servers (default: none)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="log-space spread of per-step time noise on the instances (default 0)")
    p.add_argument("--length-error", type=float, default=0.3,
                   help="predicted output length = true x U(1-e, 1+e) (default 0.3)")
    p.add_argument("--quality", choices=["table", "oracle"], default="table",
                   help="predicted quality: the per-task table (default) or the truth")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="replay a trace (CSV or JSONL: arrival, task, prompt_tokens, and "
                   "optionally output_tokens, ttft_target_ms, quality_<model>) instead of "
                   "drawing --requests at --rate")
    p.add_argument("--clients", type=int, default=None, metavar="N",
                   help="closed loop: N clients, each sending its next request when the "
                   "previous one finishes (arrival times are then ignored)")
    p.add_argument("--prefix-workload", choices=PREFIX_WORKLOADS, default=None,
                   help="draw a shared-prefix stream (prompts described by segments, so that "
                   "instances with prefix caching can share their KV blocks) with a generator "
                   "of duetime.workload.prefix and its defaults: multi-turn (chat sessions; "
                   "--rate is then sessions per second), tenants (16 system prompts of 1000 "
                   "tokens, Zipf popularity) or shared-prefix (inference-perf's groups x "
                   "prompts)")
    p.add_argument("--mooncake", metavar="FILE", default=None,
                   help="replay a Mooncake trace (JSONL: timestamp, input_length, "
                   "output_length, hash_ids; shared blocks become shared prefixes)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="turn vLLM's automatic prefix caching on (or off) on every instance "
                   "(default: as the workload profile's engine configs say; the built-in "
                   "profiles have it off). Only streams with segments (--prefix-workload, "
                   "--mooncake) share blocks")
    p.add_argument("--cache-view", choices=CACHE_VIEWS, default="precise",
                   help="what cache-aware routers (prefix-load, cache-aware) know of a caching "
                   "instance's cache: precise (its own, as vLLM's KV events give it; default) "
                   "or estimated (learnt from the router's own decisions)")
    p.add_argument("--routers", type=positive_int, default=None, metavar="N",
                   help="N router replicas, arrivals spread over them, each routing from its own "
                   "shadow engine of every instance fed with what it knows (default: one router "
                   "reading the instances' true state)")
    p.add_argument("--router-view", choices=SHARING, default=None,
                   help="with --routers: what a router's views know: independent (its own "
                   "dispatches only) or shared (everyone's, --staleness seconds late; default)")
    p.add_argument("--staleness", type=float, default=None, metavar="S",
                   help="with --router-view shared: seconds before a router learns of another's "
                   "dispatches, first tokens and ends (default 0)")
    p.add_argument("--router-spread", choices=SPREADS, default=None,
                   help="with --routers: how arrivals are spread over the routers (default "
                   "random)")
    p.add_argument("--step-scale", type=positive_float, default=1.0, metavar="X",
                   help="with --routers: every instance's steps take X times what its "
                   "calibration says (the routers' views price them with the calibration; "
                   "default 1)")
    p.add_argument("--step-correction", action="store_true",
                   help="with --routers: each router's views learn their instance's step time "
                   "from the token counts its requests stream, as the gateway's "
                   "state.step_correction")
    p.add_argument("--admission-queue", type=int, default=None, metavar="N",
                   help="the gateway's admission queue in front of the pool, at most N waiting "
                   "(as admission.max_queued): a request whose best forecast misses its TTFT "
                   "target waits as a critical one does in the gateway, released by first "
                   "tokens and ends (open loop, one router)")
    p.add_argument("--charge-overhead", action="store_true",
                   help="delay each request by the measured routing time")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder")
