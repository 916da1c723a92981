"""How much a calibration of a real vLLM moves from one run to the next, and how well each
holds on a loaded trace it never saw: ``paper4`` against ``sfs6`` on the same probes.

    python benchmarks/calibration_spread.py [--model tiny-large|tiny-small]
        [--calibrations 4] [--reps 3] [--loads 0.5,0.75] [--requests 80] [--out DIR]

Starts one of the e2e suite's tiny vLLM servers (CPU build, the fixture's flags, its engine on
core 0), then:

1. calibrates it ``--calibrations`` times in a row with ``duetime calibrate``'s code
   (``--reps`` repetitions of each probe, three as the e2e fixture does), and fits both
   batch-time models to each calibration's own samples (one set of probes, two fits);
2. records one loaded trace with ``duetime validate`` (the first calibration's ``paper4`` as
   its profile; the trace does not depend on it);
3. replays that trace with every fit: the held-out error of each calibration and model.

Prints the coefficients' spread (mean, coefficient of variation, min, max), the fits' own
errors and the held-out TTFT / ITL errors; writes ``spread.json`` and the trace in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = ("paper4", "sfs6")


def held_out(trace_csv: Path, spec: Any) -> dict[str, float]:
    """The trace replayed with ``spec``: pooled TTFT, e2e and ITL errors."""
    from duetime.calibrate.validation import error_stats, errors, read_results, replay

    recs = read_results(str(trace_csv))
    for load in sorted({r.load for r in recs}):
        for arr in sorted({r.arrivals for r in recs}):
            replay([r for r in recs if r.load == load and r.arrivals == arr], spec)
    out = {}
    for what in ("ttft", "e2e", "itl"):
        s = error_stats(errors(recs, what))
        out.update({f"{what}_median_abs": s["median_abs"], f"{what}_p90_abs": s["p90_abs"],
                    f"{what}_bias": s["median"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny-large", "tiny-small"), default="tiny-large")
    ap.add_argument("--calibrations", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions of each probe per calibration (as the e2e fixture and "
                         "duetime calibrate: 3)")
    ap.add_argument("--loads", default="0.5,0.75")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tests.e2e import conftest as fx

    from duetime.calibrate import CalibrationError, calibrate, fit
    from duetime.engine.config import SchedulerConfig
    from duetime.engine.spec import resolve_spec

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(
        prefix=f"spread-{args.model}-", dir=REPO / ".cache"))
    out.mkdir(parents=True, exist_ok=True)
    fits: list[dict[str, Any]] = []
    with fx.one_server(args.model, "calibration_spread") as server:
        cfg = SchedulerConfig(max_num_batched_tokens=server.max_num_batched_tokens,
                              max_num_seqs=server.max_num_seqs,
                              max_model_len=server.max_model_len,
                              block_size=server.block_size,
                              num_gpu_blocks=server.num_gpu_blocks,
                              long_prefill_token_threshold=0)
        for k in range(args.calibrations):
            for attempt in range(fx.CALIBRATION_ATTEMPTS):  # (as the e2e fixture: a busy
                try:                                         # moment fails a probe at times)
                    cal = asyncio.run(calibrate(server.base_url, server.name, cfg,
                                                reps=args.reps, seed=k))
                    break
                except CalibrationError as e:
                    if attempt + 1 == fx.CALIBRATION_ATTEMPTS:
                        raise
                    print(f"calibration {k} failed ({e}); again", file=sys.stderr)
            for name in MODELS:
                c = cal if name == "paper4" else fit(cal.samples, cfg, name)
                fits.append({"calibration": k, "model": name,
                             "coefficients": c.model.coefficients,
                             "overhead_ms": c.request_overhead_s * 1000,
                             "fit_prefill": statistics.median(
                                 abs(e) for e in c.errors("prefill")),
                             "fit_decode": statistics.median(
                                 abs(e) for e in c.errors("decode")),
                             "entry": c.instance_entry()})
                print(f"calibration {k} {name}: {c.model.coefficients}, overhead "
                      f"{c.request_overhead_s * 1000:.2f} ms", file=sys.stderr)
        profile = out / "profile.yaml"
        profile.write_text(yaml.safe_dump(fits[0]["entry"], sort_keys=False))
        cmd = [sys.executable, "-m", "duetime", "validate", server.base_url, "--model",
               server.name, "--profile", str(profile), "--out", str(out / "trace"),
               "--loads", args.loads, "--requests", str(args.requests), "--quiet"]
        print("calibration_spread: " + " ".join(cmd[2:]), file=sys.stderr)
        with fx.off_core(server.engine_core, [server.pid]):  # (the client off the engine's)
            subprocess.run(cmd, check=True)

    trace_csv = out / "trace" / "results.csv"
    for f in fits:
        e = f["entry"]
        spec = resolve_spec(args.model, batch_time=e["batch_time"], config=e["config"],
                            where="fit")
        spec = replace(spec, request_overhead_s=e["request_overhead_ms"] / 1000)
        f["held_out"] = held_out(trace_csv, spec)

    print(f"\n{args.model}: {args.calibrations} calibrations of one server; held-out: the "
          f"trace of `duetime validate --loads {args.loads} --requests {args.requests}`\n")
    print("| model | coefficient | mean | CV | min | max |\n|---|---|---|---|---|---|")
    for name in MODELS:
        rows = [f for f in fits if f["model"] == name]
        for coef in [*rows[0]["coefficients"], "overhead_ms"]:
            v = np.array([f["overhead_ms"] if coef == "overhead_ms" else f["coefficients"][coef]
                          for f in rows])
            cv = v.std() / v.mean() if v.mean() > 0 else float("nan")
            print(f"| {name} | {coef} | {v.mean():.4g} | {cv:.0%} | {v.min():.4g} | "
                  f"{v.max():.4g} |")
    print("\n| calibration | model | fit prefill | fit decode | held-out TTFT p50 | p90 | bias "
          "| ITL p50 | ITL bias | e2e p50 |\n|---|---|---|---|---|---|---|---|---|---|")
    for f in fits:
        h = f["held_out"]
        print(f"| {f['calibration']} | {f['model']} | {f['fit_prefill']:.1%} | "
              f"{f['fit_decode']:.1%} | {h['ttft_median_abs']:.1%} | {h['ttft_p90_abs']:.1%} | "
              f"{h['ttft_bias']:+.1%} | {h['itl_median_abs']:.1%} | {h['itl_bias']:+.1%} | "
              f"{h['e2e_median_abs']:.1%} |")
    (out / "spread.json").write_text(json.dumps(fits, indent=2, default=float) + "\n")
    print(f"\ncalibration_spread: wrote {out}")


if __name__ == "__main__":
    main()
