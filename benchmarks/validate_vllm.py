"""The fidelity number on a real vLLM: start one of the e2e suite's tiny vLLM servers (CPU
build; ``scripts/vllm_cpu/setup_env.sh``), calibrate it with ``duetime calibrate``'s code, and
run ``duetime validate`` against it with that calibration as the profile.

    python benchmarks/validate_vllm.py [--model tiny-large|tiny-small|tiny-small,tiny-large]
        [--gateway | --via direct,serve,serve-steps,envoy] [--nice N] [--out DIR]
        [-- VALIDATE OPTIONS...]

Everything after ``--`` goes to ``duetime validate`` (default: ``--loads 0.25,0.5,0.75
--requests 100``). The server runs with the e2e fixture's flags (prefix caching and KV events
on; the workload's random prompts share no prefix), its engine on core 0, and the client, the
server's API process and the gateway off that core. With ``--gateway`` the workload goes through a ``duetime
serve`` over that one server (its calibration, the e2e suite's pool settings, the online
correction on; the gateway kept off the engine's core), so the report also has the gateway's
live forecasts. ``--via`` runs the workload once per front, in turn, on the same server and
calibration: ``direct``, ``serve`` (as ``--gateway``), ``serve-steps`` (the same with the
online step-time correction, ``state.step_correction``) and ``envoy`` (a real Envoy,
docs/envoy/envoy-epp.yaml, in front of ``duetime epp`` over the same pool: the picker's live
forecasts), then compares the live forecasts' errors. ``--nice N`` runs the vLLM server N
steps of CPU priority below the client and the gateway: on a machine whose cores the server
saturates (this 2-core one) the client otherwise reads streams late and the TTFTs it stamps
are its own starvation. Prints the reports' tables and where it
wrote them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-large", metavar="MODELS",
                    help="tiny-large (default), tiny-small, or both comma-separated (one "
                    "after the other, each in its own sub-folder of --out)")
    ap.add_argument("--gateway", action="store_true",
                    help="drive the server through a duetime gateway (live forecasts)")
    ap.add_argument("--via", default=None, metavar="FRONTS",
                    help="comma-separated fronts to drive it through, one run each: direct, "
                    "serve (= --gateway), serve-steps (serve with state.step_correction), "
                    "envoy (Envoy and duetime epp)")
    ap.add_argument("--out", default=None, help="report folder (default: a temporary one "
                    "under .cache)")
    ap.add_argument("--nice", type=int, default=0, metavar="N",
                    help="run the vLLM server N steps of CPU priority below the client and the "
                    "gateway (0: as today)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- duetime validate options")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"] or ["--loads", "0.25,0.5,0.75",
                                                   "--requests", "100"]

    fronts = (args.via or ("serve" if args.gateway else "direct")).split(",")
    bad = [f for f in fronts if f not in ("direct", "serve", "serve-steps", "envoy")]
    if bad:
        raise SystemExit(f"validate_vllm: --via: unknown front(s) {bad}")
    models = args.model.split(",")
    unknown = [m for m in models if m not in ("tiny-large", "tiny-small")]
    if unknown or not models:
        raise SystemExit(f"validate_vllm: --model: unknown model(s) {unknown}; expected "
                         "tiny-large, tiny-small")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(
        prefix=f"{'+'.join(models)}-", dir=REPO / ".cache"))
    for model in models:
        if len(models) > 1:
            print(f"\n## {model}")
        validate(model, fronts, rest, base / model if len(models) > 1 else base, args.nice)


def validate(model: str, fronts: list[str], rest: list[str], out: Path, nice: int) -> None:
    """Start ``model``'s server, calibrate it, and run ``duetime validate`` through each front
    in turn; print the reports' tables."""
    from tests.e2e import conftest as fx
    from tests.e2e.gateway_pool import instance_config, pool_config, serve

    out.mkdir(parents=True, exist_ok=True)
    live: dict[str, tuple[float, float]] = {}
    with fx.one_server(model, "validate_vllm") as described, \
            contextlib.ExitStack() as stack:
        if nice:
            import os
            os.setpriority(os.PRIO_PGRP, os.getpgid(described.pid), nice)
        server = fx._calibrate(described)
        profile = out / "profile.yaml"
        profile.write_text(yaml.safe_dump(server.calibration, sort_keys=False))
        # the client, the gateway (their processes inherit it) and the server's API process
        # kept off the engine's core
        stack.enter_context(fx.off_core(server.engine_core, [server.pid]))
        cfg = pool_config([server], instances=[instance_config(server)])
        for front in fronts:
            report = out / (f"report-{front}" if len(fronts) > 1 else "report")
            with contextlib.ExitStack() as running:
                url = server.base_url
                if front == "serve":
                    _, url = running.enter_context(serve(cfg, out))
                elif front == "serve-steps":  # (with the online step-time correction)
                    _, url = running.enter_context(serve(
                        {**cfg, "state": {**cfg.get("state", {}), "step_correction": True}},
                        out))
                elif front == "envoy":
                    url = running.enter_context(envoy_and_picker(cfg, out))
                cmd = [sys.executable, "-m", "duetime", "validate", url, "--model",
                       model, "--profile", str(profile), "--out", str(report), *rest]
                print(f"validate_vllm ({front}): " + " ".join(cmd[2:]), file=sys.stderr)
                if subprocess.call(cmd) != 0:
                    raise SystemExit(f"validate_vllm: the {front} run failed")
            summary = json.loads((report / "summary.json").read_text())
            live[front] = (summary["live_ttft_median_abs_pct_error"],
                           summary["live_ttft_p90_abs_pct_error"])
            text = (report / "report.md").read_text()
            print(f"\n{front}:")
            print("\n".join(line for line in text.splitlines() if line.startswith("|")))
            print(f"validate_vllm: wrote {report}")
    if "serve" in live and "serve-steps" in live:
        (s50, s90), (c50, c90) = live["serve"], live["serve-steps"]
        print(f"\nlive TTFT forecasts, |error| median / p90: duetime serve {s50:.1%} / "
              f"{s90:.1%}; with the step correction {c50:.1%} / {c90:.1%}")
    if "serve" in live and "envoy" in live:
        (s50, s90), (e50, e90) = live["serve"], live["envoy"]
        print(f"\nlive TTFT forecasts, |error| median / p90: duetime serve {s50:.1%} / "
              f"{s90:.1%}; Envoy + duetime epp {e50:.1%} / {e90:.1%} "
              f"(ratio {e50 / s50:.2f} / {e90 / s90:.2f})")


