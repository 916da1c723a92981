"""An experiment's points fanned out: serially, on local processes, and on a local Ray cluster.

Starts a Ray head on loopback with two CPUs (two worker processes take the tasks; its own
temporary folder, stopped after), runs the same experiment (default `load-sweep`, the paper's
13 rates x 7 routers x 16,000 requests) serially, on N local processes and on the Ray cluster,
and prints each run's wall time, its speed-up over the serial run and whether its
`summary.json` and `results.csv` equal the serial run's (less what a clock measured: wall
times, decision times). Side by side in one run, on the same machine.

    python benchmarks/experiment_fanout.py [--experiment load-sweep] [--quick] [--workers 2]
        [--no-ray]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from duetime.experiments.catalog import EXPERIMENTS, run_experiment
from duetime.experiments.fanout import Fanout


def untimed(x):
    """Data less the values a clock measured (they differ between any two runs)."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items()
                if k not in ("wall_s", "realtime_factor") and "decision_us" not in k}
    return [untimed(v) for v in x] if isinstance(x, list) else x


def outputs(out: Path) -> tuple[dict, list[dict]]:
    with open(out / "results.csv") as f:
        rows = [untimed(r) for r in csv.DictReader(f)]
    return untimed(json.loads((out / "summary.json").read_text())), rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_head(cpus: int) -> tuple[str, Path, dict]:
    """Start a head on loopback; its address, temporary folder and environment."""
    ray = Path(sys.executable).parent / "ray"
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="dtray", dir="/tmp"))  # short: unix socket paths
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([str(ray), "start", "--head", "--node-ip-address", "127.0.0.1",
                    "--port", str(port), "--num-cpus", str(cpus), "--include-dashboard",
                    "false", "--disable-usage-stats", "--temp-dir", str(temp)],
                   check=True, env=env, timeout=180, capture_output=True)
    return f"127.0.0.1:{port}", temp, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default="load-sweep", choices=list(EXPERIMENTS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=2, help="local processes and Ray CPUs")
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fanout-bench"))
    runs = [("serial", Fanout(1)), (f"{args.workers} local processes", Fanout(args.workers))]
    head = None
    if not args.no_ray:
        head = ray_head(args.workers)
        runs.append((f"Ray, {args.workers} CPUs", Fanout(ray=head[0])))
    rows = []
    try:
        for k, (label, fanout) in enumerate(runs):
            t0 = time.perf_counter()
            run_experiment(args.experiment, work / str(k), quick=args.quick,
                           log=lambda m: None, fanout=fanout)
            rows.append((label, time.perf_counter() - t0, outputs(work / str(k))))
            print(f"  {label}: {rows[-1][1]:.1f} s", file=sys.stderr, flush=True)
    finally:
        if head is not None:
            import ray

            ray.shutdown()
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], env=head[2],
                           timeout=120, capture_output=True)
            shutil.rmtree(head[1], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    serial_s, serial_out = rows[0][1], rows[0][2]
    print(f"\nexperiment {args.experiment}{' --quick' if args.quick else ''}: "
          f"{len(serial_out[1])} points, {os.cpu_count()} CPUs here\n")
    print(f"| {'run':<22} | wall (s) | vs serial | summary and rows equal serial |")
    print(f"|{'-' * 24}|----------|-----------|-------------------------------|")
    for label, wall, got in rows:
        print(f"| {label:<22} | {wall:8.1f} | {serial_s / wall:8.2f}x | "
              f"{'yes' if got == serial_out else 'NO':<29} |")


if __name__ == "__main__":
    main()
