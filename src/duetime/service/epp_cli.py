"""``duetime epp``: run the endpoint picker for the Gateway API Inference Extension."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from duetime.argtypes import key_value, port

GRACE_S = 5.0  # open Envoy streams get this long to finish on SIGTERM


async def _epp(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.service import ConfigError, load_pool
    from duetime.service.cli import config_watch, with_cli_options
    from duetime.service.epp import PickerService
    from duetime.web.server import ServeError, shutdown_signals

    started = time.perf_counter()
    try:
        pool = load_pool(args.config)
    except ConfigError as e:
        raise error(str(e)) from None
    pool = with_cli_options(pool, args, error)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise error("--tls-cert and --tls-key go together")
        try:
            tls = (Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes())
        except OSError as e:
            raise error(f"cannot read the TLS files: {e}") from None
    try:
        svc = PickerService(pool, host=args.host, port=args.port,
                            metrics_port=args.metrics_port or None, tls=tls,
                            fallbacks=args.fallbacks)
    except ConfigError as e:
        raise error(str(e)) from None
    stop = asyncio.Event()
    with shutdown_signals(stop.set, stop.set):
        try:
            await svc.start()
        except (ServeError, RuntimeError, OSError) as e:
            raise error(f"cannot start the picker: {e}") from None
        print(f"duetime epp: ext_proc on {args.host}:{svc.port} (policy {svc.pool.policy}, "
              f"{len(svc.pool.instances)} instances; ready in "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
        assert svc.picker is not None
        for inst in svc.pool.instances:
            print(f"  {inst.name:<12} model {inst.model:<12} endpoint "
                  f"{svc.picker.endpoints.by_name.get(inst.name, '(unresolved)')}", flush=True)
        if svc.metrics_server is not None:
            print(f"  metrics: {svc.metrics_server.url}/metrics", flush=True)
        watch = config_watch(args, svc.pool, svc.gateway, svc.instances.reload)
        await stop.wait()
        await watch.stop()
        await svc.stop(GRACE_S)
    print("duetime epp: stopped", flush=True)
    return 0


def _cmd_epp(args: argparse.Namespace, error: type[Exception]) -> int:
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc  # noqa: F401
    except ImportError:
        print("duetime epp: needs grpcio and xds-protos: pip install 'duetime[epp]'",
              file=sys.stderr)
        return 2
    from duetime.web.logs import setup_logging

    setup_logging(args.log_level)
    return asyncio.run(_epp(args, error))  # (grpc.aio runs on asyncio's own loop)


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``epp`` on the ``duetime`` parser tree."""
    p = command("epp", lambda a: _cmd_epp(a, error),
                "run the endpoint picker (Envoy ext_proc) for a Gateway API InferencePool",
                "Serve Envoy's external-processing gRPC service as the endpoint picker of the "
                "Gateway API Inference Extension: each request is routed with the pool "
                "config's policy over the same live state as `duetime serve`, and the chosen "
                "instance's ip:port is returned in the x-gateway-destination-endpoint header "
                "and the envoy.lb metadata. Health: grpc.health.v1 (liveness, readiness). "
                "See docs/kubernetes.md.")
    p.add_argument("--config", required=True, metavar="POOL.yaml",
                   help="the pool config (as duetime serve's): each instance a pod of the "
                   "InferencePool (a url: an IP, or a DNS name looked up every 10 s), or a "
                   "group (discover: dns, or kubernetes: the pool's ready pods, watched); "
                   "re-read when it changes and on SIGHUP")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=port, default=9002, metavar="P",
                   help="ext_proc gRPC port (default 9002, the extension's; 0 = any free port)")
    p.add_argument("--metrics-port", type=port, default=9090, metavar="P",
                   help="HTTP port of /metrics, /health and /duetime/instances (default 9090; "
                   "0 = none)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="share live state with other pickers and gateway replicas through "
                   "Redis (redis://host:port/db; overrides the config's state.store; `memory`: "
                   "this process only)")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help="override the config's policy (`duetime policies` lists them)")
    p.add_argument("--policy-param", type=key_value, action="append", default=None,
                   metavar="NAME=VALUE", help="a parameter of the policy (repeatable)")
    p.add_argument("--fallbacks", type=int, choices=range(0, 9), default=0, metavar="N",
                   help="after the chosen endpoint, up to N more serving the same model, in "
                   "the order the policy ranks them, as the protocol's comma-separated list "
                   "(for a data plane that tries them in order; default 0: one endpoint)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve gRPC over TLS with this certificate chain (with --tls-key)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the TLS private key")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="log level (default info)")
