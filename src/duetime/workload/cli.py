"""``duetime workload kv-lookup`` (the LAAR paper's KV-lookup queries as JSONL) and
``duetime predict synth`` (a synthetic judged data set drawn from a workload profile)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from duetime.argtypes import positive_int
from duetime.workload.kvlookup import FRAMES, estimate_tokens, generate, tokenizer_counter


def _cmd_kv_lookup(args: argparse.Namespace, error: type[Exception]) -> int:
    contexts = tuple(int(c) for c in args.contexts.split(","))
    languages = tuple(args.languages.split(","))
    bad = [lang for lang in languages if lang not in FRAMES]
    if bad or any(c < 64 for c in contexts) or args.n < 2:
        raise error(f"--languages from {', '.join(FRAMES)}; --contexts >= 64 tokens each; "
                    "--n >= 2")
    count = estimate_tokens
    if args.tokenizer:
        try:
            count = tokenizer_counter(args.tokenizer)
        except Exception as e:  # the tokenizers package's errors are not typed
            raise error(f"{args.tokenizer}: cannot load a tokenizer.json ({e})") from None
    queries = generate(args.n, contexts, languages, args.seed, count)
    with Path(args.out).open("w") as f:
        for q in queries:
            f.write(json.dumps(q.to_dict(), ensure_ascii=False) + "\n")
    print(f"wrote {len(queries)} queries ({args.n} per context x language; half fit, half "
          f"eval) to {args.out}", file=sys.stderr)
    return 0


def _cmd_synth(args: argparse.Namespace, error: type[Exception]) -> int:
    from duetime.workload.profile import ProfileError
    from duetime.workload.synth import write_synth

    try:
        n = write_synth(args.out, args.n, args.seed, args.workload)
    except ProfileError as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"{args.out}: cannot write: {e.strerror or e}") from None
    print(f"wrote {n} SYNTHETIC rows ({args.n} prompts x {n // args.n} models, workload "
          f"{args.workload}, seed {args.seed}) to {args.out}")
    return 0


def add_synth_command(predict_sub: Any, command: Any, error: type[Exception]) -> None:
    """Register ``synth`` in the ``predict`` group (``predict_sub``: its subparsers)."""
    p = command("synth", lambda a: _cmd_synth(a, error), "write a synthetic judged data set",
                "Write a SYNTHETIC judged data set (JSONL; every row has \"synthetic\": true): "
                "prompts per task of a workload profile (default paper: the SFS paper's four "
                "tasks and three Qwen3 models, with its prompt and output lengths), some in "
                "Chinese, Japanese or Korean, judged by a known generator whose quality depends "
                "on the prompt's content and length. For tests and demos, not for claims about "
                "real models.", into=predict_sub)
    p.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    p.add_argument("--n", type=positive_int, default=2000, metavar="N",
                   help="number of prompts (one row per prompt and model; default 2000)")
    p.add_argument("--workload", default="paper", metavar="NAME|FILE",
                   help="workload profile: a built-in name or a YAML file (default paper)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")


def add_commands(sub: Any, command: Any, error: type[Exception]) -> None:
    p = command("workload", None, "make workloads", "Make workloads (see the subcommands).")
    wsub = p.add_subparsers(dest="workload_command", metavar="SUBCOMMAND", required=True)
    p = command("kv-lookup", lambda a: _cmd_kv_lookup(a, error),
                "write the LAAR paper's KV-lookup queries (JSONL)",
                "Write long-context KV-lookup queries: 'JSON data: ' + a JSON object of random "
                "UUID -> UUID pairs sized to each context length, then the question for one key, "
                "framed in English, Japanese or Chinese. Each JSONL row has id, task, language, "
                "context_tokens, prompt, prompt_tokens, key, answer (correct = the answer "
                "appears in the reply) and split (fit / eval). Token counts use --tokenizer if "
                "given, else an estimate of 1.7 characters per token.", into=wsub)
    p.add_argument("--out", required=True, metavar="FILE", help="output JSONL file")
    p.add_argument("--n", type=int, default=100, help="queries per context x language")
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536",
                   help="context lengths in tokens, comma-separated")
    p.add_argument("--languages", default="en,ja,zh", help="languages, comma-separated")
    p.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                   help="count tokens with this HuggingFace tokenizer.json")
    p.add_argument("--seed", type=int, default=0)
