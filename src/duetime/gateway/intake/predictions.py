"""What the request's policy consumes about the request itself, predicted per model: quality,
success probability and output length (median and, where predicted, p90), asked of the pool's
quality source (its
per-task table, or its trained predictor with the table as fallback) only when consumed, and
``None`` otherwise (:mod:`duetime.policy.registry`)."""

from __future__ import annotations

import numpy as np

from duetime.gateway.config import Pool
from duetime.gateway.intake.controls import MEAN_TASK
from duetime.policy.registry import OUTPUT_LENGTH, QUALITY, SUCCESS
from duetime.predict.quality_source import QualitySource, Query, TaskTable
from duetime.web.requests import CompletionRequest, prompt_texts

PerModel = dict[str, float] | None


class Predictions:
    """The pool's quality source, asked per request."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        tasks = list(pool.quality)
        table = TaskTable({t: {m: pool.quality[t][m] for m in pool.models} for t in tasks})
        self.source: QualitySource = table
        if pool.predictor is not None:
            from duetime.predict.quality_source import Trained
            self.source = Trained(pool.predictor, fallback=table)

    def predict(self, req: CompletionRequest, task: str,
                needs: frozenset[str]) -> tuple[PerModel, PerModel, PerModel, PerModel]:
        """Per model, what ``needs`` (a policy's inputs) asks for: quality, success
        probability, output length (median) and its 90th percentile; None where not
        consumed (or, for lengths, not predicted)."""
        if not needs & {QUALITY, SUCCESS, OUTPUT_LENGTH}:
            return None, None, None, None
        models = self.pool.models
        text = "\n".join(prompt_texts(req)) if self.pool.predictor is not None else ""
        query = Query(text, None if task == MEAN_TASK else task, tokens=req.prompt_tokens)

        def per_model(values: np.ndarray | None) -> PerModel:
            return None if values is None else dict(zip(models, values.tolist(), strict=True))

        src = self.source
        median = p90 = None
        if OUTPUT_LENGTH in needs:
            median, p90 = src.output_length_spread(query, models)
        return (per_model(src.qualities(query, models)) if QUALITY in needs else None,
                per_model(src.successes(query, models)) if SUCCESS in needs else None,
                per_model(median), per_model(p90))
