"""Task inference for requests that arrive without one: a multinomial logistic regression over
the hashed-token PCA, the log counts and the language, fitted on the training rows that name a
task. (A gateway request rarely says "this is summarisation"; a judged data set usually does.)

Predicting is one small matrix product in numpy (argmax of the class scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.engine._jit import njit
from duetime.predict.features import LANG_INDEX
from duetime.predict.language import LANGUAGES


def classifier_input(numeric: np.ndarray, language: str) -> np.ndarray:
    """The classifier's row: the numeric block (log counts, bucket, PCA) + language one-hot."""
    out = np.zeros(numeric.shape[-1] + len(LANGUAGES))
    out[: numeric.shape[-1]] = numeric
    out[numeric.shape[-1] + LANG_INDEX[language]] = 1.0
    return out


@njit(cache=True, nogil=True)
def _argmax_scores(w: np.ndarray, b: np.ndarray, numeric: np.ndarray, lang: int) -> int:
    """argmax over tasks of ``w @ [numeric, one-hot(lang)] + b``."""
    n = numeric.shape[0]
    best, best_k = -np.inf, 0
    for k in range(w.shape[0]):
        s = b[k] + w[k, n + lang]
        for i in range(n):
            s += w[k, i] * numeric[i]
        if s > best:
            best, best_k = s, k
    return best_k


@dataclass(frozen=True)
class TaskClassifier:
    """``argmax(coef @ ((x - mean) / scale) + intercept)`` over ``tasks``."""

    tasks: tuple[str, ...]
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray       # float64[n_tasks, n_features]
    intercept: np.ndarray  # float64[n_tasks]

    def __post_init__(self) -> None:
        # Fold the standardisation into the weights: one matrix-vector product per request.
        w = self.coef / self.scale
        object.__setattr__(self, "_w", np.ascontiguousarray(w))
        object.__setattr__(self, "_b", self.intercept - w @ self.mean)

    def predict_index(self, x: np.ndarray) -> int:
        """The task index for a ``classifier_input`` row."""
        if len(self.tasks) == 1:
            return 0
        return int(np.argmax(self._w @ x + self._b))

    def predict_from(self, numeric: np.ndarray, language_index: int) -> int:
        """:meth:`predict_index` without building the row (the hot path; compiled)."""
        if len(self.tasks) == 1:
            return 0
        return int(_argmax_scores(self._w, self._b, numeric, language_index))

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, tasks: tuple[str, ...]) -> TaskClassifier:
        """``y``: task indices into ``tasks`` (at least two distinct)."""
        from sklearn.linear_model import LogisticRegression

        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        scale[scale == 0] = 1.0
        coef = np.zeros((len(tasks), x.shape[1]))
        intercept = np.zeros(len(tasks))
        present = np.unique(y)
        if len(present) == 1:
            intercept[present[0]] = 1.0
        else:
            lr = LogisticRegression(C=1.0, max_iter=2000).fit((x - mean) / scale, y)
            if len(present) == 2:  # sklearn keeps one row for two classes
                coef[present[1]] = lr.coef_[0]
                intercept[present[1]] = lr.intercept_[0]
            else:
                coef[present] = lr.coef_
                intercept[present] = lr.intercept_
            absent = np.setdiff1d(np.arange(len(tasks)), present)
            intercept[absent] = -1e9  # never predicted
        return cls(tasks=tasks, mean=mean, scale=scale, coef=coef, intercept=intercept)

    def to_dict(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "coef": self.coef.tolist(),
                "intercept": self.intercept.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_features: int) -> TaskClassifier:
        tasks = tuple(str(t) for t in d["tasks"])
        mean = np.asarray(d["mean"], dtype=np.float64)
        scale = np.asarray(d["scale"], dtype=np.float64)
        coef = np.asarray(d["coef"], dtype=np.float64)
        intercept = np.asarray(d["intercept"], dtype=np.float64)
        if mean.shape != (n_features,) or scale.shape != (n_features,) \
                or coef.shape != (len(tasks), n_features) or intercept.shape != (len(tasks),):
            raise ValueError("task_classifier: arrays do not match its tasks and features")
        return cls(tasks=tasks, mean=mean, scale=scale, coef=coef, intercept=intercept)
