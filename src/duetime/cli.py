"""The ``duetime`` command (also ``python -m duetime``).

Subcommands: ``forecast`` (TTFT / end-to-end forecast from a snapshot JSON), ``profiles``
(the built-in instance profiles), ``snapshot example`` (a paper-like snapshot to feed
``forecast``), ``demo`` (forecasts on a busy instance for every profile); and, registered by
their packages: ``simulate`` / ``experiment`` (``duetime.experiments.cli``), ``workload``
(``duetime.workload.cli``), ``predict`` (``duetime.predict.cli``), ``emulate``
(``duetime.emulator.cli``), ``serve`` (``duetime.service.cli``) and ``epp``
(``duetime.service.epp_cli``).

Bad input (unreadable file, invalid JSON, invalid snapshot, invalid probe, bad arguments) is
reported as one line ``duetime: error: ...`` on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import duetime
from duetime.argtypes import count, profile
from duetime.engine import (
    ForecastError,
    Snapshot,
    SnapshotError,
    forecast,
    load_profile,
    profile_names,
)
from duetime.engine.profiles import derived_profile_names
from duetime.engine.synthetic import paper_like_snapshot

PROG = "duetime"
EXIT_USAGE = 2
DEMO_PROBES = (16, 512, 2048, 8192, 32768)
DEFAULT_PROFILE = "qwen3-8b"  # whose batch-time model `snapshot example` uses without --profile


class CliError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (raised, so ``main`` can return a code)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")



def _print_json(data: Any, indent: int | None) -> None:
    print(json.dumps(data, indent=indent))


# -- forecast -----------------------------------------------------------------------------------

def read_snapshot(source: str) -> Snapshot:
    """A validated snapshot from a JSON file, or from stdin when ``source`` is ``-``.

    Every failure is a :class:`CliError` whose message starts with the source's name.
    """
    return _read_snapshot(source)[0]


def _read_snapshot(source: str) -> tuple[Snapshot, Any]:
    """The validated snapshot and the raw JSON it came from."""
    name = "<stdin>" if source == "-" else source
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"{name}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CliError(f"{name}: not UTF-8 text (a snapshot is JSON)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{name}: not valid JSON ({e.msg} at line {e.lineno}, "
                       f"column {e.colno})") from None
    try:
        return Snapshot.from_dict(data), data
    except SnapshotError as e:
        raise CliError(f"{name}: {e}") from None


def _request_probe(data: Any, name: str) -> tuple[Any, Any, Any, Any, Any, Any]:
    """(prompt_tokens, predicted_output_tokens, until, trace, block_hashes, lora) of a
    forecast request: a snapshot with ``"probe": {"prompt_tokens", "predicted_output_tokens"?,
    "block_hashes"?, "lora"?}`` and optional ``"until"``, ``"trace"`` (see the snapshot
    format); ``None`` where the JSON says nothing."""
    probe = data.get("probe")
    if probe is None:
        return None, None, data.get("until"), data.get("trace"), None, None
    if not isinstance(probe, dict):
        raise CliError(f"{name}: probe: must be an object with prompt_tokens")
    hashes = probe.get("block_hashes")
    if hashes is not None and not isinstance(hashes, list):
        raise CliError(f"{name}: probe.block_hashes: must be a list of strings or integers")
    return (probe.get("prompt_tokens"), probe.get("predicted_output_tokens"),
            data.get("until"), data.get("trace"), hashes, probe.get("lora"))


def _cmd_forecast(args: argparse.Namespace) -> int:
    snap, data = _read_snapshot(args.snapshot)
    name = "<stdin>" if args.snapshot == "-" else args.snapshot
    prompt, predicted, until, trace, hashes, lora = _request_probe(data, name)
    if args.prompt_hashes is not None:
        try:
            hashes = json.loads(args.prompt_hashes)
        except json.JSONDecodeError as e:
            raise CliError(f"--prompt-hashes: not valid JSON ({e.msg})") from None
        if not isinstance(hashes, list):
            raise CliError("--prompt-hashes: must be a JSON list of strings or integers")
    prompt = args.prompt_tokens if args.prompt_tokens is not None else prompt
    if prompt is None:
        raise CliError("--prompt-tokens is required (or a \"probe\" in the snapshot JSON)")
    if args.predicted_output_tokens is not None:
        predicted = args.predicted_output_tokens
    until = args.until or until or "first_token"
    trace = args.trace or trace is True
    lora = args.lora if args.lora is not None else (lora or 0)
    try:
        result = forecast(snap, prompt, predicted, until=until, trace=trace,
                          prompt_hashes=hashes, lora=lora)
    except ForecastError as e:
        raise CliError(str(e)) from None
    _print_json(result.to_dict(), args.indent)
    return 0


# -- profiles -----------------------------------------------------------------------------------

def _profile_dict(name: str) -> dict[str, Any]:
    try:
        p = load_profile(name)
    except KeyError as e:
        raise CliError(e.args[0]) from None
    except ValueError as e:
        raise CliError(str(e)) from None
    return {"name": p.name, "source": "derived" if p.derived_from else "measured",
            "derived_from": p.derived_from or None, "description": p.description,
            "batch_time": p.batch_time.to_dict(), "config": p.config.to_dict()}


def _pairs(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def _cmd_profiles(args: argparse.Namespace) -> int:
    from duetime.engine.hardware import gpu, gpu_names

    if args.gpus:
        gpus = [gpu(n) for n in gpu_names()]
        if args.json:
            _print_json([{"name": g.name, "description": g.description,
                          "memory_gb": g.memory_gb, "bf16_tflops": g.bf16_tflops,
                          "bandwidth_tbps": g.bandwidth_tbps,
                          "price_per_hour": g.price_per_hour} for g in gpus], args.indent)
            return 0
        print(f"{'gpu':<11} {'memory GB':>9} {'BF16 TFLOPS':>11} {'TB/s':>6} {'USD/h':>6}  "
              "description")
        for g in gpus:
            print(f"{g.name:<11} {g.memory_gb:>9g} {g.bf16_tflops:>11g} {g.bandwidth_tbps:>6g} "
                  f"{g.price_per_hour:>6.3f}  {g.description}")
        print("(sources: src/duetime/engine/profiles/gpus.yaml)")
        return 0
    names = args.names or [*profile_names(), *(derived_profile_names() if args.derived else [])]
    profiles = [_profile_dict(name) for name in names]
    if args.json:
        _print_json(profiles, args.indent)
        return 0
    for i, p in enumerate(profiles):
        if i:
            print()
        bt = p["batch_time"]
        print(f"{p['name']} [{p['source']}]: {p['description']}")
        print(f"  batch time  {bt['model']}: "
              f"{_pairs({k: f'{v:.5g}' for k, v in bt['coefficients'].items()})}")
        print(f"  config      {_pairs(p['config'])}")
    return 0


def _cmd_autoscalers(args: argparse.Namespace) -> int:
    from duetime.autoscale import autoscaler_names, describe_autoscalers
    from duetime.autoscale.registry import autoscaler_class

    if args.json:
        _print_json([{"name": n, "summary": autoscaler_class(n).summary,
                      "params": [{"name": p.name, "type": p.kind.__name__,
                                  "default": p.default, "help": p.help}
                                 for p in autoscaler_class(n).params]}
                     for n in autoscaler_names()], args.indent)
        return 0
    print(describe_autoscalers())
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    from duetime.policy import INPUTS, describe, policy_class, policy_names

    if args.json:
        _print_json([{"name": n, "summary": policy_class(n).summary,
                      "params": [{"name": p.name, "type": p.kind.__name__,
                                  "default": p.default, "help": p.help}
                                 for p in policy_class(n).params],
                      "consumes": sorted(policy_class(n).consumes)}
                     for n in policy_names()], args.indent)
        return 0
    print(describe())
    print("\ninputs a policy may consume:")
    for name, what in INPUTS.items():
        print(f"  {name}: {what}")
    return 0


# -- snapshot example ---------------------------------------------------------------------------

def _paper_like(seed: int, profile_name: str, running: int, waiting: int,
                use_profile_config: bool) -> Snapshot:
    """A busy paper-like snapshot with the profile's batch-time model (and its scheduler config,
    or else paper_like_snapshot's default), validated as ``duetime forecast`` would."""
    profile = load_profile(profile_name)
    snap = paper_like_snapshot(random.Random(seed), profile.batch_time, n_running=running,
                               n_waiting=waiting,
                               config=profile.config if use_profile_config else None)
    try:
        return Snapshot.from_dict(snap.to_dict())
    except SnapshotError as e:
        where = (f"the scheduler config of profile {profile_name!r}" if use_profile_config
                 else "the default scheduler config")
        raise CliError(f"{running} running + {waiting} waiting paper-like requests do not fit "
                       f"{where} ({e}); lower --running or --waiting") from None


