"""``duetime predict train | eval``: registered on the main argparse tree (``predict synth``,
which draws from a workload profile, is :mod:`duetime.workload.cli`'s).

Kept light at import (the main CLI imports this for every command): LightGBM, scikit-learn
and the training code load only when a predict command runs. Bad input is raised as the error
class the main CLI passes in (its ``CliError``: one line ``duetime: error: ...``, exit 2); a
malformed data row reads ``FILE:LINE: FIELD: reason``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duetime.argtypes import count, positive_int

Command = Callable[..., argparse.ArgumentParser]


_ERROR: list[type[Exception]] = [ValueError]  # replaced by add_commands' ``error``


def _cli_error(message: str) -> Exception:
    return _ERROR[0](message)




def _read(path: str) -> list[Any]:
    from duetime.predict.data import DataError, read_rows

    try:
        return read_rows(path)
    except DataError as e:
        raise _cli_error(str(e)) from None


# -- train --------------------------------------------------------------------------------------

def _cmd_train(args: argparse.Namespace) -> int:
    from duetime.predict.training import TrainingError, TrainOptions, train

    rows = _read(args.data)
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise _cli_error(f"{args.tokenizer}: no such tokenizer file")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _cli_error(f"{out}: exists and is not a directory")
    opt = TrainOptions(rounds=args.rounds, seed=args.seed, tokenizer=args.tokenizer)
    try:
        summary = train(rows, out, opt, log=lambda msg: print(msg, file=sys.stderr))
    except (TrainingError, ValueError) as e:
        raise _cli_error(str(e)) from None
    except OSError as e:
        raise _cli_error(f"{out}: cannot write: {e.strerror or e}") from None
    synthetic = " (synthetic data)" if all(r.synthetic for r in rows) else ""
    print(f"trained on {summary['rows']} rows{synthetic} in {summary['seconds']:.1f} s; "
          f"wrote {out}")
    return 0


# -- eval ---------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _cmd_eval(args: argparse.Namespace) -> int:
    from duetime.predict.data import DataError
    from duetime.predict.evaluation import evaluate
    from duetime.predict.persistence import PredictorFormatError
    from duetime.predict.predictor import Predictor

    try:
        predictor = Predictor.load(args.model)
    except PredictorFormatError as e:
        raise _cli_error(str(e)) from None
    rows = _read(args.data)
    try:
        result = evaluate(predictor, rows, args.data)
    except DataError as e:
        raise _cli_error(str(e)) from None
    if args.json:
        print(json.dumps(result, indent=args.indent))
        return 0
    note = " (trained on SYNTHETIC data)" if result["synthetic_training_data"] else ""
    print(f"duetime predict eval: {result['rows']} rows of {args.data}, predictor "
          f"{args.model}{note}")
    print("baseline: the training mean of each row's (task, model)")
    table = [["section", "metric", "predictor", "baseline", "rows"]]
    for section, metrics in (("quality", ("mae", "rmse")), ("length", ("mae", "rmse")),
                             ("success", ("brier", "roc_auc"))):
        r = result[section]
        if r is None:
            table.append([section, "-", "no labels or no head", "", ""])
            continue
        for m in metrics:
            table.append([section, m, _fmt(r[m]), _fmt(r[f"baseline_{m}"]), str(r["n"])])
        if section == "length":
            table.append([section, "p90_coverage", _fmt(r["p90_coverage"]), "", str(r["n"])])
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for k, row in enumerate(table):
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print("length: mae of the median head, rmse of the mean head, in tokens")
    return 0


# -- registration -------------------------------------------------------------------------------

def add_commands(subparsers: Any, command: Command, error: type[Exception]) -> Any:
    """Register ``predict train|eval`` and return the ``predict`` group's subparsers (for
    ``predict synth``). ``command(name, run, help, description,
    into=...)`` is the main CLI's parser factory (it keeps the one-line error convention);
    ``error`` is the exception it reports as ``duetime: error: ...`` (exit 2)."""
    _ERROR[0] = error
    p = command("predict", None, "train and evaluate request predictors",
                "Request predictors (quality, output length, success probability): train them "
                "on judged JSONL data, evaluate them against per-(task, model) means, or make "
                "a synthetic judged data set. See docs/predict.md.", into=subparsers)
    sub = p.add_subparsers(dest="predict_command", metavar="SUBCOMMAND", required=True)

    p = command("train", _cmd_train, "train predictors on judged JSONL data",
                "Train the predictors on JSONL rows {prompt | messages, task?, model, score?, "
                "output_tokens?, correct?} and write them to DIR (LightGBM text models + "
                "predictor.json). Heads are trained for the labels present: score -> "
                "quality, output_tokens -> output length (mean, median, p90), correct -> "
                "success probability. Progress goes to stderr.", into=sub)
    p.add_argument("--data", required=True, metavar="FILE", help="judged rows (JSONL)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a HuggingFace tokenizer.json for exact token counts (copied into "
                   "DIR); default: the fast estimate")
    p.add_argument("--rounds", type=positive_int, default=300, metavar="N",
                   help="at most N boosting rounds per head (early stopping picks fewer; "
                   "default 300)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")

    p = command("eval", _cmd_eval, "evaluate trained predictors on held-out data",
                "Evaluate a trained predictor on held-out JSONL rows: MAE/RMSE for quality "
                "and output length, Brier score and ROC-AUC for success, each beside the "
                "per-(task, model) training mean.", into=sub)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a directory made by `duetime predict train`")
    p.add_argument("--data", required=True, metavar="FILE", help="held-out rows (JSONL)")
    p.add_argument("--json", action="store_true",
                   help='print {"quality": {"mae", "baseline_mae", ...}, "length": {...}, '
                   '"success": {...}} as JSON')
    p.add_argument("--indent", type=count, default=None, metavar="N",
                   help="indent the JSON output by N spaces (default: one line)")
    return sub
