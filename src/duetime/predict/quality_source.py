"""Where a routing policy gets a request's quality (and success probability) per model.

Three sources behind one interface, all vectorised over the candidate models of one request
(the policy's hot path asks once per request, not once per model):

* :class:`TaskTable`: a per-(task, model) table; the default is the SFS paper's judged
  accuracy (``paper_accuracy.yaml``). What the paper's own simulation used.
* :class:`Oracle`: the true per-request quality, fed by the simulator that drew it
  (simulation only: a real router never knows it). The upper bound for any predictor.
* :class:`Trained`: a predictor directory from ``duetime predict train``.

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


class Oracle(QualitySource):
    """The simulator's truth, looked up by request id (simulation only).

    The simulator calls :meth:`feed` when it draws a request's per-model quality (and,
    optionally, success probability) and :meth:`forget` when the request is done."""

    name = "oracle"

    def __init__(self) -> None:
        self._quality: dict[Hashable, Mapping[str, float]] = {}
        self._success: dict[Hashable, Mapping[str, float]] = {}

    def feed(self, request_id: Hashable, quality: Mapping[str, float],
             success: Mapping[str, float] | None = None) -> None:
        self._quality[request_id] = quality
        if success is not None:
            self._success[request_id] = success

    def forget(self, request_id: Hashable) -> None:
        self._quality.pop(request_id, None)
        self._success.pop(request_id, None)

    def _lookup(self, table: dict[Hashable, Mapping[str, float]], request: RequestLike,
                models: Sequence[str], what: str) -> np.ndarray:
        rid = getattr(request, "id", None)
        row = table.get(rid) if rid is not None else None
        if row is None:
            raise KeyError(f"oracle: no {what} fed for request {rid!r}")
        try:
            return np.array([row[m] for m in models], dtype=np.float64)
        except KeyError as e:
            raise UnknownModelError(f"oracle: no {what} fed for request {rid!r} and model "
                                    f"{e.args[0]!r}") from None

    def qualities(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        return self._lookup(self._quality, request, models, "quality")

    def successes(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        rid = getattr(request, "id", None)
        if rid in self._success:
            return self._lookup(self._success, request, models, "success probability")
        return np.clip(self.qualities(request, models), 0.0, 1.0)


class Trained(QualitySource):
    """A trained predictor. :meth:`predict` gives every head at once (quality, output
    lengths, success) — what a policy that also needs lengths should call."""

    name = "trained"

    def __init__(self, predictor: Predictor | str | Path) -> None:
        self.predictor = (predictor if isinstance(predictor, Predictor)
                          else Predictor.load(predictor))
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
            raise ValueError("this predictor has no quality head (its training data had no "
                             "score)")
        q = self.predict(request, models).quality
        assert q is not None
        return q

    def successes(self, request: RequestLike, models: Sequence[str]) -> np.ndarray:
        pred = self.predict(request, models)
        if pred.success is not None:
            return pred.success
        if pred.quality is not None:
            return np.clip(pred.quality, 0.0, 1.0)
        raise ValueError("this predictor has neither a success nor a quality head")