def _cmd_snapshot_example(args: argparse.Namespace) -> int:
    snap = _paper_like(args.seed, args.profile or DEFAULT_PROFILE, args.running, args.waiting,
                       use_profile_config=args.profile is not None)
    _print_json(snap.to_dict(), args.indent)
    return 0


# -- demo ---------------------------------------------------------------------------------------

def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain aligned text: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _cmd_demo(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.profile or profile_names()))
    rows: list[list[str]] = []
    started = time.perf_counter()
    for name in names:
        # The same workload (same seed) for every profile, under paper_like_snapshot's default
        # scheduler config, which holds 200 paper-like requests (the profiles' KV caches can't).
        snap = _paper_like(args.seed, name, args.running, args.waiting,
                           use_profile_config=False)
        for i, probe in enumerate(DEMO_PROBES):
            t0 = time.perf_counter_ns()
            try:
                result = forecast(snap, probe)
            except ForecastError as e:
                raise CliError(f"profile {name!r}, probe of {probe} tokens: {e}") from None
            us = (time.perf_counter_ns() - t0) / 1000
            rows.append([name if i == 0 else "", f"{probe}", f"{result.estimate_s * 1e3:.1f}",
                         f"{result.steps}", f"{us:.0f}"])
    elapsed = time.perf_counter() - started
    print("duetime demo: forecast TTFT of a probe request appended to a busy instance")
    print(f"workload: {args.running} running + {args.waiting} waiting requests, paper-like "
          f"lengths (seed {args.seed}), the same for every profile")
    print(f"scheduler: {_pairs(snap.config.to_dict())}")
    print()
    for text in _table(["profile", "probe tokens", "TTFT ms", "steps", "forecast us"], rows):
        print(text)
    print()
    print("steps: scheduler steps replayed up to the probe's first token. The first forecast of "
          "a snapshot")
    print("includes its base replay (kept on the snapshot); later probes reuse it.")
    print(f"{len(rows)} forecasts on {len(names)} profile(s) in {elapsed * 1e3:.0f} ms "
          f"(snapshot building included).")
    return 0


# -- the parser ---------------------------------------------------------------------------------

DESCRIPTION = """\
duetime routes each LLM request to the model instance that gives the best answer
in time: an OpenAI-compatible gateway (serve), an endpoint picker for Envoy and the
Gateway API Inference Extension (epp), emulated vLLM instances (emulate),
TTFT forecasts from instance snapshots (forecast), the cluster simulator and the
papers' experiments (simulate, experiment), and request predictors (predict).
"""

EPILOG = """\
examples:
  duetime demo
  duetime snapshot example > snap.json
  duetime forecast snap.json --prompt-tokens 2048
  duetime forecast snap.json --prompt-tokens 2048 --predicted-output-tokens 300 --until finish
  duetime snapshot example --running 5 --waiting 2 | duetime forecast - --prompt-tokens 512 --trace
  duetime predict synth --out judged.jsonl --n 2000
  duetime predict train --data judged.jsonl --out model-dir
  duetime predict eval --model model-dir --data held-out.jsonl
"""


def _add_indent(p: argparse.ArgumentParser) -> None:
    p.add_argument("--indent", type=count, default=None, metavar="N",
                   help="indent the JSON output by N spaces (default: one line)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=EPILOG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"{PROG} {duetime.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, run: Callable[[argparse.Namespace], int] | None, help_: str,
                description: str, into: Any = sub) -> argparse.ArgumentParser:
        p = into.add_parser(name, help=help_, description=description)
        if run is not None:
            p.set_defaults(run=run)
        return p

    p = command("forecast", _cmd_forecast, "forecast a probe request's TTFT from a snapshot",
                "Append a probe request to the snapshot's waiting queue, replay the scheduler "
                "until its first token (or its finish) and print {\"estimate_s\", \"steps\"} "
                "(plus \"trace\" with --trace) as JSON. estimate_s is measured from the "
                "snapshot's time. The JSON format is described in the README. The JSON may "
                "also be a forecast request: a snapshot with \"probe\": {\"prompt_tokens\": N, "
                "\"predicted_output_tokens\": M} and optionally \"until\" and \"trace\"; "
                "options given here override it.")
    p.add_argument("snapshot", metavar="SNAPSHOT",
                   help="snapshot JSON file, or - to read it from stdin")
    p.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                   help="the probe's prompt length in tokens (required unless the JSON is a "
                   "forecast request with a \"probe\")")
    p.add_argument("--predicted-output-tokens", type=int, default=None, metavar="N",
                   help="the probe's predicted output length (needed for --until finish)")
    p.add_argument("--until", choices=["first_token", "finish"], default=None,
                   help="forecast the first token (TTFT, default) or the finish (end to end)")
    p.add_argument("--trace", action="store_true",
                   help="also list every replayed step (slower: uses the reference loop)")
    p.add_argument("--prompt-hashes", default=None, metavar="JSON",
                   help="with a snapshot of version 2 (prefix caching): the probe's block "
                   "hashes, a JSON list of strings or integers in the form the snapshot's "
                   "requests use (its cached prefix is not computed again)")
    p.add_argument("--lora", type=int, default=None, metavar="ID",
                   help="the probe's LoRA adapter (vLLM's lora_int_id; 0, the default: the "
                   "base model); with config.max_loras (a snapshot of version 3) a step runs "
                   "at most that many adapters, and a waiting request on another one is "
                   "skipped")
    _add_indent(p)

    p = command("profiles", _cmd_profiles, "list the built-in instance profiles",
                "The built-in instance profiles: a batch-time model (coefficients in seconds "
                "per unit) with the scheduler config it was measured under. MODEL@GPU[xN] "
                "names a model on other hardware (N GPUs with tensor parallelism, e.g. "
                "qwen3-32b@l40sx2): the measured profile of that deployment, or one derived "
                "from the model's measured profile (compute terms scaled by FLOPs, memory "
                "terms by bandwidth, the KV cache from memory less weights; labelled "
                "[derived]; docs/simulator.md, \"Derived profiles\").")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="the profiles to show (default: the measured ones)")
    p.add_argument("--derived", action="store_true",
                   help="also each model on each catalogue GPU (the fewest GPUs its weights "
                   "fit), derived")
    p.add_argument("--gpus", action="store_true",
                   help="the GPU catalogue instead: memory, dense BF16 TFLOPS, bandwidth, "
                   "list price per GPU-hour")
    p.add_argument("--json", action="store_true", help="print them as a JSON list")
    _add_indent(p)

    p = command("policies", _cmd_policies, "list the routing policies",
                "The registered routing policies: each one's rule, its parameters (set them "
                "with --policy-param NAME=VALUE, or in a pool config's policy: {name: ..., "
                "NAME: VALUE}) and what it consumes (what the gateway keeps fresh for it and "
                "the simulator gives it).")
    p.add_argument("--json", action="store_true", help="print them as a JSON list")
    _add_indent(p)

    p = command("autoscalers", _cmd_autoscalers, "list the autoscalers",
                "The registered autoscalers: each one's rule and its parameters (set them in a "
                "pool config's autoscale: {autoscaler: NAME, params: {NAME: VALUE}} for the "
                "gateway's desired-replica signal; the simulator's Scaling takes the same).")
    p.add_argument("--json", action="store_true", help="print them as a JSON list")
    _add_indent(p)

    names = profile_names()
    p = command("snapshot", None, "make snapshots", "Make snapshots (see the subcommands).")
    snap_sub = p.add_subparsers(dest="snapshot_command", metavar="SUBCOMMAND", required=True)
    p = command("example", _cmd_snapshot_example, "print a paper-like example snapshot",
                "Print a snapshot of a busy instance with paper-like request lengths (JSON), "
                "to feed `duetime forecast`. Without --profile it uses the "
                f"{DEFAULT_PROFILE} batch-time model and a default scheduler config "
                "(max_num_batched_tokens 8192, max_num_seqs 256, 100000 KV blocks of 16); with "
                "--profile, that profile's model and config (its KV cache may not hold 200 "
                "paper-like requests: lower --running).", into=snap_sub)
    p.add_argument("--profile", type=profile, default=None, metavar="NAME",
                   help=f"a built-in profile: {', '.join(names)}, or MODEL@GPU[xN] (derived)")
    p.add_argument("--running", type=count, default=200, metavar="N",
                   help="running requests (default 200)")
    p.add_argument("--waiting", type=count, default=20, metavar="N",
                   help="waiting requests (default 20)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    _add_indent(p)

    p = command("demo", _cmd_demo, "forecast TTFT on a busy instance for each profile",
                "For each built-in profile (or those named), build a busy paper-like snapshot "
                "(the same workload for all, paper_like_snapshot's default scheduler config, "
                "the profile's batch-time model) and print the forecast TTFT, the replayed "
                f"steps and the time each forecast took, for probes of "
                f"{', '.join(map(str, DEMO_PROBES))} prompt tokens.")
    p.add_argument("--profile", type=profile, action="extend", nargs="+",
                   default=None, metavar="NAME",
                   help=f"only these profiles ({', '.join(names)}, or MODEL@GPU[xN])")
    p.add_argument("--running", type=count, default=200, metavar="N",
                   help="running requests (default 200)")
    p.add_argument("--waiting", type=count, default=20, metavar="N",
                   help="waiting requests (default 20)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")

    from duetime.experiments.cli import add_commands as add_experiment_commands
    from duetime.workload.cli import add_commands as add_workload_commands
    from duetime.workload.cli import add_synth_command
    add_experiment_commands(sub, command, CliError)
    add_workload_commands(sub, command, CliError)
    from duetime.predict.cli import add_commands as add_predict_commands
    add_synth_command(add_predict_commands(sub, command, CliError), command, CliError)
    from duetime.emulator.cli import add_commands as add_emulator_commands
    add_emulator_commands(sub, command, CliError)
    from duetime.service.cli import add_commands as add_gateway_commands
    add_gateway_commands(sub, command, CliError)
    from duetime.service.epp_cli import add_commands as add_epp_commands
    add_epp_commands(sub, command, CliError)
    from duetime.calibrate.cli import add_commands as add_calibrate_commands
    from duetime.calibrate.cli import add_validate_command
    add_calibrate_commands(sub, command, CliError)
    add_validate_command(sub, command, CliError)
    from duetime.plan.cli import add_commands as add_plan_commands
    add_plan_commands(sub, command, CliError)
    return parser


def _fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version
            return e.code if isinstance(e.code, int) else 0
        return args.run(args)
    except CliError as e:
        return _fail(str(e))
    except BrokenPipeError:  # e.g. `duetime snapshot example | head`: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
