"""``duetime emulate``: one emulated vLLM instance on a port."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from duetime.argtypes import frontend, port, positive_float, positive_int, profile, unit_rate
from duetime.engine.profiles import profile_names

if TYPE_CHECKING:
    from duetime.emulator.core import Emulator, LoraModule

log = logging.getLogger("duetime.emulator")
ADMIN_TOKEN_ENV = "DUETIME_EMULATOR_ADMIN_TOKEN"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # (app.py's; not imported: keeps --help light)


def _lora_module(text: str) -> LoraModule:
    """``--lora-modules`` item: ``name=path`` or a JSON object (vLLM's two forms)."""
    from duetime.emulator.core import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lora_options(args: argparse.Namespace, error: type[Exception]) -> dict[str, Any]:
    """The emulator's LoRA arguments, checked as vLLM checks its flags (one-line errors)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise error("--lora-modules: needs --enable-lora (as vLLM)")
        return {}
    cpu = args.max_cpu_loras
    if cpu is not None and cpu < args.max_loras:
        raise error(f"--max-cpu-loras: must be >= --max-loras ({args.max_loras}), got {cpu}")
    return {"max_loras": args.max_loras, "max_cpu_loras": cpu,
            "lora_modules": args.lora_modules or ()}


def _emulator(args: argparse.Namespace, error: type[Exception]) -> Emulator:
    """The emulator the arguments describe (a built-in profile's engine)."""
    from duetime.emulator import Emulator, Faults
    from duetime.emulator.core import AdapterError
    from duetime.engine.profiles import load_profile

    try:
        faults = Faults(args.fail_rate, tuple(k.strip() for k in args.fail_kinds.split(",")
                                              if k.strip()))
    except ValueError as e:
        raise error(f"--fail-kinds: {e}") from None
    lora = _lora_options(args, error)
    p = load_profile(args.profile)
    try:
        return Emulator(p.batch_time, p.config, model_name=args.model_name or args.profile,
                        speed=args.speed, seed=args.seed, faults=faults,
                        output_median=args.output_median,
                        enable_prefix_caching=args.enable_prefix_caching,
                        frontend=args.frontend, **lora)
    except AdapterError as e:  # (an adapter name given twice)
        raise error(f"--lora-modules: {e}") from None


async def _serve(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.emulator import create_app
    from duetime.emulator.app import runtime_lora_allowed
    from duetime.web.access import is_loopback
    from duetime.web.server import AppServer, ServeError, shutdown_signals

    emu = _emulator(args, error)
    # control routes: open on loopback, need the token when one is given, closed otherwise
    app = create_app(emu, admin_token=args.admin_token, control_open=is_loopback(args.host),
                     allow_runtime_lora_updating=(args.allow_runtime_lora_updating
                                                  or runtime_lora_allowed()))
    try:
        server = AppServer(app, host=args.host, port=args.port,
                           graceful_timeout_s=args.drain_timeout)
    except ServeError as e:
        raise error(str(e)) from None
    stop = asyncio.Event()
    with shutdown_signals(stop.set, server.force):
        await server.start()
        caching = "on" if emu.caching else "off"
        lora = "" if emu.adapters is None else (
            f", LoRA max {emu.config.max_loras}: {len(emu.adapters)} adapter(s)")
        print(f"duetime emulate: {emu.model_name} (profile {args.profile}, speed "
              f"{args.speed:g}, prefix caching {caching}{lora}) listening on {server.url}",
              flush=True)
        print(f"  try: curl -s {server.url}/v1/completions -H 'content-type: application/json' "
              f"-d '{{\"prompt\": \"hello\", \"max_tokens\": 8}}'", flush=True)
        await stop.wait()
        log.info("shutting down", extra={"fields": {"event": "shutdown"}})
        cut = await server.stop()
    if cut:
        print(f"duetime emulate: stopped; {cut} request(s) still open at the drain timeout "
              "were cut (each told so with an error)", flush=True)
        return 3
    return 0


def _cmd_emulate(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.web.logs import setup_logging
    from duetime.web.server import run

    setup_logging(args.log_level)
    return run(_serve(args, error))


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``emulate`` on the ``duetime`` parser tree."""
    names = profile_names()
    p = command("emulate", lambda a: _cmd_emulate(a, error),
                "run an emulated vLLM instance (OpenAI API, vLLM timing, no GPU)",
                "Serve vLLM's OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
                "/v1/models, /tokenize, /health, /metrics with vLLM's metric names, /snapshot; "
                "LoRA adapters as vLLM's --enable-lora) "
                "from the engine model of a built-in profile, stepped in real time: first "
                "tokens come when the engine's step ends, then one token per step. Outputs "
                "are filler tokens; their length is a seeded log-normal draw, capped by "
                "max_tokens. See docs/gateway.md.")
    p.add_argument("--profile", required=True, type=profile, metavar="NAME",
                   help=f"engine profile: {', '.join(names)}, or MODEL@GPU[xN] for one derived "
                   "on other hardware (duetime profiles --derived)")
    p.add_argument("--port", type=port, default=8100, metavar="P",
                   help="port (default 8100; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--speed", type=positive_float, default=1.0, metavar="X",
                   help="run X times faster than the profile's batch-time model (default 1)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="served model name (default: the profile's name)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of output lengths and failures (default 0)")
    p.add_argument("--output-median", type=positive_float, default=200.0, metavar="N",
                   help="median output length in tokens when max_tokens does not cut it "
                   "(log-normal, sigma 0.6; default 200)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="vLLM's automatic prefix caching: prompts that start alike share "
                   "cached KV blocks (token ids exactly; text 64 characters per 16-token "
                   "block); default on, as in vLLM")
    p.add_argument("--frontend", type=frontend, default=None, metavar="REQ_MS,CHUNK_MS[,N]",
                   help="an API server in front of the engine, as vLLM's: milliseconds of its "
                   "work per request and per output chunk, and N servers (default: none; "
                   "`duetime calibrate` measures a vLLM's)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters as vLLM does: a request whose model names an "
                   "adapter runs on it, at most --max-loras adapters per engine step (others "
                   "wait), adapters listed by /v1/models, vllm:lora_requests_info on /metrics")
    p.add_argument("--max-loras", type=positive_int, default=1, metavar="K",
                   help="most distinct adapters in one step (default 1, as vLLM)")
    p.add_argument("--max-cpu-loras", type=positive_int, default=None, metavar="N",
                   help="vLLM's CPU adapter cache; accepted and recorded, >= --max-loras "
                   "(default --max-loras)")
    p.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend",
                   default=None, metavar="NAME=PATH|JSON",
                   help="adapters loaded at start, ids 1, 2, ... in order: name=path or "
                   "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (the path is "
                   "only recorded; needs --enable-lora)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=False,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                   f"with ${RUNTIME_LORA_ENV}=1 or true, as vLLM)")
    p.add_argument("--fail-rate", type=unit_rate, default=0.0, metavar="F",
                   help="fraction of requests that fail (default 0)")
    p.add_argument("--fail-kinds", default="5xx", metavar="K[,K]",
                   help="failure kinds drawn uniformly: 5xx, timeout, disconnect, break (default 5xx)")
    p.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV) or None,
                   metavar="TOKEN",
                   help="the bearer token its control routes (/emulator/faults, "
                   f"/emulator/speed) need (default: ${ADMIN_TOKEN_ENV}, which ps does not "
                   "show; none: they are open on a loopback --host and closed on any other)")
    p.add_argument("--drain-timeout", type=positive_float, default=None, metavar="S",
                   help="on Ctrl-C wait at most S seconds for in-flight requests (default: "
                   "until they finish; a second Ctrl-C forces); requests still open then are "
                   "cut, each stream ending with a data: {\"error\": ...} event, and the "
                   "exit status is 3")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default info)")