@contextlib.contextmanager
def envoy_and_picker(cfg: dict, folder: Path):
    """``duetime epp`` over the pool ``cfg`` and a real Envoy in front of it (the test
    extra's ``envoy``): yields Envoy's URL."""
    import socket
    import threading
    import time
    import urllib.request
    from string import Template

    def free_port() -> int:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return sk.getsockname()[1]

    path = folder / "pool-epp.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    epp = subprocess.Popen([sys.executable, "-m", "duetime", "epp", "--config", str(path),
                            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                            "--log-level", "warning"], stdout=subprocess.PIPE, text=True,
                           stdin=subprocess.DEVNULL)
    envoy = None
    try:
        assert epp.stdout is not None
        port = next((int(m.group(1)) for line in epp.stdout
                     if (m := re.search(r"ext_proc on \S+:(\d+)", line))), None)
        if port is None:
            raise SystemExit("validate_vllm: duetime epp did not start")
        threading.Thread(target=epp.stdout.read, daemon=True).start()  # (never a full pipe)
        listen, admin = free_port(), free_port()
        conf = folder / "envoy.yaml"
        conf.write_text(Template((REPO / "docs" / "envoy" / "envoy-epp.yaml").read_text())
                        .substitute(LISTEN_HOST="127.0.0.1", LISTEN_PORT=listen,
                                    ADMIN_PORT=admin, EPP_HOST="127.0.0.1", EPP_PORT=port,
                                    FAILURE_MODE_ALLOW="false"))
        envoy = subprocess.Popen([str(Path(sys.executable).parent / "envoy"), "-c", str(conf),
                                  "--log-level", "error", "--base-id", str(admin)],
                                 stdout=subprocess.DEVNULL)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{admin}/ready", timeout=1):
                break
            time.sleep(0.1)
        else:
            raise SystemExit("validate_vllm: envoy did not start")
        yield f"http://127.0.0.1:{listen}"
    finally:
        for proc in (envoy, epp):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
