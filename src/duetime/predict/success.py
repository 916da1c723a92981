"""Success probability: one logistic regression per model over language, task and length
bucket, as LAAR's capability model ``Q(m, x)``.

Features (``success_names``): one-hot language, one-hot task, one-hot length bucket (LAAR's
three), plus two extensions:

* a centred log2 length and its product with each language: LAAR found accuracy slopes over
  length that differ by model and language, and a slope lets sparse buckets borrow from their
  neighbours;
* the request's predicted quality (the quality head's output, standardised), when the data
  has scores: judged quality and correctness usually share a cause the coarse features cannot
  see (what the prompt asks). Training uses out-of-fold predictions, so the regression learns
  how far to trust the quality head on prompts it did not train on.

Why the task columns are scaled up (x10) for fitting: the L2 penalty then barely touches the
per-task rates, so regularisation pulls a model toward its per-(task, model) success rate (the
baseline it is judged against), not toward its overall rate. Per model, 3-fold
cross-validated Brier score picks among the smoothed per-task rates ((k+1)/(n+2), stored as a
regression with task weights only) and the regressions with and without the quality feature
over a grid of C; a regression must beat the rates by more than one standard error of the
difference to be chosen. A model whose labels are all one class (or too few) gets its
smoothed overall rate. Coefficients are stored for the raw features (scales folded in).

Predicting is a handful of multiply-adds per model (``predictor._predict_kernel``);
scikit-learn is only used to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.predict.buckets import N_BUCKETS
from duetime.predict.features import LANG_INDEX
from duetime.predict.language import LANGUAGES

C_GRID = (0.03, 0.3, 3.0, 30.0)
MIN_ROWS_TO_FIT = 20
LOG2_CENTRE = 10.0  # ~1K tokens
LOG2_SCALE = 4.0
TASK_SCALE = 10.0


def success_names(tasks: tuple[str, ...]) -> list[str]:
    return ([f"lang={lang}" for lang in LANGUAGES] + [f"task={t}" for t in tasks]
            + [f"bucket={b}" for b in range(N_BUCKETS)] + ["log2_tokens"]
            + [f"log2_tokens*lang={lang}" for lang in LANGUAGES] + ["predicted_quality"])


def length_term(tokens: int) -> float:
    """The centred, scaled log2 length (``log2_tokens``)."""
    return (math.log2(max(tokens, 1)) - LOG2_CENTRE) / LOG2_SCALE


def success_vector(language: str, task_index: int, n_tasks: int, bucket: int,
                   tokens: int, quality: float = 0.0) -> np.ndarray:
    """One request's features (``success_names`` order); ``task_index`` -1 = unknown."""
    n_lang = len(LANGUAGES)
    x = np.zeros(n_lang + n_tasks + N_BUCKETS + 1 + n_lang + 1)
    li = LANG_INDEX[language]
    x[li] = 1.0
    if task_index >= 0:
        x[n_lang + task_index] = 1.0
    x[n_lang + n_tasks + bucket] = 1.0
    z = length_term(tokens)
    x[n_lang + n_tasks + N_BUCKETS] = z
    x[n_lang + n_tasks + N_BUCKETS + 1 + li] = z
    x[-1] = quality
    return x


