"""The fidelity number on a real vLLM: start one of the e2e suite's tiny vLLM servers (CPU
build; ``scripts/vllm_cpu/setup_env.sh``), calibrate it with ``duetime calibrate``'s code, and
run ``duetime validate`` against it with that calibration as the profile.

    python benchmarks/validate_vllm.py [--model tiny-large|tiny-small] [--gateway]
        [--out DIR] [-- VALIDATE OPTIONS...]

Everything after ``--`` goes to ``duetime validate`` (default: ``--loads 0.25,0.5,0.75
--requests 100``). The server runs with the e2e fixture's flags (prefix caching and KV events
on; the workload's random prompts share no prefix), its engine on core 0, and the client, the
server's API process and the gateway off that core. With ``--gateway`` the workload goes through a ``duetime
serve`` over that one server (its calibration, the e2e suite's pool settings, the online
correction on; the gateway kept off the engine's core), so the report also has the gateway's
live forecasts. Prints the report's tables and where it wrote them.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny-large", "tiny-small"), default="tiny-large")
    ap.add_argument("--gateway", action="store_true",
                    help="drive the server through a duetime gateway (live forecasts)")
    ap.add_argument("--out", default=None, help="report folder (default: a temporary one "
                    "under .cache)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- duetime validate options")
    args = ap.parse_args()
    rest = [a for a in args.rest if a != "--"] or ["--loads", "0.25,0.5,0.75",
                                                   "--requests", "100"]

    from tests.e2e import conftest as fx
    from tests.e2e.gateway_pool import instance_config, pool_config, serve

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(
        prefix=f"{args.model}-", dir=REPO / ".cache"))
    out.mkdir(parents=True, exist_ok=True)
    with fx.one_server(args.model, "validate_vllm") as described, \
            contextlib.ExitStack() as stack:
        server = fx._calibrate(described)
        profile = out / "profile.yaml"
        profile.write_text(yaml.safe_dump(server.calibration, sort_keys=False))
        # the client, the gateway (their processes inherit it) and the server's API process
        # kept off the engine's core
        stack.enter_context(fx.off_core(server.engine_core, [server.pid]))
        url = server.base_url
        if args.gateway:
            _, url = stack.enter_context(serve(
                pool_config([server], instances=[instance_config(server)]), out))
        cmd = [sys.executable, "-m", "duetime", "validate", url,
               "--model", args.model, "--profile", str(profile), "--out", str(out / "report"),
               *rest]
        print("validate_vllm: " + " ".join(cmd[2:]), file=sys.stderr)
        rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(rc)
    text = (out / "report" / "report.md").read_text()
    print("\n".join(line for line in text.splitlines() if line.startswith("|")))
    print(f"validate_vllm: wrote {out / 'report'}")


if __name__ == "__main__":
    main()
