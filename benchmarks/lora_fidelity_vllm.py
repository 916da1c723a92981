"""How closely the calibrated replay predicts a real vLLM serving LoRA adapters: the TTFT error
of ``duetime validate`` with adapters in the mix, with the fitted LoRA terms and without them.

    python benchmarks/lora_fidelity_vllm.py [--model tiny-large] [--loads 0.25,0.5,0.75]
        [--requests 40] [--share 0.5] [--max-loras 2] [--adapters 3] [--seed 0] [--out DIR]

Starts one of the e2e suite's tiny vLLM servers (``tests/e2e/conftest.py``'s flags, its engine
on core 0, this process and the API process off it) with ``--enable-lora --max-loras N`` and
tiny random adapters (``scripts/vllm_cpu/make_tiny_lora.py``, rank 8), then, as an operator
would:

1. ``duetime calibrate --lora a1 --max-loras N``: the base model and the LoRA terms fitted;
2. ``duetime validate --lora a1,a2,... --lora-share S`` at each load (fractions of the capacity
   it measures first): the TTFT error on the base model's requests and on the adapters';
3. the same trace replayed (``--trace``) with the calibrated profile's LoRA terms removed: what
   pricing LoRA steps is worth.

Prints the fitted terms and a table per load (medians of |predicted / observed - 1|, and the
adapters' median signed error, the bias). Takes 5-10 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANK = 8


def _pct(x: float) -> str:
    return f"{x:.1%}" if x == x else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-large", choices=("tiny-large", "tiny-small"))
    ap.add_argument("--loads", default="0.25,0.5,0.75")
    ap.add_argument("--requests", type=int, default=40, help="requests per load")
    ap.add_argument("--share", type=float, default=0.5, help="share of requests on adapters")
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the reports here")
    args = ap.parse_args()

    from benchmarks.lora_cost_vllm import make_adapters
    from tests.e2e import conftest as fx

    from duetime.cli import main as duetime

    python = fx.find_vllm_python()
    if python is None or not python.exists():
        raise SystemExit(f"lora_fidelity_vllm: no vLLM venv ({fx.SETUP_HINT})")
    model_dir = fx._build_models(python, REPO / ".cache" / "vllm-models")[args.model]
    paths = make_adapters(python, model_dir, args.adapters)
    names = [f"a{i + 1}" for i in range(args.adapters)]
    flags = ("--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(RANK),
             "--lora-modules", *(f"{n}={p}" for n, p in zip(names, paths, strict=True)))
    out = args.out or Path(tempfile.mkdtemp(prefix="lora-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with fx.one_server(args.model, "lora_fidelity_vllm", flags) as server, \
            fx.off_core(server.engine_core, [server.pid]):
        profile = out / "profile.yaml"
        rc = duetime(["calibrate", server.base_url, "--model", server.name,
                      "--max-num-batched-tokens", str(server.max_num_batched_tokens),
                      "--max-num-seqs", str(server.max_num_seqs),
                      "--max-model-len", str(server.max_model_len),
                      "--lora", names[0], "--max-loras", str(args.max_loras),
                      "--out", str(profile)])
        if rc != 0:
            raise SystemExit("lora_fidelity_vllm: calibrate failed")
        rc = duetime(["validate", server.base_url, "--model", server.name, "--profile",
                      str(profile), "--out", str(out / "lora"), "--loads", args.loads,
                      "--requests", str(args.requests), "--max-prompt", "1024",
                      "--max-output", "64", "--pause", "0.5", "--seed", str(args.seed),
                      "--lora", ",".join(names), "--lora-share", str(args.share),
                      "--quiet"])
        if rc != 0:
            raise SystemExit("lora_fidelity_vllm: validate failed")
    entry = yaml.safe_load(profile.read_text())
    plain = out / "profile-without-lora.yaml"
    coeffs = entry["batch_time"]["coefficients"]
    without = {**entry, "batch_time": {**entry["batch_time"], "coefficients": {
        k: v for k, v in coeffs.items() if not k.startswith("lora_")}}}
    plain.write_text(yaml.safe_dump(without, sort_keys=False))
    rc = duetime(["validate", "http://replayed", "--model", args.model, "--profile", str(plain),
                  "--out", str(out / "plain"), "--trace", str(out / "lora" / "results.csv"),
                  "--quiet"])
    if rc != 0:
        raise SystemExit("lora_fidelity_vllm: the replay without LoRA terms failed")
    got = json.loads((out / "lora" / "summary.json").read_text())
    bare = json.loads((out / "plain" / "summary.json").read_text())
    lora_terms = {k: v for k, v in coeffs.items() if k.startswith("lora_")}
    print(f"\n{args.model} --enable-lora --max-loras {args.max_loras}, adapters "
          f"{', '.join(names)} ({args.share:.0%} of the requests), {args.requests} requests per "
          f"load, capacity {got['capacity_rps']:.2f}/s; fitted LoRA terms (s): {lora_terms}; "
          f"{time.monotonic() - t0:.0f} s; reports in {out}\n")
    print("| load | all TTFT p50 | base p50 | adapters p50 | adapters p90 | adapters bias | "
          "adapters p50 without LoRA terms | bias without |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [*((k, v, bare["per_load"][k]) for k, v in got["per_load"].items()),
            ("all", got, bare)]
    for load, row, b in rows:
        a, lo = row["by_adapter"], b["by_adapter"]["lora"]
        print(f"| {load} | {_pct(row['ttft_median_abs_pct_error'])} | "
              f"{_pct(a['base']['median_abs'])} | {_pct(a['lora']['median_abs'])} | "
              f"{_pct(a['lora']['p90_abs'])} | {_pct(a['lora']['median'])} | "
              f"{_pct(lo['median_abs'])} | {_pct(lo['median'])} |")
    print(f"\nfailed requests: {got['failed']} of {got['requests']}")


if __name__ == "__main__":
    main()
