"""The forecaster a live engine keeps: its replay read from the engine's own arrays, kept
across decisions, with no snapshot in between.

A :class:`~duetime.engine.forecasting.Forecaster` answers probes of one state from one base
replay. A router asks about the same instances over and over while they change, and what it
pays per decision is mostly fixed cost around a short replay: in the simulator 97-99% of the
forecasts find the queue ahead drained at the base's first step, and the base records one step
(median; ``benchmarks/forecast_reuse.py``). So the engine keeps one forecaster
(:meth:`duetime.engine.engine.Engine.forecaster`) that reuses its base while the engine's
revision does not change and, after any change (a step, an arrival, an end, a new model), reads
the replay arrays straight from the engine's and records the base in one compiled call
(:func:`~duetime.engine.scheduler_kernel.live_base`): the same arrays a snapshot of that state
gives, so every forecast equals ``forecast(engine.snapshot(), ...)`` (tested on random
sequences of engine changes).

Why not shift or repair the base instead: a base from before the change is the new one only
when nothing but steps happened and each went as the replay predicted (no finish, no
preemption, no request at or past its predicted length). Counted by
``benchmarks/forecast_reuse.py`` (``sfs``, the paper's workload, 6,000 requests): at 3
instances 7% of the forecasts find their instance changed so, at 90 instances 0.2%; the usual
change is the one arrival the router sent there (a median of no step since the instance's last
forecast), and the base's first step is then already where that arrival would be admitted.
With prefix caching the base borrows the engine's cache (:mod:`duetime.engine.prefix_state`)
as a snapshot's forecaster does, and keeps its lease between probes; after a change it is read
afresh from the engine's arrays (:meth:`~duetime.engine.engine.Engine.replay_state`), without
the snapshot whose building cost as much as the forecast itself (24 of 66 us on an engine of
two requests).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import (
    DEFAULT_MAX_STEPS,
    Forecaster,
    ForecastError,
    config_array,
    weights_array,
)
from duetime.engine.remaining import DEFAULT_SIGMA
from duetime.engine.snapshot import Snapshot


class LiveEngine(Protocol):
    """What a :class:`LiveForecaster` reads of its engine."""

    config: SchedulerConfig
    model: BatchTimeModel

    @property
    def revision(self) -> tuple[int, int, float]: ...

    @property
    def time(self) -> float: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def cache_table(self) -> np.ndarray | None: ...

    def replay_state(self, sigma: float) -> tuple: ...

    def replay_base(self, sigma: float, state: tuple, rec: np.ndarray, cum: np.ndarray,
                    rec_t: np.ndarray, room: np.ndarray, target: int,
                    max_steps: int) -> tuple[int, int, int]: ...

    def snapshot(self) -> Snapshot: ...


class LiveForecaster(Forecaster):
    """Answers TTFT probes of a live engine's current state (see the module doc). Call
    :meth:`sync` before probing after the engine may have changed:
    :meth:`duetime.engine.engine.Engine.forecaster` does."""

    def __init__(self, engine: LiveEngine, *, sigma: float = DEFAULT_SIGMA,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        self._engine = engine
        self._setup(engine.config, engine.model, sigma, max_steps)
        self._rev: tuple[int, int, float] | None = None
        self._time = 0.0
        self._streams = 0
        self._stale = True  # the base is to be read from the engine at the next extension
        # (with caching: the state borrowed from the engine, None until a probe needs it)
        self._state = None if self._caching else self._buffers(64)
        self.rebuilds = 0  # bases read afresh from the engine (one per revision asked about)

    @property
    def snapshot(self) -> Snapshot:  # type: ignore[override]
        """The engine's snapshot of the state the base replays (built only when asked: for an
        exact fallback replay)."""
        return self._engine.snapshot()

    @property
    def time(self) -> float:
        return self._time

    @property
    def streams(self) -> int:
        return self._streams

    def sync(self) -> LiveForecaster:
        """Follow the engine: a new base when its revision changed since the last probe (read
        from the engine when a probe first needs it)."""
        eng = self._engine
        rev = eng.revision
        if rev != self._rev:
            self._rev = rev
            self._time = eng.time
            self._streams = eng.num_running + eng.num_waiting
            if eng.model is not self._model:
                self._model = eng.model
                if not self._caching:
                    self._state = (*self._state[:7], weights_array(self._model),
                                   *self._state[8:])
            if self._caching:  # (what its base kept on the cache is put back by the next
                # borrower: the engine before it changes the cache, or this base read afresh)
                self._state = None
                self._gen = -1
                self._events = None
            self._stale = True
            self._n = 0
            self._room[:] = 0
            self._done = self._failed = False
        return self

    def _buffers(self, rows: int) -> tuple:
        """Replay arrays with room for ``rows`` requests (kept and refilled: see
        :func:`~duetime.engine.scheduler_kernel.fill_replay`)."""
        return (np.zeros((rows, kn.REQ_COLUMNS), dtype=np.int64), np.empty((rows, 2)),
                np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64),
                np.zeros(kn.ST_SIZE, dtype=np.int64), np.zeros(1), config_array(self.config),
                weights_array(self._model), *kn.NO_POOL)

    def _fresh_state(self) -> tuple:
        """With prefix caching: the engine's current state, its cache borrowed."""
        self.rebuilds += 1
        return self._engine.replay_state(self.sigma)

    def _check_cache(self) -> None:
        if self._engine.revision != self._rev:
            raise ForecastError("live forecaster: the engine has changed since sync(); a "
                                "forecast with prefix caching needs its current state")

    def _cache_table(self) -> np.ndarray | None:
        return self._engine.cache_table

    def _extend(self, more: int) -> bool:
        if self._caching or not self._stale:  # (with caching: a fresh base from the engine
            return super()._extend(more)       # whenever the lease is lost, _fresh_state)
        self._stale = False
        self.rebuilds += 1
        target = max(more, 1)
        while True:  # one compiled call: the engine's state read in, the base recorded
            code, n, rows = self._engine.replay_base(self.sigma, self._state[:8], self._rec,
                                                     self._cum, self._rec_t, self._room,
                                                     target, self.max_steps)
            if n >= 0:
                break
            self._state = self._buffers(2 * rows)
        self._n = n
        if code == kn.FULL:
            self._grow_record()
            code = self._record(self._state, target)
        self._ended(code)
        return self._n > 0
