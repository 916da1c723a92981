"""Held-out evaluation of a trained predictor beside the per-(task, model) mean baseline.

* quality: MAE and RMSE of the predicted score;
* length: MAE of the median head and RMSE of the mean head (each head is the right estimate
  for its error: the median minimises absolute error, the mean squared error), in tokens, and
  the share of rows at or under the p90 head (``p90_coverage``, ideally ~0.9);
* success: Brier score and ROC-AUC of the success probability.

The baseline predicts the training mean of the row's (task, model) group; a row without a
task, or whose group was not in training, gets the model's training mean. It uses the task
the row *gives*; the predictor may infer one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from duetime.predict.data import DataError, Row
from duetime.predict.predictor import Predictor


def _baseline(table: dict[str, Any], task: str | None, model: str) -> float:
    by_tm = table.get("by_task_model", {})
    if task is not None and model in by_tm.get(task, {}):
        return float(by_tm[task][model])
    if model in table.get("by_model", {}):
        return float(table["by_model"][model])
    overall = table.get("overall")
    return float("nan") if overall is None else float(overall)


def _mae(y: np.ndarray, p: np.ndarray) -> float:
    return float(np.mean(np.abs(y - p)))


def _rmse(y: np.ndarray, p: np.ndarray) -> float:
    return float(math.sqrt(np.mean((y - p) ** 2)))


def _auc(y: np.ndarray, p: np.ndarray) -> float | None:
    if len(np.unique(y)) < 2:
        return None
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p))


def predict_rows(predictor: Predictor, rows: Sequence[Row], source: str = "<rows>"
                 ) -> dict[str, np.ndarray]:
    """Per row: the predictions for its model (NaN where a head is missing)."""
    for r in rows:
        if r.model not in predictor.model_index:
            raise DataError(source, r.line, "model",
                            f"{r.model!r} is not in the trained predictor (trained on: "
                            f"{', '.join(predictor.models)})")
    out = {k: np.full(len(rows), np.nan) for k in
           ("quality", "length_mean", "length_median", "length_p90", "success")}
    groups: dict[tuple[str, str | None], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r.text, r.task), []).append(i)
    for (text, task), idx in groups.items():
        feats = predictor.features(text, task)
        models = list(dict.fromkeys(rows[i].model for i in idx))
        pred = predictor.predict(feats, models)
        col = {m: j for j, m in enumerate(models)}
        for key in out:
            values = getattr(pred, key)
            if values is not None:
                for i in idx:
                    out[key][i] = values[col[rows[i].model]]
    return out


def evaluate(predictor: Predictor, rows: Sequence[Row], source: str = "<rows>"
             ) -> dict[str, Any]:
    """``{"quality": {...}, "length": {...}, "success": {...}, "rows": n}``; a section is None
    when the data has no such label or the predictor no such head."""
    pred = predict_rows(predictor, rows, source)
    base = predictor.spec.get("baselines", {})
    result: dict[str, Any] = {"rows": len(rows), "synthetic_training_data": predictor.synthetic}

    sel = [i for i, r in enumerate(rows) if r.score is not None]
    if sel and not np.isnan(pred["quality"][sel]).any():
        y = np.array([rows[i].score for i in sel])
        p = pred["quality"][sel]
        b = np.array([_baseline(base["quality"], rows[i].task, rows[i].model) for i in sel])
        result["quality"] = {"n": len(sel), "mae": _mae(y, p), "baseline_mae": _mae(y, b),
                             "rmse": _rmse(y, p), "baseline_rmse": _rmse(y, b)}
    else:
        result["quality"] = None

    sel = [i for i, r in enumerate(rows) if r.output_tokens is not None]
    if sel and not np.isnan(pred["length_median"][sel]).any():
        y = np.array([rows[i].output_tokens for i in sel], dtype=np.float64)
        b = np.array([_baseline(base["length"], rows[i].task, rows[i].model) for i in sel])
        result["length"] = {"n": len(sel), "mae": _mae(y, pred["length_median"][sel]),
                            "baseline_mae": _mae(y, b),
                            "rmse": _rmse(y, pred["length_mean"][sel]),
                            "baseline_rmse": _rmse(y, b),
                            "p90_coverage": float(np.mean(y <= pred["length_p90"][sel]))}
    else:
        result["length"] = None

    sel = [i for i, r in enumerate(rows) if r.correct is not None]
    if sel and not np.isnan(pred["success"][sel]).any():
        y = np.array([float(rows[i].correct) for i in sel])
        p = pred["success"][sel]
        b = np.array([_baseline(base["success"], rows[i].task, rows[i].model) for i in sel])
        result["success"] = {"n": len(sel), "brier": float(np.mean((p - y) ** 2)),
                             "baseline_brier": float(np.mean((b - y) ** 2)),
                             "roc_auc": _auc(y, p), "baseline_roc_auc": _auc(y, b)}
    else:
        result["success"] = None
    return result