@dataclass(frozen=True)
class SuccessModel:
    """Per-model logistic regressions: ``p = sigmoid(intercept[m] + coef[m] @ x)``."""

    coef: np.ndarray       # float64[n_models, n_features]
    intercept: np.ndarray  # float64[n_models]
    kind: tuple[str, ...]  # per model: "logistic", "logistic+quality", "task-rates", "constant"
    c: tuple[float | None, ...]  # the chosen C per model (None: no regression)

    def predict(self, x: np.ndarray, models: np.ndarray) -> np.ndarray:
        z = self.intercept[models] + self.coef[models] @ x
        return 1.0 / (1.0 + np.exp(-z))

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, model_index: np.ndarray, n_models: int,
            n_tasks: int, seed: int = 0) -> SuccessModel:
        """``x``: one row per labelled request (``success_vector``; its last column the
        out-of-fold predicted quality, or all zeros when there is none), ``y``: 0/1,
        ``model_index``: its model."""
        n_lang = len(LANGUAGES)
        tcols = slice(n_lang, n_lang + n_tasks)
        coef = np.zeros((n_models, x.shape[1]))
        intercept = np.zeros(n_models)
        kind: list[str] = []
        cs: list[float | None] = []
        q = x[:, -1]
        has_quality = bool(np.any(q != q[0])) if len(q) else False
        for m in range(n_models):
            sel = model_index == m
            xm, ym = x[sel].copy(), y[sel]
            n, k = len(ym), int(ym.sum())
            if n < MIN_ROWS_TO_FIT or min(k, n - k) < 3:
                intercept[m] = _logit((k + 1) / (n + 2))
                kind.append("constant")
                cs.append(None)
                continue
            q_mean, q_sd = float(xm[:, -1].mean()), float(xm[:, -1].std()) or 1.0
            xm[:, tcols] *= TASK_SCALE
            xm[:, -1] = (xm[:, -1] - q_mean) / q_sd
            choice = _choose(xm, ym, tcols, has_quality, seed)
            if choice is None:
                overall, rates = _task_rates(x[sel][:, tcols], ym)
                intercept[m] = _logit(overall)
                coef[m, tcols] = [_logit(r) - intercept[m] for r in rates]
                kind.append("task-rates")
                cs.append(None)
                continue
            c, with_q = choice
            cols = slice(None) if with_q else slice(0, x.shape[1] - 1)
            lr = _logistic(c).fit(xm[:, cols], ym)
            w = np.zeros(x.shape[1])
            w[cols] = lr.coef_[0]
            b = float(lr.intercept_[0])
            w[tcols] *= TASK_SCALE          # fold the scales back: coef for the raw features
            b -= w[-1] * q_mean / q_sd
            w[-1] /= q_sd
            coef[m], intercept[m] = w, b
            kind.append("logistic+quality" if with_q else "logistic")
            cs.append(c)
        return cls(coef=coef, intercept=intercept, kind=tuple(kind), c=tuple(cs))

    def to_dict(self, models: tuple[str, ...]) -> dict[str, Any]:
        return {m: {"kind": self.kind[i], "C": self.c[i], "intercept": float(self.intercept[i]),
                    "coef": self.coef[i].tolist()} for i, m in enumerate(models)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], models: tuple[str, ...],
                  n_features: int) -> SuccessModel:
        coef = np.zeros((len(models), n_features))
        intercept = np.zeros(len(models))
        kind, cs = [], []
        for i, m in enumerate(models):
            entry = d.get(m)
            if not isinstance(entry, dict):
                raise ValueError(f"success.models: no entry for model {m!r}")
            row = np.asarray(entry["coef"], dtype=np.float64)
            if row.shape != (n_features,):
                raise ValueError(f"success.models.{m}.coef: expected {n_features} numbers, got "
                                 f"{row.shape}")
            coef[i] = row
            intercept[i] = float(entry["intercept"])
            kind.append(str(entry["kind"]))
            cs.append(entry.get("C"))
        if not (np.isfinite(coef).all() and np.isfinite(intercept).all()):
            raise ValueError("success.models: contains non-finite numbers")
        return cls(coef=coef, intercept=intercept, kind=tuple(kind), c=tuple(cs))


def _logistic(c: float):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=2000)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _task_rates(onehot: np.ndarray, y: np.ndarray) -> tuple[float, list[float]]:
    """Smoothed overall and per-task success rates ((k+1)/(n+2))."""
    overall = (float(y.sum()) + 1.0) / (len(y) + 2.0)
    rates = []
    for t in range(onehot.shape[1]):
        sel = onehot[:, t] > 0
        rates.append((float(y[sel].sum()) + 1.0) / (int(sel.sum()) + 2.0) if sel.any()
                     else overall)
    return overall, rates


def _choose(x: np.ndarray, y: np.ndarray, tcols: slice, has_quality: bool,
            seed: int) -> tuple[float, bool] | None:
    """(C, with the quality feature) of the best regression by 3-fold cross-validated Brier
    score, or None when none beats the smoothed per-task rates by one standard error."""
    from sklearn.model_selection import StratifiedKFold

    folds = list(StratifiedKFold(n_splits=3, shuffle=True, random_state=seed).split(x, y))
    base = np.zeros(len(y))
    for tr, te in folds:
        overall, rates = _task_rates(x[tr, tcols], y[tr])
        oh = x[te, tcols] / TASK_SCALE
        base[te] = (np.where(oh.any(axis=1), oh @ np.array(rates) if rates else overall,
                             overall) - y[te]) ** 2
    best: tuple[float, bool] | None = None
    best_err = base.mean()
    best_sq = base
    for with_q in ((False, True) if has_quality else (False,)):
        cols = slice(None) if with_q else slice(0, x.shape[1] - 1)
        for c in C_GRID:
            sq = np.zeros(len(y))
            for tr, te in folds:
                p = _logistic(c).fit(x[tr][:, cols], y[tr]).predict_proba(x[te][:, cols])[:, 1]
                sq[te] = (p - y[te]) ** 2
            if sq.mean() < best_err:
                best, best_err, best_sq = (c, with_q), float(sq.mean()), sq
    if best is None:
        return None
    diff = best_sq - base
    if diff.mean() > -diff.std() / math.sqrt(len(diff)):
        return None  # not clearly better than the per-task rates
    return best
