"""Training: judged rows -> a predictor directory (see ``persistence``).

What is fitted, in order:

1. the text features of every distinct prompt (one scan each), the PCA of their hashed-token
   vectors, and (with two or more tasks) the task classifier for rows that name none;
2. per head, an *offset*: the per-(task, model) mean (median / p90 for the quantile heads) of
   the label, shrunk toward the model's overall value for small groups. The per-(task, model)
   mean is the baseline every head must beat, so the trees start from it and learn only what
   the prompt adds (LightGBM ``init_score``);
3. the LightGBM heads: quality (L2 on the score), output length in log space (L2 for the mean,
   quantile 0.5 and 0.9). The number of rounds is chosen by early stopping on a validation
   split *by prompt* (no prompt on both sides), then each head is refitted on all rows;
4. the per-model logistic regressions for success (``success``).

Deterministic for a given seed (LightGBM ``deterministic``, single thread).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import duetime
from duetime.predict import persistence as ps
from duetime.predict.data import Row
from duetime.predict.features import (
    LANG_INDEX,
    N_NUMERIC,
    TextFeatures,
    base_names,
    numeric_block,
    text_features,
)
from duetime.predict.language import LANGUAGES
from duetime.predict.pca import N_COMPONENTS, HashedPCA
from duetime.predict.success import SuccessModel, success_names, success_vector
from duetime.predict.task_infer import TaskClassifier, classifier_input
from duetime.predict.text_scan import HASH_NAME, SAMPLE_BYTES
from duetime.predict.tokens import FAST, FastEstimate, HFTokenizer, Tokenizer

SHRINK = 5.0  # pseudo-rows pulling a small (task, model) group toward the model's value
SMEARING_SHRINK = 20.0  # the same for the smearing factors (means of exp(residual): noisier)


@dataclass
class TrainOptions:
    """Knobs of ``duetime predict train`` (defaults suit a few thousand rows)."""

    rounds: int = 300             # at most; early stopping picks fewer (cost: docs/predict.md)
    learning_rate: float = 0.05
    num_leaves: int = 15
    max_depth: int = 6            # bounds the tree walk on the hot path
    min_data_in_leaf: int = 20
    validation_fraction: float = 0.2
    early_stopping: int = 40
    seed: int = 0
    tokenizer: str | None = None  # a tokenizer.json; None: the fast estimate
    threads: int = 1


class TrainingError(ValueError):
    """Data that cannot train anything (e.g. no labelled rows)."""


@dataclass
class _Prepared:
    texts: list[str]
    text_index: np.ndarray   # per row
    tf: list[TextFeatures]   # per distinct text
    numeric: np.ndarray      # per distinct text
    models: tuple[str, ...]
    model_index: np.ndarray  # per row
    tasks: tuple[str, ...]
    task_index: np.ndarray   # per row, given or inferred; -1 unknown
    given_task: list[str | None]
    x: np.ndarray            # per row: base vector + model one-hot
    pca: HashedPCA
    task_clf: TaskClassifier | None
    notes: dict[str, Any] = field(default_factory=dict)


def prepare(rows: Sequence[Row], tokenizer: Tokenizer = FAST, seed: int = 0) -> _Prepared:
    """Features of all rows (each distinct prompt scanned once)."""
    index: dict[str, int] = {}
    text_index = np.empty(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):
        text_index[i] = index.setdefault(r.text, len(index))
    texts = list(index)
    tf = [text_features(t, tokenizer) for t in texts]
    counts = np.stack([f.counts for f in tf]) if tf else np.zeros((0, 512))
    pca = HashedPCA.fit(counts, seed=seed)
    numeric = np.stack([numeric_block(f, pca) for f in tf])
    models = tuple(sorted({r.model for r in rows}))
    m_index = {m: i for i, m in enumerate(models)}
    model_index = np.array([m_index[r.model] for r in rows], dtype=np.int64)
    tasks = tuple(sorted({r.task for r in rows if r.task is not None}))
    t_index = {t: i for i, t in enumerate(tasks)}

    task_clf = None
    if tasks:
        first: dict[int, int] = {}
        for i, r in enumerate(rows):
            if r.task is not None:
                first.setdefault(int(text_index[i]), t_index[r.task])
        xs = np.stack([classifier_input(numeric[k], tf[k].language) for k in first])
        task_clf = TaskClassifier.fit(xs, np.array(list(first.values())), tasks)
    inferred: dict[int, int] = {}
    task_index = np.empty(len(rows), dtype=np.int64)
    for i, r in enumerate(rows):
        k = int(text_index[i])
        if r.task is not None:
            task_index[i] = t_index[r.task]
        elif task_clf is not None:
            if k not in inferred:
                inferred[k] = task_clf.predict_index(classifier_input(numeric[k], tf[k].language))
            task_index[i] = inferred[k]
        else:
            task_index[i] = -1

    n_num = N_NUMERIC + N_COMPONENTS
    n_base = n_num + len(tasks) + len(LANGUAGES)
    x = np.zeros((len(rows), n_base + len(models)))
    x[:, :n_num] = numeric[text_index]
    has_task = task_index >= 0
    x[np.flatnonzero(has_task), n_num + task_index[has_task]] = 1.0
    lang = np.array([LANG_INDEX[tf[k].language] for k in text_index], dtype=np.int64)
    x[np.arange(len(rows)), n_num + len(tasks) + lang] = 1.0
    x[np.arange(len(rows)), n_base + model_index] = 1.0
    return _Prepared(texts=texts, text_index=text_index, tf=tf, numeric=numeric, models=models,
                     model_index=model_index, tasks=tasks, task_index=task_index,
                     given_task=[r.task for r in rows], x=x, pca=pca, task_clf=task_clf,
                     notes={"inferred_tasks": len(inferred)})


# -- offsets: the per-(task, model) starting point of each head ---------------------------------

def _stat(values: np.ndarray, q: float | None) -> float:
    return float(np.mean(values)) if q is None else float(np.quantile(values, q))


def group_offsets(y: np.ndarray, task_index: np.ndarray, model_index: np.ndarray,
                  n_tasks: int, n_models: int, q: float | None,
                  shrink: float = SHRINK) -> np.ndarray:
    """[n_tasks + 1, n_models]: row 0 the model's value (unknown task), row t+1 the (task,
    model) value shrunk toward it by ``shrink`` pseudo-rows. ``q`` None: means."""
    overall = _stat(y, q)
    out = np.full((n_tasks + 1, n_models), overall)
    for m in range(n_models):
        sel_m = model_index == m
        if not sel_m.any():
            continue
        mv = _stat(y[sel_m], q)
        out[:, m] = mv
        for t in range(n_tasks):
            sel = sel_m & (task_index == t)
            n = int(sel.sum())
            if n:
                out[t + 1, m] = (n * _stat(y[sel], q) + shrink * mv) / (n + shrink)
    return out


def _row_offsets(table: np.ndarray, task_index: np.ndarray, model_index: np.ndarray
                 ) -> np.ndarray:
    return table[task_index + 1, model_index]


# -- LightGBM heads -----------------------------------------------------------------------------

def _params(opt: TrainOptions, objective: str, alpha: float | None, n_rows: int
            ) -> dict[str, Any]:
    p: dict[str, Any] = {
        "objective": objective, "learning_rate": opt.learning_rate,
        "num_leaves": opt.num_leaves, "max_depth": opt.max_depth,
        "min_data_in_leaf": max(3, min(opt.min_data_in_leaf, n_rows // 20)),
        "lambda_l2": 1.0, "feature_fraction": 0.9, "bagging_fraction": 0.9, "bagging_freq": 1,
        "seed": opt.seed, "deterministic": True, "force_col_wise": True,
        "num_threads": opt.threads, "verbose": -1,
    }
    if alpha is not None:
        p["alpha"] = alpha
    return p


def _split(pre: _Prepared, rows_sel: np.ndarray, opt: TrainOptions) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """Train / validation row indices (of ``rows_sel``), split by prompt."""
    texts = np.unique(pre.text_index[rows_sel])
    rng = np.random.default_rng(opt.seed)
    n_val = round(len(texts) * opt.validation_fraction)
    if len(texts) < 20 or n_val < 5:
        return rows_sel, rows_sel[:0]
    val_texts = rng.choice(texts, size=n_val, replace=False)
    is_val = np.isin(pre.text_index[rows_sel], val_texts)
    return rows_sel[~is_val], rows_sel[is_val]


@dataclass
class HeadFit:
    name: str
    model_text: str
    offsets: np.ndarray
    rounds: int
    validation: dict[str, float] = field(default_factory=dict)
    residuals: np.ndarray | None = None  # of the refitted head on all its rows (``sel``)


def fit_head(pre: _Prepared, name: str, sel: np.ndarray, y: np.ndarray, opt: TrainOptions,
             objective: str, alpha: float | None = None) -> HeadFit:
    """One LightGBM head on rows ``sel`` (labels ``y`` aligned with ``sel``), offsets from the
    per-(task, model) table; rounds by early stopping on a by-prompt validation split."""
    import lightgbm as lgb

    n_tasks, n_models = len(pre.tasks), len(pre.models)
    q = alpha if objective == "quantile" else None
    pos = {int(r): i for i, r in enumerate(sel)}
    tr, va = _split(pre, sel, opt)
    y_tr = y[[pos[int(r)] for r in tr]]
    table = group_offsets(y_tr, pre.task_index[tr], pre.model_index[tr], n_tasks, n_models, q)
    params = _params(opt, objective, alpha, len(tr))
    rounds = min(opt.rounds, 100)
    validation: dict[str, float] = {}
    if len(va):
        y_va = y[[pos[int(r)] for r in va]]
        off_tr = _row_offsets(table, pre.task_index[tr], pre.model_index[tr])
        off_va = _row_offsets(table, pre.task_index[va], pre.model_index[va])
        dtr = lgb.Dataset(pre.x[tr], y_tr, init_score=off_tr, free_raw_data=False)
        dva = lgb.Dataset(pre.x[va], y_va, init_score=off_va, reference=dtr)
        booster = lgb.train(params, dtr, num_boost_round=opt.rounds, valid_sets=[dva],
                            callbacks=[lgb.early_stopping(opt.early_stopping, verbose=False)])
        rounds = max(1, booster.best_iteration or opt.rounds)
        pred = booster.predict(pre.x[va], num_iteration=rounds) + off_va
        validation = {"rows": len(va), "loss": _loss(y_va, pred, objective, alpha),
                      "baseline_loss": _loss(y_va, off_va, objective, alpha)}
    # Refit on everything with the chosen number of rounds.
    table = group_offsets(y, pre.task_index[sel], pre.model_index[sel], n_tasks, n_models, q)
    off = _row_offsets(table, pre.task_index[sel], pre.model_index[sel])
    params = _params(opt, objective, alpha, len(sel))
    booster = lgb.train(params, lgb.Dataset(pre.x[sel], y, init_score=off),
                        num_boost_round=rounds)
    residuals = y - (booster.predict(pre.x[sel]) + off)
    return HeadFit(name=name, model_text=booster.model_to_string(), offsets=table,
                   rounds=rounds, validation=validation, residuals=residuals)


def _out_of_fold_quality(pre: _Prepared, score: np.ndarray, rounds: int,
                         clip: list[float], opt: TrainOptions, folds: int = 3) -> np.ndarray:
    """Per row, the quality predicted by a head that did not see the row's prompt (folds by
    prompt, the main head's rounds, its offsets rebuilt per fold): the success regressions'
    quality feature, as the trained head will feed it on new prompts."""
    import lightgbm as lgb

    fold_of_text = np.random.default_rng(opt.seed + 7).integers(0, folds, len(pre.texts))
    fold = fold_of_text[pre.text_index]
    labelled = ~np.isnan(score)
    out = np.full(len(score), float(np.nanmean(score)))
    for k in range(folds):
        tr = np.flatnonzero(labelled & (fold != k))
        te = np.flatnonzero(fold == k)
        if len(tr) < 10 or not len(te):
            continue
        table = group_offsets(score[tr], pre.task_index[tr], pre.model_index[tr],
                              len(pre.tasks), len(pre.models), None)
        off = _row_offsets(table, pre.task_index[tr], pre.model_index[tr])
        booster = lgb.train(_params(opt, "regression", None, len(tr)),
                            lgb.Dataset(pre.x[tr], score[tr], init_score=off),
                            num_boost_round=rounds)
        out[te] = booster.predict(pre.x[te]) + _row_offsets(table, pre.task_index[te],
                                                            pre.model_index[te])
    return np.clip(out, clip[0], clip[1])


def _loss(y: np.ndarray, p: np.ndarray, objective: str, alpha: float | None) -> float:
    if objective == "quantile":
        d = y - p
        return float(np.mean(np.maximum(alpha * d, (alpha - 1) * d)))
    return float(np.mean((y - p) ** 2))


# -- baselines ----------------------------------------------------------------------------------

def baseline_table(values: np.ndarray, tasks: Sequence[str | None], models: Sequence[str]
                   ) -> dict[str, Any]:
    """Plain means: per (given task, model), per model, overall (the eval's baseline)."""
    by_tm: dict[str, dict[str, list[float]]] = {}
    by_m: dict[str, list[float]] = {}
    for v, t, m in zip(values.tolist(), tasks, models, strict=True):
        by_m.setdefault(m, []).append(v)
        if t is not None:
            by_tm.setdefault(t, {}).setdefault(m, []).append(v)
    return {"by_task_model": {t: {m: float(np.mean(v)) for m, v in d.items()}
                              for t, d in by_tm.items()},
            "by_model": {m: float(np.mean(v)) for m, v in by_m.items()},
            "overall": float(np.mean(values)) if len(values) else None}


# -- the whole training -------------------------------------------------------------------------

def train(rows: Sequence[Row], out_dir: str | Path, options: TrainOptions | None = None,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fit every head the labels allow and write the predictor directory; return the
    training summary (also in predictor.json)."""
    opt = options or TrainOptions()
    say = log or (lambda _msg: None)
    started = time.perf_counter()
    if not rows:
        raise TrainingError("no rows to train on")
    score = np.array([np.nan if r.score is None else r.score for r in rows])
    out_tokens = np.array([np.nan if r.output_tokens is None else r.output_tokens for r in rows])
    correct = np.array([np.nan if r.correct is None else float(r.correct) for r in rows])
    if np.isnan(score).all() and np.isnan(out_tokens).all() and np.isnan(correct).all():
        raise TrainingError("no labelled rows: each row needs score, output_tokens or correct "
                            "to train anything")
    tokenizer: Tokenizer = HFTokenizer(opt.tokenizer) if opt.tokenizer else FAST
    pre = prepare(rows, tokenizer, opt.seed)
    say(f"{len(rows)} rows, {len(pre.texts)} distinct prompts, {len(pre.models)} models, "
        f"{len(pre.tasks)} tasks ({pre.notes['inferred_tasks']} prompts with an inferred task)")

    heads: dict[str, HeadFit] = {}
    head_spec: dict[str, Any] = {}
    sel = np.flatnonzero(~np.isnan(score))
    if len(sel):
        fit = fit_head(pre, "quality", sel, score[sel], opt, "regression")
        heads["quality"] = fit
        head_spec["quality"] = {"objective": "l2 on score", "clip": [float(score[sel].min()),
                                                                    float(score[sel].max())]}
        say(f"quality: {len(sel)} rows, {fit.rounds} rounds")
    sel = np.flatnonzero(~np.isnan(out_tokens))
    if len(sel):
        y = np.log1p(out_tokens[sel])
        for name, objective, alpha in (("length_mean", "regression", None),
                                       ("length_median", "quantile", 0.5),
                                       ("length_p90", "quantile", 0.9)):
            fit = fit_head(pre, name, sel, y, opt, objective, alpha)
            heads[name] = fit
            head_spec[name] = {"objective": ("l2" if alpha is None else f"quantile {alpha}")
                               + " on log1p(output_tokens)"}
        # Duan's smearing per (task, model): exp(log-space mean) x mean(exp(residual)) is the
        # mean in tokens; the spread differs by group (small models vary more), so one global
        # factor biases the groups' means. Residuals of the head on all its rows: validation
        # residuals alone (a fifth of the rows) were too noisy for per-group factors (RMSE in
        # tokens worse than the baseline in 3 of 10 synthetic runs; all rows: 0 of 10).
        fit = heads["length_mean"]
        assert fit.residuals is not None
        head_spec["length_mean"]["smearing"] = group_offsets(
            np.exp(fit.residuals), pre.task_index[sel], pre.model_index[sel],
            len(pre.tasks), len(pre.models), None, shrink=SMEARING_SHRINK).tolist()
        say(f"length: {len(sel)} rows, rounds mean/median/p90 = "
            f"{heads['length_mean'].rounds}/{heads['length_median'].rounds}/"
            f"{heads['length_p90'].rounds}")

    success_spec = None
    sel = np.flatnonzero(~np.isnan(correct))
    if len(sel):
        q_hat = np.zeros(len(rows))
        if "quality" in heads:
            q_hat = _out_of_fold_quality(pre, score, heads["quality"].rounds,
                                         head_spec["quality"]["clip"], opt)
        xs = np.stack([success_vector(pre.tf[pre.text_index[i]].language,
                                      int(pre.task_index[i]), len(pre.tasks),
                                      pre.tf[pre.text_index[i]].bucket,
                                      pre.tf[pre.text_index[i]].tokens, float(q_hat[i]))
                       for i in sel])
        sm = SuccessModel.fit(xs, correct[sel], pre.model_index[sel], len(pre.models),
                              len(pre.tasks), opt.seed)
        success_spec = {"features": success_names(pre.tasks),
                        "models": sm.to_dict(pre.models)}
        say(f"success: {len(sel)} rows, " + ", ".join(
            f"{m}: {k}" for m, k in zip(pre.models, sm.kind, strict=True)))

    n_trees = sum(f.rounds for f in heads.values())
    if heads:
        say(f"{n_trees} trees in {len(heads)} heads (each costs ~25-30 ns per candidate model "
            "per request on the hot path)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_spec: dict[str, Any]
    if isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, out / ps.TOKENIZER_FILE)
        tok_spec = {"kind": "tokenizer", "file": ps.TOKENIZER_FILE}
    else:
        assert isinstance(tokenizer, FastEstimate)
        tok_spec = {"kind": "estimate", "coefficients": tokenizer.coefficients}
    for name, fit in heads.items():
        (out / ps.HEAD_FILES[name]).write_text(fit.model_text, encoding="utf-8")
        head_spec[name].update({"file": ps.HEAD_FILES[name], "offsets": fit.offsets.tolist(),
                                "rounds": fit.rounds, "validation": fit.validation})
    for name, file in ps.HEAD_FILES.items():  # a stale head from an earlier training
        if name not in heads and (out / file).exists():
            (out / file).unlink()

    models_col = [r.model for r in rows]
    baselines = {}
    for key, values in (("quality", score), ("length", out_tokens), ("success", correct)):
        ok = ~np.isnan(values)
        baselines[key] = baseline_table(values[ok], [t for t, k in zip(pre.given_task, ok,
                                                                       strict=True) if k],
                                        [m for m, k in zip(models_col, ok, strict=True) if k])
    summary = {
        "rows": len(rows), "distinct_prompts": len(pre.texts),
        "labelled": {"score": int((~np.isnan(score)).sum()),
                     "output_tokens": int((~np.isnan(out_tokens)).sum()),
                     "correct": int((~np.isnan(correct)).sum())},
        "inferred_task_prompts": pre.notes["inferred_tasks"],
        "trees": n_trees,
        "languages": {lang: sum(1 for f in pre.tf if f.language == lang) for lang in LANGUAGES},
        "seconds": round(time.perf_counter() - started, 3),
        "options": {k: v for k, v in vars(opt).items() if k != "tokenizer"},
    }
    spec = {
        "format": ps.FORMAT, "format_version": ps.FORMAT_VERSION,
        "duetime_version": duetime.__version__,
        "synthetic_training_data": all(r.synthetic for r in rows),
        "features": {"hash": HASH_NAME, "sample_bytes": SAMPLE_BYTES, "tokenizer": tok_spec,
                     "names": base_names(pre.tasks) + [f"model={m}" for m in pre.models]},
        "models": list(pre.models), "tasks": list(pre.tasks), "languages": list(LANGUAGES),
        "pca": pre.pca.to_dict(),
        "task_classifier": pre.task_clf.to_dict() if pre.task_clf else None,
        "heads": head_spec,
        "success": success_spec,
        "baselines": baselines,
        "training": summary,
    }
    ps.write_json(out / ps.SPEC_FILE, _finite(spec))
    return summary


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: replace them with None (a clean file beats a clever one)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj
