"""``duetime calibrate``: fit a running instance's batch-time model (see endpoint.py)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from duetime.argtypes import count, positive_int


def _cmd_calibrate(args: argparse.Namespace, error: type[Exception]) -> int:
    import statistics
    import sys
    from datetime import UTC, datetime

    import yaml

    from duetime.calibrate import Calibration, CalibrationError, cache_facts, calibrate
    from duetime.engine.config import SchedulerConfig

    if not args.url.startswith(("http://", "https://")):
        raise error(f"URL must be an http(s) URL, got {args.url!r}")

    async def go() -> Calibration:
        facts = {} if args.block_size and args.num_gpu_blocks else await cache_facts(args.url)
        block = args.block_size or facts.get("block_size")
        blocks = args.num_gpu_blocks or facts.get("num_gpu_blocks")
        if not block or not blocks:
            raise error("--block-size and --num-gpu-blocks are needed (the server does not "
                        "publish vllm:cache_config_info)")
        max_loras = args.max_loras if args.max_loras is not None else (1 if args.lora else 0)
        cfg = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              block_size=block, num_gpu_blocks=blocks,
                              long_prefill_token_threshold=0, max_loras=max_loras)
        return await calibrate(args.url, args.model, cfg, reps=args.reps, seed=args.seed,
                               batch_model=args.batch_model, lora=args.lora)

    try:
        cal = asyncio.run(go())
    except ValueError as e:  # a SchedulerConfig that cannot be
        raise error(str(e)) from None
    except CalibrationError as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"{args.url}: {e}") from None

    def summary(kind: str) -> str:
        errs = [abs(x) * 100 for x in cal.errors(kind)]
        if not errs:
            return f"{kind} no samples"
        return (f"{kind} {len(errs)} samples, |error| median {statistics.median(errs):.1f}% "
                f"max {max(errs):.1f}%")

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    kinds = ("prefill", "decode", *(("lora prefill", "lora decode") if args.lora else ()))
    text = (f"# duetime calibrate {args.url} --model {args.model}"
            f"{f' --lora {args.lora}' if args.lora else ''} ({when})\n"
            f"# fit: {'; '.join(summary(k) for k in kinds)}\n"
            + yaml.safe_dump(cal.instance_entry(), sort_keys=False,
                             default_flow_style=None))
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise error(f"{args.out}: cannot write: {e.strerror or e}") from None
        print(f"duetime calibrate: wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``calibrate`` on the ``duetime`` parser tree."""
    p = command("calibrate", lambda a: _cmd_calibrate(a, error),
                "fit a batch-time model to a running vLLM (or emulated) instance",
                "Probe an otherwise idle OpenAI-compatible server (vLLM, or `duetime emulate`) "
                "with lone prompts of several lengths (prefill) and batches of concurrent "
                "streams (decode), fit a batch-time model (the SFS paper's paper4 by default) plus "
                "a per-request overhead, measure the API server's CPU per request and per chunk "
                "where /metrics has its process CPU counter, and print the pool YAML keys of "
                "that instance (batch_time, config, request_overhead_ms, frontend) with the "
                "fit's error. The scheduler limits must be those "
                "the server runs with (vLLM does not publish them); block size and KV blocks are "
                "read from vLLM's vllm:cache_config_info unless given. Takes seconds to minutes.")
    p.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8001")
    p.add_argument("--model", required=True, metavar="NAME", help="the served model name")
    p.add_argument("--max-num-batched-tokens", type=positive_int, required=True, metavar="N",
                   help="the server's --max-num-batched-tokens")
    p.add_argument("--max-num-seqs", type=positive_int, required=True, metavar="N",
                   help="the server's --max-num-seqs")
    p.add_argument("--max-model-len", type=positive_int, required=True, metavar="N",
                   help="the server's --max-model-len")
    p.add_argument("--block-size", type=positive_int, default=None, metavar="N",
                   help="KV block size (default: from vllm:cache_config_info)")
    p.add_argument("--num-gpu-blocks", type=positive_int, default=None, metavar="N",
                   help="KV blocks (default: from vllm:cache_config_info)")
    p.add_argument("--reps", type=positive_int, default=3, metavar="N",
                   help="repetitions of each probe (default 3)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="prompt seed (default 0)")
    p.add_argument("--batch-model", choices=("paper4", "sfs6"), default="paper4",
                   help="the batch-time model to fit: the SFS paper's eq. 11 (paper4, "
                   "default) or the released SFS code's six terms (sfs6)")
    p.add_argument("--lora", default=None, metavar="ADAPTER",
                   help="an adapter the server serves (vLLM --enable-lora): the probes are "
                   "repeated on it and the LoRA terms fitted (what a step holding a LoRA "
                   "request costs more)")
    p.add_argument("--max-loras", type=count, default=None, metavar="N",
                   help="the server's --max-loras, written to the config (default: 1, vLLM's, "
                   "with --lora, else 0: LoRA off)")
    p.add_argument("--out", default=None, metavar="FILE", help="write the YAML here")


def _load_profile_arg(value: str, model: str, error: type[Exception]) -> Any:
    """``--profile``: a built-in profile name, or a YAML file with a pool instance entry's
    ``batch_time`` / ``config`` / ``request_overhead_ms`` (what ``duetime calibrate --out``
    writes), or a ``profile:`` name with overrides."""
    from dataclasses import replace
    from pathlib import Path

    import yaml

    from duetime.engine.frontend import FrontendModel
    from duetime.engine.spec import resolve_spec

    path = Path(value)
    if not path.is_file():
        try:
            return resolve_spec(model, profile=value, where="--profile")
        except ValueError as e:
            raise error(str(e)) from None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise error(f"{value}: cannot read a profile YAML ({' '.join(str(e).split())})"
                    ) from None
    if not isinstance(data, dict):
        raise error(f"{value}: must be a mapping (batch_time, config, request_overhead_ms)")
    try:
        spec = resolve_spec(model, profile=data.get("profile"), batch_time=data.get(
            "batch_time"), config=data.get("config"), where=value)
        overhead = float(data.get("request_overhead_ms", 0.0))
        frontend = (None if data.get("frontend") is None else
                    FrontendModel.from_dict(data["frontend"], f"{value}: frontend"))
    except (TypeError, ValueError) as e:
        raise error(str(e)) from None
    return replace(spec, request_overhead_s=overhead / 1000.0, frontend=frontend)


def _cmd_validate(args: argparse.Namespace, error: type[Exception]) -> int:
    import math
    import sys
    from dataclasses import replace
    from pathlib import Path

    import aiohttp

    from duetime.calibrate.endpoint import instance_session
    from duetime.calibrate.validation import (
        ARRIVALS,
        Client,
        Mix,
        ValidationError,
        measure_capacity,
        replay,
        replay_means,
        run_trace,
        server_delta,
        server_stats,
        trace,
    )
    from duetime.calibrate.validation_report import summarize, write

    if not args.url.startswith(("http://", "https://")):
        raise error(f"URL must be an http(s) URL, got {args.url!r}")
    spec = _load_profile_arg(args.profile, args.model, error)
    if args.speed != 1.0:
        spec = spec.scaled(args.speed)
    arrivals = ARRIVALS if args.arrivals == "both" else (args.arrivals,)
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        raise error(f"--loads: a comma-separated list of fractions, got {args.loads!r}"
                    ) from None
    if not loads or any(not 0 < x <= 2 for x in loads):
        raise error(f"--loads: fractions of capacity in (0, 2], got {args.loads!r}")
    loras = tuple(dict.fromkeys(x.strip() for x in (args.lora or "").split(",") if x.strip()))
    if args.max_loras is not None:
        spec = replace(spec, config=replace(spec.config, max_loras=args.max_loras))
    if loras and not spec.config.max_loras:
        raise error("--lora: the profile's config has no max_loras (LoRA off): give the "
                    "server's --max-loras")
    if not 0 < args.lora_share <= 1:
        raise error(f"--lora-share: a fraction in (0, 1], got {args.lora_share:g}")
    cfg = spec.config
    max_prompt = min(args.max_prompt, cfg.max_model_len - args.max_output - 1)
    if max_prompt < args.min_prompt:
        raise error(f"--max-prompt: the instance holds at most {cfg.max_model_len} tokens")
    mix = Mix(args.min_prompt, max_prompt, args.min_output, args.max_output, loras,
              args.lora_share)
    clients = args.capacity_clients or min(cfg.max_num_seqs, 64)
    cap_requests = args.capacity_requests or 3 * clients
    say = (lambda m: None) if args.quiet else (lambda m: print(f"duetime validate: {m}",
                                                                file=sys.stderr))

    server_sums: dict[float, dict[str, list[float]]] = {}  # load -> histogram -> [sum, count]

    async def go() -> tuple[float, list]:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with instance_session(timeout) as session:
            client = Client(args.url.rstrip("/"), args.model, session)
            await client.token_ids()
            say(f"measuring capacity ({clients} clients, {cap_requests} requests)")
            cap = await measure_capacity(client, mix, clients, cap_requests, args.seed)
            say(f"capacity {cap:.2f} requests/s")
            recs = []
            for k, load in enumerate(loads):
                for j, arr in enumerate(arrivals):
                    seed = args.seed * 1000 + 10 * k + j
                    run = trace(load, cap, arr, args.requests, mix, seed)
                    say(f"load {load:g} ({load * cap:.2f}/s), {arr}: {len(run)} requests")
                    before = await server_stats(session, client.url)
                    await run_trace(client, run)
                    await asyncio.sleep(args.pause)
                    after = await server_stats(session, client.url)
                    for key, (ds, dc) in server_delta(before, after).items():
                        acc = server_sums.setdefault(load, {}).setdefault(key, [0.0, 0.0])
                        acc[0] += ds
                        acc[1] += dc
                    recs.extend(run)
            return cap, recs

    if args.trace is not None:  # a recorded trace, replayed with this profile
        from duetime.calibrate.validation import read_results
        try:
            recs = read_results(args.trace)
        except OSError as e:
            raise error(f"{args.trace}: cannot read: {e.strerror or e}") from None
        except ValueError as e:
            raise error(str(e)) from None
        loads = sorted({r.load for r in recs})
        arrivals = tuple(sorted({r.arrivals for r in recs}))
        cap = math.nan
    else:
        try:
            cap, recs = asyncio.run(go())
        except ValidationError as e:
            raise error(str(e)) from None
        except OSError as e:
            raise error(f"{args.url}: {e}") from None
    try:
        for arr in arrivals:  # (each run is its own trace: replayed on its own)
            for load in loads:
                replay([r for r in recs if r.load == load and r.arrivals == arr], spec)
    except ValidationError as e:
        raise error(str(e)) from None
    meta = {"url": args.url, "model": args.model, "profile": args.profile,
            "speed": args.speed, "capacity_rps": cap, "capacity_clients": clients,
            "loads": loads, "arrivals": list(arrivals), "requests_per_run": args.requests,
            "seed": args.seed, "mix": {"min_prompt": mix.min_prompt,
                                       "max_prompt": mix.max_prompt,
                                       "min_output": mix.min_output,
                                       "max_output": mix.max_output,
                                       **({"loras": sorted({r.lora for r in recs} - {""}),
                                           "lora_share": mix.lora_share}
                                          if any(r.lora for r in recs) else {})}}
    server = {load: {"server": {k: t / c for k, (t, c) in sums.items() if c > 0},
                     "replay": replay_means([r for r in recs if r.load == load], spec)}
              for load, sums in server_sums.items() if sums}
    summary = summarize(recs, meta, server)
    import shlex
    command = shlex.join([
        "duetime", "validate", args.url, "--model", args.model, "--profile", args.profile,
        "--out", args.out, "--loads", ",".join(f"{x:g}" for x in loads), "--arrivals",
        args.arrivals, "--requests", str(args.requests), "--seed", str(args.seed),
        *(["--speed", f"{args.speed:g}"] if args.speed != 1.0 else []),
        *(["--lora", ",".join(loras), "--lora-share", f"{args.lora_share:g}"] if loras
          else []),
        *(["--max-loras", str(args.max_loras)] if args.max_loras is not None else []),
        *(["--trace", args.trace] if args.trace else [])])
    out = Path(args.out)
    try:
        write(out, recs, summary, command)
    except OSError as e:
        raise error(f"{out}: cannot write: {e.strerror or e}") from None
    print(f"duetime validate: TTFT |error| median {summary['ttft_median_abs_pct_error']:.1%}, "
          f"p90 {summary['ttft_p90_abs_pct_error']:.1%} (with the online correction "
          f"{summary['corrected_ttft_median_abs_pct_error']:.1%}, "
          f"{summary['corrected_ttft_p90_abs_pct_error']:.1%}"
          + (f"; live gateway forecasts {summary['live_ttft_median_abs_pct_error']:.1%}, "
             f"{summary['live_ttft_p90_abs_pct_error']:.1%}"
             if math.isfinite(summary["live_ttft_median_abs_pct_error"]) else "")
          + (f"; on adapters {summary['by_adapter']['lora']['median_abs']:.1%}, on the base "
             f"model {summary['by_adapter']['base']['median_abs']:.1%}"
             if "by_adapter" in summary else "")
          + f"); ITL |error| median {summary['itl_median_abs_pct_error']:.1%} (with the "
          f"step-time correction {summary['step_itl_median_abs_pct_error']:.1%}) over "
          f"{summary['requests']} "
          f"requests ({summary['failed']} failed); wrote {out}/report.md")
    return 0


def add_validate_command(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``validate`` on the ``duetime`` parser tree."""
    p = command("validate", lambda a: _cmd_validate(a, error),
                "measure how closely the engine model predicts a running server",
                "Drive one OpenAI-compatible server directly with a seeded "
                "workload at several loads (fractions of its capacity, measured first with a "
                "closed loop), record every request's timeline, replay the same trace through "
                "the engine with the instance's profile, and report the TTFT and end-to-end "
                "errors per load (and each request's inter-token latency, with and without "
                "the gateway's online step-time correction, and vLLM's own "
                "engine-side histograms where it exports them): report.md, results.csv, "
                "summary.json and PNGs in --out. Pointed at a `duetime serve`, the gateway's "
                "live forecasts are scored too. Token-id prompts on /v1/completions, streamed, "
                "ignore_eos.")
    p.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8001")
    p.add_argument("--model", required=True, metavar="NAME", help="the served model name")
    p.add_argument("--profile", required=True, metavar="NAME_OR_FILE",
                   help="a built-in engine profile, or a YAML file with batch_time, config "
                   "and request_overhead_ms (what `duetime calibrate --out` writes)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the report")
    p.add_argument("--loads", default="0.25,0.5,0.75", metavar="F,F,...",
                   help="loads as fractions of the measured capacity (default 0.25,0.5,0.75)")
    p.add_argument("--arrivals", choices=("poisson", "bursty", "both"), default="poisson",
                   help="arrival process (bursty: a two-state MMPP, same mean; default "
                   "poisson)")
    p.add_argument("--requests", type=positive_int, default=100, metavar="N",
                   help="requests per load and arrival process (default 100)")
    p.add_argument("--min-prompt", type=positive_int, default=16, metavar="N")
    p.add_argument("--max-prompt", type=positive_int, default=1500, metavar="N")
    p.add_argument("--min-output", type=positive_int, default=8, metavar="N")
    p.add_argument("--max-output", type=positive_int, default=128, metavar="N")
    p.add_argument("--capacity-clients", type=positive_int, default=None, metavar="N",
                   help="closed-loop clients of the capacity run (default: the profile's "
                   "max_num_seqs, at most 64)")
    p.add_argument("--capacity-requests", type=positive_int, default=None, metavar="N",
                   help="requests of the capacity run (default: 3 per client)")
    p.add_argument("--speed", type=float, default=1.0, metavar="X",
                   help="the server runs this many times faster than the profile (an "
                   "emulator's --speed)")
    p.add_argument("--pause", type=float, default=1.0, metavar="S",
                   help="idle seconds between runs (default 1)")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seeds the trace: lengths and arrival times (default 0; the prompts' "
                   "token ids are fresh each run, so a prefix cache holds none of them)")
    p.add_argument("--trace", default=None, metavar="CSV",
                   help="replay the requests of an earlier run's results.csv with --profile "
                   "instead of driving the server (URL is then only reported)")
    p.add_argument("--lora", default=None, metavar="A,B,...",
                   help="LoRA adapters the server serves: --lora-share of the requests go to "
                   "one of them (drawn uniformly), replayed with the profile's max_loras and "
                   "LoRA terms (`duetime calibrate --lora`); the report gives the error on "
                   "adapters and on the base model")
    p.add_argument("--lora-share", type=float, default=0.5, metavar="F",
                   help="the fraction of requests on adapters (default 0.5)")
    p.add_argument("--max-loras", type=count, default=None, metavar="N",
                   help="the server's --max-loras (default: the profile's config)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
