"""SFS: replay the instance's scheduler forward from its snapshot (the engine's forecast)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import Forecaster, ForecastError, forecast
from duetime.engine.wait_estimate import LoadBoard
from duetime.estimate.base import InstanceView, PromptHashes, forecaster_of, with_gateway
from duetime.estimate.correction import correction_factor


def _keys(config: SchedulerConfig, hashes: PromptHashes | None) -> Sequence[int] | None:
    """The prompt's block keys at the instance's block size, if it caches prefixes."""
    if hashes is None or not config.enable_prefix_caching:
        return None
    return hashes(config.block_size)


def _board_rows(views: Sequence[InstanceView]) -> tuple[LoadBoard | None, np.ndarray]:
    """The board every view keeps its summary on and each view's row (``None`` if they do
    not all share one)."""
    board = getattr(views[0], "board", None) if views else None
    rows = np.empty(len(views), dtype=np.int64)
    for k, v in enumerate(views):
        if board is None or getattr(v, "board", None) is not board:
            return None, rows
        rows[k] = v.board_index
    return board, rows


def frontend_delay(view: InstanceView, fc: Forecaster, now: float) -> float:
    """What the view's serving frontend (a ``frontend`` attribute:
    :class:`~duetime.engine.frontend.FrontendModel`; none, nothing) adds to a request sent
    ``now`` beyond its own work: its server's backlog (``frontend_wait_s(now)`` where the view
    tracks one) and the chunks of the streams in its first token's step (the running and
    waiting requests of the forecast's state, up to ``max_num_seqs``)."""
    fm = getattr(view, "frontend", None)
    if fm is None:
        return 0.0
    wait = getattr(view, "frontend_wait_s", None)
    streams = min(fc.streams, fc.config.max_num_seqs)
    return fm.delay_s(0.0 if wait is None else wait(now), streams)


class SfsEstimator:
    name = "sfs"

    def __init__(self) -> None:
        # the board rows of the last immutable views asked about (see wait_estimates)
        self._rows: tuple[Sequence[InstanceView], LoadBoard | None, np.ndarray] | None = None

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float, *,
             hashes: PromptHashes | None = None, lora: int = 0) -> float:
        """Seconds from ``now`` to a new request's first token (inf if it cannot be served
        there: too long, KV too small). With prefix caching the replay prices the prompt's
        cached blocks (``hashes``) and what the requests ahead cache and evict; on adapter
        ``lora`` it replays the ``max_loras`` cap (the request skipped while the step's
        adapters are others). A view with an
        online correction (``ttft_correction``, :mod:`duetime.estimate.correction`) scales the
        instance's part by its factor; a gateway's own delay is a floor under it
        (:func:`~duetime.estimate.base.with_gateway`)."""
        fc = forecaster_of(view)
        try:
            est = fc.ttft(prompt_tokens, _keys(fc.config, hashes), lora=lora).estimate_s
        except ForecastError:
            return float("inf")
        return with_gateway(view, (est + (fc.time - now) + view.request_overhead_s
                                   + frontend_delay(view, fc, now)) * correction_factor(view))

    def ttft_lower_bound(self, view: InstanceView, prompt_tokens: int, now: float) -> float:
        """A bound :meth:`ttft` cannot go below, without a forecast: from the view's
        ``first_token_floor`` (its engine's, when the view has one; else 0). A router skips
        the forecasts of candidates whose bound already loses."""
        floor = getattr(view, "first_token_floor", None)
        if floor is None:
            return 0.0
        return (floor(prompt_tokens) - now + view.request_overhead_s) * correction_factor(view)

    def wait_estimates(self, views: Sequence[InstanceView], which: Sequence[int],
                       prompt_tokens: int, now: float) -> np.ndarray | None:
        """Cheap estimates of :meth:`ttft` for the views ``which`` at once, to rank replicas
        by (:mod:`duetime.engine.wait_estimate`: no replay; mostly a little below the
        forecast; engine time only, no overhead or correction), when every view keeps its
        engine's summary on one board (``board``, ``board_index``: the simulator's
        instances); else ``None``. The rows of an immutable ``views`` (a tuple) are looked up
        once."""
        cached = self._rows
        if cached is not None and cached[0] is views:
            board, rows = cached[1], cached[2]
        else:
            board, rows = _board_rows(views)
            if isinstance(views, tuple):
                self._rows = (views, board, rows)
        if board is None:
            return None
        return board.estimates(rows[np.asarray(which, dtype=np.int64)], prompt_tokens, now)

    def finishes(self, view: InstanceView, prompt_tokens: int, output_tokens: Sequence[int],
                 now: float) -> np.ndarray:
        """Seconds from ``now`` until a new request finishes, for each of several output
        lengths (a length distribution's quantiles): the view's kept forecaster answers them
        from one base trajectory (:meth:`~duetime.engine.forecasting.Forecaster.finish`), plus
        the request overhead, as the client sees it; inf where it cannot be served there."""
        fc = forecaster_of(view)
        try:
            got = fc.finish(prompt_tokens, output_tokens)
        except ForecastError:
            return np.full(len(output_tokens), np.inf)
        shift = fc.time - now + view.request_overhead_s
        return np.array([f.estimate_s + shift for f in got])

    def e2e(self, view: InstanceView, prompt_tokens: int, output_tokens: int,
            now: float, *, hashes: PromptHashes | None = None, lora: int = 0) -> float:
        """Seconds from ``now`` until a new request of ``output_tokens`` output tokens finishes
        (the replay until its end; inf if it cannot be served there). Like the TTCA router has
        always done, it counts engine time only (no request overhead)."""
        snap = view.snapshot()
        try:
            return forecast(snap, prompt_tokens, output_tokens, until="finish",
                            prompt_hashes=_keys(snap.config, hashes),
                            lora=lora).estimate_s + (
                                snap.time - now)
        except ForecastError:
            return float("inf")
