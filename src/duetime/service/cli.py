"""``duetime serve``: the gateway (with an embedded demo pool when no config is given)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from duetime.argtypes import key_value, port, positive_float, positive_int
from duetime.policy import policy_names

if TYPE_CHECKING:
    from duetime.gateway.config import Pool

log = logging.getLogger("duetime.gateway")

DRAIN_CUT_EXIT = 3  # the exit status when the drain timeout cut requests still open


def _banner(service: Any, started: float) -> None:
    url = service.url
    pool = service.pool
    print(f"duetime serve: gateway listening on {url} (policy {pool.policy}; ready in "
          f"{time.perf_counter() - started:.1f} s)", flush=True)
    for inst in pool.instances:
        kind = "emulated" if inst.emulate is not None else "upstream"
        print(f"  {inst.name:<12} model {inst.model:<12} {kind} {inst.url}", flush=True)
    body = ('{"model": "auto", "messages": [{"role": "user", "content": "Hello!"}], '
            '"max_tokens": 16}')
    print(f"try:\n  curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
          f"-d '{body}'", flush=True)
    print(f"  curl -s {url}/metrics | grep ^duetime_", flush=True)
    print(f"dashboard: {url}/dashboard   playground: {url}/playground   SFS demo: {url}/demo"
          f"    (Ctrl-C to stop)", flush=True)


def with_cli_options(pool: Pool, args: argparse.Namespace, error: type[Exception]) -> Pool:
    """The pool with the command line's ``--store``, ``--policy`` and ``--policy-param``
    applied (``duetime serve`` and ``duetime epp``); a bad one is a one-line ``error``."""
    from duetime.service import ConfigError

    try:
        if args.store is not None:
            pool = pool.with_store(args.store)
    except ConfigError as e:
        raise error(str(e)) from None
    if args.policy or args.policy_param:
        name = args.policy or pool.policy
        params = dict(pool.policy_params) if name == pool.policy else {}
        params.update(dict(args.policy_param or ()))
        try:
            pool = pool.with_policy(name, params)
        except ConfigError as e:
            raise error(str(e).replace(f"{pool.source}: policy.", "--policy-param ")) from None
    return pool


def config_watch(args: argparse.Namespace, pool: Pool, gateway: Any,
                 reload: Callable[[Pool, Any], Awaitable[Any]]) -> Any:
    """The watch of ``--config`` (``duetime serve`` and ``duetime epp``): the file re-read,
    with the command line's options applied again, when it changes and on SIGHUP
    (:mod:`duetime.service.config_watch`); started."""
    from duetime.service import ConfigError
    from duetime.service.config_watch import ConfigWatch
    from duetime.service.pool import pool_from_text

    def load(text: str) -> Pool:
        return with_cli_options(pool_from_text(text, args.config), args, ConfigError)

    watch = ConfigWatch(args.config, load, lambda p: reload(p, gateway),
                        watch_s=pool.discovery.watch_s, metrics=gateway.metrics,
                        shared=gateway.shared.pool_config)
    watch.start()
    return watch


async def _serve(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.service import ConfigError, Service, demo_pool, load_pool
    from duetime.web.server import ServeError, shutdown_signals

    started = time.perf_counter()
    try:
        pool = load_pool(args.config) if args.config else demo_pool(
            speed=args.speed, replicas=args.replicas)
    except ConfigError as e:
        raise error(str(e)) from None
    pool = with_cli_options(pool, args, error)
    try:
        service = Service(pool, host=args.host, port=args.port,
                          drain_timeout_s=args.drain_timeout)
    except ConfigError as e:
        raise error(str(e)) from None
    stop = asyncio.Event()
    with shutdown_signals(stop.set, service.force):
        try:
            await service.start()
        except ServeError as e:
            raise error(str(e)) from None
        _banner(service, started)
        assert service.gateway is not None
        if (warning := service.gateway.auth.warning()) is not None:
            print(f"duetime serve: warning: {warning}", file=sys.stderr, flush=True)
        watch = config_watch(args, service.pool, service.gateway, service.reload) \
            if args.config else None
        await stop.wait()
        log.info("shutting down: draining in-flight requests (Ctrl-C again to force)",
                 extra={"fields": {"event": "shutdown"}})
        if watch is not None:
            await watch.stop()
        cut = await service.stop()
    if cut:
        log.error("drain timeout: requests cut", extra={"fields": {
            "event": "drain_timeout", "cut": cut, "drain_timeout_s": args.drain_timeout}})
        print(f"duetime serve: stopped; {cut} request(s) still open at the drain timeout were "
              "cut (each told so with an error)", flush=True)
        return DRAIN_CUT_EXIT
    print("duetime serve: stopped", flush=True)
    return 0


def _cmd_serve(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.web.logs import setup_logging
    from duetime.web.server import run

    if args.config is not None and args.speed != 1.0:
        raise error("--speed applies to the demo pool only; set emulate.speed per instance in "
                    "the config")
    if args.config is not None and args.replicas != 1:
        raise error("--replicas applies to the demo pool only; set replicas per emulated "
                    "instance in the config")
    setup_logging(args.log_level)
    return run(_serve(args, error))


def _cmd_keys_new(args: argparse.Namespace, error: type[Exception]) -> int:
    """A new key: the secret on stderr (shown once), its keys-file entry on stdout (so that
    ``>> keys.yaml`` appends the entry and not the secret)."""
    from duetime.gateway.keys import key_digest, new_key

    if args.admin and (args.model or args.rpm is not None or args.tpm is not None):
        raise error("--admin: an admin key has no --model, --rpm or --tpm")
    key = new_key()
    entry: dict[str, Any] = {"name": args.name, "sha256": key_digest(key)}
    if not args.admin:
        if args.model:
            entry["models"] = args.model
        if args.rpm is not None:
            entry["rpm"] = args.rpm
        if args.tpm is not None:
            entry["tpm"] = args.tpm
    print(f"duetime keys: the {'admin ' if args.admin else ''}key of {args.name!r} (shown "
          f"once, only its hash is kept):\n{key}", file=sys.stderr, flush=True)
    fields = ", ".join(f"{k}: {json.dumps(v)}" for k, v in entry.items())
    print(f"- {{{fields}}}", flush=True)
    return 0


def _add_keys_command(command: Any, error: type[Exception]) -> None:
    p = command("keys", None, "make API keys for the gateway (auth: in the pool config)",
                "API keys of the gateway: a keys file lists each key's name, its SHA-256 and "
                "its limits (see docs/gateway.md, Keys and limits).")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    p = command("new", lambda a: _cmd_keys_new(a, error), "make a key: the secret once, and its keys-file entry",
                "Make a random key (dt- and 32 random bytes). The key goes to stderr, once; "
                "the entry to add to the keys file (a YAML list) to stdout, e.g. `duetime keys "
                "new --name alice --rpm 60 >> keys.yaml`.", into=keys_sub)
    p.add_argument("--name", required=True, help="the key's name (in logs and metrics)")
    p.add_argument("--model", action="append", default=None, metavar="NAME",
                   help="a model or alias the key may call (repeatable; default all)")
    p.add_argument("--rpm", type=positive_int, default=None, metavar="N",
                   help="requests per minute (default unlimited)")
    p.add_argument("--tpm", type=positive_int, default=None, metavar="N",
                   help="tokens per minute, prompt and output (default unlimited)")
    p.add_argument("--admin", action="store_true",
                   help="an admin key (for auth.admin_keys_file: no models or limits)")


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``serve`` and ``keys`` on the ``duetime`` parser tree."""
    _add_keys_command(command, error)
    p = command("serve", lambda a: _cmd_serve(a, error),
                "run the OpenAI-compatible gateway (a demo pool when no config is given)",
                "Serve one OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, "
                "/v1/models, /health, /metrics) in front of a pool of model instances. "
                "model \"auto\" lets the policy choose; a model name restricts the choice to "
                "its instances. Without --config it starts a demo pool of three emulated "
                "instances (Qwen3 0.6B / 8B / 32B with H100 timing) in-process on loopback. "
                "See docs/gateway.md for the config and the headers.")
    p.add_argument("--config", default=None, metavar="POOL.yaml",
                   help="pool config (default: the embedded demo pool); re-read when it "
                   "changes and on SIGHUP: instances join and drain without a restart")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, metavar="P",
                   help="port (default 8000; 0 = any free port)")
    p.add_argument("--policy", choices=policy_names(), default=None, metavar="NAME",
                   help=f"override the config's policy: {', '.join(policy_names())} "
                   "(`duetime policies` describes them)")
    p.add_argument("--policy-param", type=key_value, action="append", default=None,
                   metavar="NAME=VALUE", help="a parameter of the policy, e.g. delta=2e-6 for "
                   "sfs-soft (repeatable; `duetime policies` lists each policy's)")
    p.add_argument("--speed", type=positive_float, default=1.0, metavar="X",
                   help="demo pool only: emulated instances run X times faster (default 1)")
    p.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                   help="N emulated instances of each model of the demo pool (default 1)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="share live state with the other gateway replicas through Redis "
                   "(redis://host:port/db; overrides the config's state.store; `memory`: "
                   "this process only)")
    p.add_argument("--drain-timeout", type=positive_float, default=30.0, metavar="S",
                   help="on Ctrl-C / SIGTERM wait at most S seconds for in-flight requests "
                   "(default 30; a second Ctrl-C forces); requests still open then are cut, "
                   "each stream ending with a data: {\"error\": ...} event, and the exit "
                   f"status is {DRAIN_CUT_EXIT}")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default info)")

