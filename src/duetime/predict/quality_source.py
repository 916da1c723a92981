"""Where a routing policy gets a request's quality (and success probability) per model.

Three sources behind one interface, all vectorised over the candidate models of one request
(the policy's hot path asks once per request, not once per model):

* :class:`TaskTable`: a per-(task, model) table; the default is the SFS paper's judged
  accuracy (``paper_accuracy.yaml``). What the paper's own simulation used.
* :class:`Oracle`: the true per-request quality, fed by the simulator that drew it
  (simulation only: a real router never knows it). The upper bound for any predictor.
* :class:`Trained`: a predictor directory from ``duetime predict train`` (with a fallback
  source for the heads it was not trained with).

The simulator and the gateway both route with these objects; the simulator asks for a whole
request set at once (:meth:`QualitySource.quality_table`), the gateway per request.

A request is a :class:`Query` (text, task, id) or already-computed
:class:`~duetime.predict.features.RequestFeatures`. ``Trained`` keeps the features it computes
on the query, so asking quality and then success costs one featurisation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duetime.predict.features import RequestFeatures
from duetime.predict.paper_table import paper_accuracy
from duetime.predict.predictor import Predictions, Predictor, UnknownModelError


@dataclass(slots=True)
class Query:
    """One request as a quality source sees it. ``id`` is what the :class:`Oracle` looks up;
    ``features`` is filled by :class:`Trained` (and reused)."""

    text: str = ""
    task: str | None = None
    id: Hashable | None = None
    tokens: int | None = None  # the prompt's token count, when the caller already has it
    features: RequestFeatures | None = field(default=None, repr=False)


RequestLike = Query | RequestFeatures


@dataclass(slots=True)
class QueryTable:
    """Many requests column by column (what a simulator knows: tasks and ids, maybe texts),
    for :meth:`QualitySource.quality_table` without one :class:`Query` object per request."""

    task: Sequence[str | None]
    id: Sequence[Hashable] | None = None
    text: Sequence[str] | None = None

    def __len__(self) -> int:
        return len(self.task)

    def query(self, i: int) -> Query:
        return Query("" if self.text is None else self.text[i], self.task[i],
                     None if self.id is None else self.id[i])


class QualitySource(ABC):
    """Quality in [0, 1] (the utility's ``acc``) and success probability per model."""

    name: str = "quality-source"

    @abstractmethod
    def qualities(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        """float64[len(models)]: predicted quality of each model's answer."""

    def successes(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        """float64[len(models)]: probability each model answers correctly (LAAR's Q(m, x)).
        Default: the quality read as a probability."""
        return np.clip(self.qualities(request, models), 0.0, 1.0)

    def output_lengths(self, request: RequestLike, models: Sequence[str]) -> np.ndarray | None:
        """float64[len(models)]: predicted (median) output tokens per model, or None if this
        source does not predict lengths."""
        return None

    def output_length_spread(self, request: RequestLike, models: Sequence[str]
                             ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per model, the predicted median output tokens and their 90th percentile (each
        None where this source does not predict it): a completion deadline reads both."""
        return self.output_lengths(request, models), None

    def quality_table(self, requests: QueryTable, models: Sequence[str], *,
                      success: bool = False) -> np.ndarray:
        """float64[len(requests), len(models)]: :meth:`qualities` (or, with ``success``,
        :meth:`successes`) of many requests at once (sources override it when they can
        vectorise)."""
        get = self.successes if success else self.qualities
        out = np.empty((len(requests), len(models)))
        for i in range(len(requests)):
            out[i] = get(requests.query(i), models)
        return out

    def quality(self, request: RequestLike, model: str) -> float:
        return float(self.qualities(request, (model,))[0])

    def success(self, request: RequestLike, model: str) -> float:
        return float(self.successes(request, (model,))[0])


def _task_of(request: RequestLike) -> str | None:
    return request.task


class TaskTable(QualitySource):
    """Quality = ``table[task][model]``; a task not in the table gets the model's mean over
    tasks (a request of an unknown task is still routed). Success = quality."""

    name = "task-table"

    def __init__(self, table: Mapping[str, Mapping[str, float]] | None = None) -> None:
        src = paper_accuracy() if table is None else table
        self.table = {t: {m: float(v) for m, v in row.items()} for t, row in src.items()}
        by_model: dict[str, list[float]] = {}
        for row in self.table.values():
            for m, v in row.items():
                by_model.setdefault(m, []).append(v)
        self.model_mean = {m: float(np.mean(v)) for m, v in by_model.items()}
        self._cache: dict[tuple[str | None, tuple[str, ...]], np.ndarray] = {}

    @classmethod
    def paper(cls) -> TaskTable:
        """The SFS paper's accuracy table (Qwen3 0.6B / 8B / 32B on its four tasks)."""
        return cls()

    def qualities(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        task = _task_of(request)
        key = (task, tuple(models))
        out = self._cache.get(key)
        if out is None:
            row = self.table.get(task) if task is not None else None
            values = []
            for m in key[1]:
                if row is not None and m in row:
                    values.append(row[m])
                elif m in self.model_mean:
                    values.append(self.model_mean[m])
                else:
                    raise UnknownModelError(f"model {m!r} is not in the quality table "
                                            f"(models: {', '.join(sorted(self.model_mean))})")
            out = np.array(values)
            if len(self._cache) < 4096:
                self._cache[key] = out
        return out.copy()

    def quality_table(self, requests: QueryTable, models: Sequence[str], *,
                      success: bool = False) -> np.ndarray:
        tasks = requests.task
        distinct = list(dict.fromkeys(tasks))
        rows = np.array([self.qualities(Query(task=t), models) for t in distinct])
        index = {t: i for i, t in enumerate(distinct)}
        out = rows[[index[t] for t in tasks]] if tasks else np.empty((0, len(models)))
        return np.clip(out, 0.0, 1.0) if success else out


class Oracle(QualitySource):
    """The simulator's truth, looked up by request id (simulation only).

    The simulator either feeds a whole request set at once (:meth:`of_table`) or calls
    :meth:`feed` when it draws a request's per-model quality (and, optionally, success
    probability) and :meth:`forget` when the request is done."""

    name = "oracle"

    def __init__(self, ids: Sequence[Hashable] = (), models: Sequence[str] = (),
                 quality: np.ndarray | None = None, success: np.ndarray | None = None) -> None:
        self._quality: dict[Hashable, Mapping[str, float]] = {}
        self._success: dict[Hashable, Mapping[str, float]] = {}
        self._ids = list(ids)
        self._index = {rid: i for i, rid in enumerate(self._ids)}
        self._models = tuple(models)
        self._q = None if quality is None else np.asarray(quality, dtype=np.float64)
        self._s = None if success is None else np.asarray(success, dtype=np.float64)

    @classmethod
    def of_table(cls, ids: Sequence[Hashable], models: Sequence[str], quality: np.ndarray,
                 success: np.ndarray | None = None) -> Oracle:
        """An oracle of a whole request set's truth: ``quality`` (and ``success``) are
        (requests, models) arrays in ``ids`` and ``models`` order."""
        return cls(ids, models, quality, success)

    def feed(self, request_id: Hashable, quality: Mapping[str, float],
             success: Mapping[str, float] | None = None) -> None:
        self._quality[request_id] = quality
        if success is not None:
            self._success[request_id] = success

    def forget(self, request_id: Hashable) -> None:
        self._quality.pop(request_id, None)
        self._success.pop(request_id, None)

    def _row(self, table: dict[Hashable, Mapping[str, float]], matrix: np.ndarray | None,
             rid: Hashable) -> Mapping[str, float] | None:
        row = table.get(rid) if rid is not None else None
        if row is None and matrix is not None and rid in self._index:
            row = dict(zip(self._models, matrix[self._index[rid]].tolist(), strict=True))
        return row

    def _lookup(self, table: dict[Hashable, Mapping[str, float]], matrix: np.ndarray | None,
                request: RequestLike, models: Sequence[str], what: str) -> np.ndarray:
        rid = getattr(request, "id", None)
        row = self._row(table, matrix, rid)
        if row is None:
            raise KeyError(f"oracle: no {what} fed for request {rid!r}")
        try:
            return np.array([row[m] for m in models], dtype=np.float64)
        except KeyError as e:
            raise UnknownModelError(f"oracle: no {what} fed for request {rid!r} and model "
                                    f"{e.args[0]!r}") from None

    def qualities(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        return self._lookup(self._quality, self._q, request, models, "quality")

    def successes(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        rid = getattr(request, "id", None)
        if self._row(self._success, self._s, rid) is not None:
            return self._lookup(self._success, self._s, request, models, "success probability")
        return np.clip(self.qualities(request, models), 0.0, 1.0)

    def quality_table(self, requests: QueryTable, models: Sequence[str], *,
                      success: bool = False) -> np.ndarray:
        if (self._q is None or tuple(models) != self._models or self._quality or self._success
                or requests.id is None or list(requests.id) != self._ids):
            return super().quality_table(requests, models, success=success)
        if success and self._s is not None:
            return self._s.copy()
        return np.clip(self._q, 0.0, 1.0) if success else self._q.copy()


class Trained(QualitySource):
    """A trained predictor. :meth:`predict` gives every head at once (quality, output
    lengths, success) — what a policy that also needs lengths should call."""

    name = "trained"

    def __init__(self, predictor: Predictor | str | Path, *,
                 fallback: QualitySource | None = None) -> None:
        """``fallback`` answers for a head the predictor was not trained with (its quality
        table, say); without one such a question is an error."""
        self.predictor = (predictor if isinstance(predictor, Predictor)
                          else Predictor.load(predictor))
        self.fallback = fallback
        self._quality_head = "quality" in self.predictor.head_rows

    def features(self, request: RequestLike) -> RequestFeatures:
        if isinstance(request, RequestFeatures):
            return request
        if request.features is None:
            request.features = self.predictor.features(request.text, request.task,
                                                       request.tokens)
        return request.features

    def predict(self, request: RequestLike, models: Sequence[str]) -> Predictions:
        return self.predictor.predict(self.features(request), models)

    def qualities(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        if not self._quality_head:
            if self.fallback is not None:
                return self.fallback.qualities(request, models)
            raise ValueError("this predictor has no quality head (its training data had no "
                             "score)")
        q = self.predict(request, models).quality
        assert q is not None
        return q

    def successes(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        pred = self.predict(request, models)
        if pred.success is not None:
            return pred.success
        if self.fallback is not None:
            return self.fallback.successes(request, models)
        if pred.quality is not None:
            return np.clip(pred.quality, 0.0, 1.0)
        raise ValueError("this predictor has neither a success nor a quality head")

    def output_lengths(self, request: RequestLike, models: Sequence[str]) -> np.ndarray | None:
        return self.predict(request, models).length_median

    def output_length_spread(self, request: RequestLike, models: Sequence[str]
                             ) -> tuple[np.ndarray | None, np.ndarray | None]:
        pred = self.predict(request, models)  # (one prediction gives both heads)
        return pred.length_median, pred.length_p90
