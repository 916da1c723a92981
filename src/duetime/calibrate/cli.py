"""``duetime calibrate``: fit a running instance's batch-time model (see endpoint.py)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from duetime.argtypes import positive_int


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
        cfg = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              block_size=block, num_gpu_blocks=blocks,
                              long_prefill_token_threshold=0)
        return await calibrate(args.url, args.model, cfg, reps=args.reps, seed=args.seed)

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
        return (f"{kind} {len(errs)} samples, |error| median {statistics.median(errs):.1f}% "
                f"max {max(errs):.1f}%")

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"# duetime calibrate {args.url} --model {args.model} ({when})\n"
            f"# fit: {summary('prefill')}; {summary('decode')}\n"
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
                "streams (decode), fit the SFS paper's paper4 batch-time model plus a per-request "
                "overhead, and print the pool YAML keys of that instance (batch_time, config, "
                "request_overhead_ms) with the fit's error. The scheduler limits must be those "
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
    p.add_argument("--out", default=None, metavar="FILE", help="write the YAML here")

