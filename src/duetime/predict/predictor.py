"""A trained predictor: features and all predictions for a request and its candidate models.

This is the routing hot path. ``features(text, task)`` scans the text once; ``predict(f,
models)`` evaluates every head for all candidate models in one compiled call (the quality
regressor, the three output-length heads and the success regressions), because each
Python-to-numpy or Python-to-numba crossing costs a microsecond or more and the budget is
200 us per request. Nothing here imports LightGBM or scikit-learn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetime.engine._jit import njit
from duetime.predict import persistence as ps
from duetime.predict.buckets import N_BUCKETS
from duetime.predict.features import (
    LANG_INDEX,
    N_NUMERIC,
    RequestFeatures,
    base_names,
    base_vector,
    numeric_block,
    text_features,
)
from duetime.predict.language import LANGUAGES
from duetime.predict.pca import N_COMPONENTS, HashedPCA
from duetime.predict.remaining import remaining_tokens
from duetime.predict.success import SuccessModel, length_term, success_names
from duetime.predict.task_infer import TaskClassifier
from duetime.predict.text_scan import HASH_NAME, SAMPLE_BYTES
from duetime.predict.tokens import FastEstimate, HFTokenizer, Tokenizer
from duetime.predict.trees import (
    Forest,
    TreeFormatError,
    build_forest,
    eval_forest,
    parse_model_text,
)

HEADS = ("quality", "length_mean", "length_median", "length_p90")
_EMPTY_FOREST = build_forest([])


class UnknownModelError(KeyError):
    """A model the predictor was not trained on."""

    def __str__(self) -> str:
        return str(self.args[0])


@njit(cache=True, nogil=True)
def _predict_kernel(x: np.ndarray, n_base: int, models: np.ndarray, task_row: int,
                    head_start: np.ndarray, node_start: np.ndarray, leaf_start: np.ndarray,
                    feature: np.ndarray, threshold: np.ndarray, decision: np.ndarray,
                    left: np.ndarray, right: np.ndarray, leaf_value: np.ndarray,
                    offsets: np.ndarray, rows: np.ndarray, q_lo: float, q_hi: float,
                    smearing: np.ndarray, s_intercept: np.ndarray, s_coef: np.ndarray,
                    lang: int, task: int, n_tasks: int, bucket: int, z: float,
                    raw: np.ndarray, out: np.ndarray) -> None:
    """All heads for all models in one compiled call (one Python->numba crossing).

    out rows: quality, length mean, median, p90, success; NaN where a head is missing.
    ``rows[h]`` is head h's row in the forest output (-1: not trained); success is skipped
    when ``s_coef`` has no rows, and reads the predicted quality (its last feature) when
    there is a quality head."""
    n_models = models.shape[0]
    out[:, :] = np.nan
    if head_start.shape[0] > 1:
        eval_forest(x, n_base, models, head_start, node_start, leaf_start, feature,
                    threshold, decision, left, right, leaf_value, raw)
        for j in range(n_models):
            m = models[j]
            for h in range(raw.shape[0]):
                raw[h, j] += offsets[h, task_row, m]
            if rows[0] >= 0:
                out[0, j] = min(max(raw[rows[0], j], q_lo), q_hi)
            if rows[2] >= 0:
                med = max(math.expm1(raw[rows[2], j]), 1.0)
                out[2, j] = med
                out[3, j] = max(math.expm1(raw[rows[3], j]), med)
                out[1, j] = max(math.exp(raw[rows[1], j]) * smearing[task_row, m] - 1.0, 1.0)
    if s_coef.shape[0] > 0:
        n_lang = 5
        b_col = n_lang + n_tasks
        z_col = b_col + N_BUCKETS
        q_col = z_col + 1 + n_lang
        for j in range(n_models):
            m = models[j]
            logit = s_intercept[m] + s_coef[m, lang] + s_coef[m, b_col + bucket] \
                + z * (s_coef[m, z_col] + s_coef[m, z_col + 1 + lang])
            if task >= 0:
                logit += s_coef[m, n_lang + task]
            if rows[0] >= 0:
                logit += s_coef[m, q_col] * out[0, j]
            out[4, j] = 1.0 / (1.0 + math.exp(-logit))


@dataclass(slots=True)
class Predictions:
    """Per candidate model (same order as ``models``); a head that was not trained is None.

    ``length_mean`` is the expected output length (for cost), ``length_median`` the typical
    one (the forecast's decode horizon), ``length_p90`` its 90th percentile."""

    models: tuple[str, ...]
    quality: np.ndarray | None
    length_mean: np.ndarray | None
    length_median: np.ndarray | None
    length_p90: np.ndarray | None
    success: np.ndarray | None

    def remaining_tokens(self, generated: float, statistic: str = "mean") -> np.ndarray:
        """Tokens still to come per model for a request that has made ``generated`` tokens."""
        if self.length_median is None or self.length_p90 is None:
            raise ValueError("this predictor has no output-length heads")
        return remaining_tokens(self.length_median, self.length_p90, generated, statistic)


@dataclass
class Predictor:
    """Load with :meth:`load`; made by :func:`duetime.predict.training.train`."""

    models: tuple[str, ...]
    tasks: tuple[str, ...]
    tokenizer: Tokenizer
    pca: HashedPCA
    task_classifier: TaskClassifier | None
    forest: Forest | None
    head_rows: dict[str, int]   # head name -> row of the forest's output
    offsets: np.ndarray         # float64[n_heads, n_tasks + 1, n_models]; row 0: unknown task
    quality_clip: tuple[float, float]
    smearing: np.ndarray        # float64[n_tasks + 1, n_models]: mean-head factors
    success: SuccessModel | None
    spec: dict[str, Any]

    def __post_init__(self) -> None:
        self.model_index = {m: i for i, m in enumerate(self.models)}
        self.task_index = {t: i for i, t in enumerate(self.tasks)}
        self.n_base = N_NUMERIC + N_COMPONENTS + len(self.tasks) + len(LANGUAGES)
        self._indices: dict[tuple[str, ...], np.ndarray] = {}
        self._rows = np.array([self.head_rows.get(h, -1) for h in HEADS], dtype=np.int64)
        self._forest = self.forest if self.forest is not None else _EMPTY_FOREST
        if self.success is not None:
            self._s_coef = np.ascontiguousarray(self.success.coef)
            self._s_intercept = np.ascontiguousarray(self.success.intercept)
        else:
            self._s_coef = np.zeros((0, 1))
            self._s_intercept = np.zeros(0)
        self._has = ("quality" in self.head_rows, "length_median" in self.head_rows,
                     self.success is not None)

    # -- the hot path ---------------------------------------------------------------------------

    def features(self, text: str, task: str | None = None,
                 tokens: int | None = None) -> RequestFeatures:
        """Featurise one request. ``task`` None: inferred (when trained with tasks); a task
        not seen in training counts as unknown. ``tokens``: the prompt's token count when the
        caller already has it (else the predictor's tokenizer or estimate counts)."""
        tf = text_features(text, self.tokenizer, tokens)
        numeric = numeric_block(tf, self.pca)
        inferred = False
        if task is not None:
            ti = self.task_index.get(task, -1)
        elif self.task_classifier is not None:
            ti = self.task_classifier.predict_from(numeric, LANG_INDEX[tf.language])
            task, inferred = self.tasks[ti], True
        else:
            ti = -1
        return RequestFeatures(text=tf, task=task, task_index=ti, task_inferred=inferred,
                               vector=base_vector(numeric, ti, tf.language, len(self.tasks)))

    def model_indices(self, models: Sequence[str]) -> np.ndarray:
        key = tuple(models)
        idx = self._indices.get(key)
        if idx is None:
            try:
                idx = np.array([self.model_index[m] for m in key], dtype=np.int64)
            except KeyError as e:
                raise UnknownModelError(
                    f"model {e.args[0]!r} is not in the trained predictor (trained on: "
                    f"{', '.join(self.models)})") from None
            if len(self._indices) < 256:
                self._indices[key] = idx
        return idx

    def predict(self, features: RequestFeatures, models: Sequence[str]) -> Predictions:
        """Every trained head for each of ``models`` (vectorised over models)."""
        idx = self.model_indices(models)
        f = self._forest
        out = np.empty((5, len(idx)))
        tf = features.text
        _predict_kernel(features.vector, self.n_base, idx, features.task_index + 1,
                        f.head_start, f.node_start, f.leaf_start, f.feature, f.threshold,
                        f.decision, f.left, f.right, f.leaf_value, self.offsets,
                        self._rows, self.quality_clip[0], self.quality_clip[1], self.smearing,
                        self._s_intercept, self._s_coef, LANG_INDEX[tf.language],
                        features.task_index, len(self.tasks), tf.bucket,
                        length_term(tf.tokens),
                        np.empty((f.n_heads, len(idx))), out)
        has_q, has_len, has_s = self._has
        return Predictions(models=tuple(models), quality=out[0] if has_q else None,
                           length_mean=out[1] if has_len else None,
                           length_median=out[2] if has_len else None,
                           length_p90=out[3] if has_len else None,
                           success=out[4] if has_s else None)

    def predict_text(self, text: str, models: Sequence[str],
                     task: str | None = None) -> Predictions:
        return self.predict(self.features(text, task), models)

    @property
    def synthetic(self) -> bool:
        """True when trained on data marked synthetic."""
        return bool(self.spec.get("synthetic_training_data"))

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def load(cls, directory: str | Path) -> Predictor:
        """Load a directory made by ``duetime predict train`` (checks format and version)."""
        d = Path(directory)
        spec = ps.read_spec(d)
        path = d / ps.SPEC_FILE
        try:
            return cls._from_spec(spec, d, path)
        except ps.PredictorFormatError:
            raise
        except TreeFormatError as e:  # already names its file
            raise ps.PredictorFormatError(str(e)) from None
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ps.PredictorFormatError(f"{path}: {e}") from None

    @classmethod
    def _from_spec(cls, spec: dict[str, Any], d: Path, path: Path) -> Predictor:
        get = ps.get
        feats = get(spec, "features", path, dict)
        if get(feats, "hash", path) != HASH_NAME or get(feats, "sample_bytes", path) \
                != SAMPLE_BYTES:
            raise ps.PredictorFormatError(f"{path}: features: trained with another token hash "
                                          f"or sample ({feats.get('hash')!r}); retrain")
        tok = get(spec, "features.tokenizer", path, dict)
        tokenizer: Tokenizer
        if tok.get("kind") == "tokenizer":
            tpath = d / str(get(spec, "features.tokenizer.file", path, str))
            if not tpath.is_file():
                raise ps.PredictorFormatError(f"{tpath}: missing (the predictor was trained "
                                              "with this tokenizer)")
            try:
                tokenizer = HFTokenizer(tpath)
            except ValueError as e:
                raise ps.PredictorFormatError(str(e)) from None
        else:
            tokenizer = FastEstimate(get(spec, "features.tokenizer.coefficients", path, dict))
        models = tuple(get(spec, "models", path, list))
        tasks = tuple(get(spec, "tasks", path, list))
        if not models or not all(isinstance(m, str) for m in models + tasks):
            raise ps.PredictorFormatError(f"{path}: models/tasks: must be lists of names "
                                          "(at least one model)")
        if tuple(get(spec, "languages", path, list)) != LANGUAGES:
            raise ps.PredictorFormatError(f"{path}: languages: differ from this duetime's "
                                          f"{list(LANGUAGES)}; retrain")
        pca = HashedPCA.from_dict(get(spec, "pca", path, dict))
        n_base = N_NUMERIC + N_COMPONENTS + len(tasks) + len(LANGUAGES)
        tc_spec = get(spec, "task_classifier", path, dict, optional=True)
        task_clf = (TaskClassifier.from_dict(tc_spec, N_NUMERIC + N_COMPONENTS + len(LANGUAGES))
                    if tc_spec else None)
        heads = get(spec, "heads", path, dict)
        parsed, rows, offsets = [], {}, []
        for name in HEADS:
            if name not in heads:
                continue
            h = get(heads, name, path, dict)
            fpath = d / str(get(h, "file", path, str))
            n_features, trees = parse_model_text(ps.read_text(fpath), str(fpath))
            if n_features != n_base + len(models):
                raise ps.PredictorFormatError(
                    f"{fpath}: the model reads {n_features} features, the spec describes "
                    f"{n_base + len(models)}")
            off = np.asarray(get(h, "offsets", path, list), dtype=np.float64)
            if off.shape != (len(tasks) + 1, len(models)):
                raise ps.PredictorFormatError(f"{path}: heads.{name}.offsets: expected "
                                              f"[{len(tasks) + 1}][{len(models)}]")
            rows[name] = len(parsed)
            parsed.append((n_features, trees))
            offsets.append(off)
        length_heads = {"length_mean", "length_median", "length_p90"} & set(rows)
        if length_heads and len(length_heads) != 3:
            raise ps.PredictorFormatError(f"{path}: heads: the length heads come as three "
                                          "(mean, median, p90)")
        clip = (-math.inf, math.inf)
        if "quality" in rows:
            lo, hi = get(heads, "quality.clip", path, list)
            clip = (float(lo), float(hi))
        smearing = np.ones((len(tasks) + 1, len(models)))
        if length_heads:
            smearing = np.asarray(get(heads, "length_mean.smearing", path, list),
                                  dtype=np.float64)
            if smearing.shape != (len(tasks) + 1, len(models)) or not np.all(smearing > 0):
                raise ps.PredictorFormatError(f"{path}: heads.length_mean.smearing: expected "
                                              f"[{len(tasks) + 1}][{len(models)}] positive "
                                              "numbers")
        success = None
        s_spec = get(spec, "success", path, dict, optional=True)
        if s_spec:
            names = success_names(tasks)
            if get(s_spec, "features", path, list) != names:
                raise ps.PredictorFormatError(f"{path}: success.features: differ from this "
                                              "duetime's layout; retrain")
            success = SuccessModel.from_dict(get(s_spec, "models", path, dict), models,
                                             len(names))
        if success is not None and len(LANGUAGES) != 5:  # the kernel's layout
            raise ps.PredictorFormatError(f"{path}: success: unexpected language count")
        return cls(models=models, tasks=tasks, tokenizer=tokenizer, pca=pca,
                   task_classifier=task_clf, forest=build_forest(parsed) if parsed else None,
                   head_rows=rows,
                   offsets=np.stack(offsets) if offsets else np.zeros((0, len(tasks) + 1,
                                                                       len(models))),
                   quality_clip=clip, smearing=smearing, success=success, spec=spec)

    def feature_names(self) -> list[str]:
        """Columns of the regressors' rows: the base vector, then one indicator per model."""
        return base_names(self.tasks) + [f"model={m}" for m in self.models]


def load_predictor(directory: str | Path) -> Predictor:
    """:meth:`Predictor.load`."""
    return Predictor.load(directory)
