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

from collections.abc import Callable, Sequence
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
        self._time = eng.time  # (an engine's revision moves with its clock; a RowState's not)
        if rev != self._rev:
            self._rev = rev
            self._streams = eng.num_running + eng.num_waiting
            if eng.model is not self._model:
                self._model = eng.model
                self._lora_priced = bool(self._loras) and self._model.prices_lora
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
                weights_array(self._model), *kn.NO_POOL,
                kn.adapter_scratch(self.config.max_loras, rows))

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
        self.rebuilds += 1
        target = max(more, 1)
        while True:  # one compiled call: the engine's state read in, the base recorded
            code, n, rows = self._engine.replay_base(self.sigma, (*self._state[:8],
                                                                  self._state[13]), self._rec,
                                                     self._cum, self._rec_t, self._room,
                                                     target, self.max_steps)
            if n >= 0:
                break
            if rows < 0:  # (as a snapshot's replay refuses it; only a RowState can be so)
                raise ForecastError("state: the running requests hold more KV blocks than "
                                    f"the instance has ({self.config.usable_blocks} usable)")
            self._state = self._buffers(2 * rows)
        self._stale = False  # (after the call: a state it refused is refused at every probe)
        self._n = n
        if code == kn.FULL:
            self._grow_record()
            code = self._record(self._state, target)
        self._ended(code)
        return self._n > 0


class RowState:
    """A :class:`LiveEngine` whose state is set from outside, not stepped: request rows written
    by their owner and put in order (running, then waiting), for a forecaster kept across the
    owner's changes — e.g. a gateway's published snapshot merged with its own dispatches
    (:mod:`duetime.gateway.state.published`). Without prefix caching.

    Its revision changes when the rows or their order do, not with :meth:`date`: forecasts
    are measured from :attr:`time` and do not depend on it, so re-dating a state keeps its
    base. ``snapshot``: makes the same state as a snapshot (for a forecast that needs an exact
    replay; called only then)."""

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel,
                 snapshot: Callable[[], Snapshot]) -> None:
        if config.enable_prefix_caching:
            raise ValueError("RowState holds no cache: it serves instances without caching")
        self.config = config
        self.model = model
        self._snapshot = snapshot
        self._req = np.zeros((0, kn.REQ_COLUMNS), dtype=np.int64)
        self._pred = np.zeros(0, dtype=np.int64)
        self._run = np.zeros(0, dtype=np.int64)
        self._wq = np.zeros(0, dtype=np.int64)
        self._st = np.zeros(kn.ST_SIZE, dtype=np.int64)
        self._time = 0.0
        self._revision = 0
        self._live: LiveForecaster | None = None

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Room for ``n`` rows; returns (req, pred): a row's prompt, computed and output tokens
        in ``req[r, PROMPT | COMP | OUTPUT]``, its predicted output length in ``pred[r]``.
        Rows are kept (grown, never cleared) until overwritten."""
        if n > self._req.shape[0]:
            m = max(n, 2 * self._req.shape[0], 16)
            req = np.zeros((m, kn.REQ_COLUMNS), dtype=np.int64)
            req[:self._req.shape[0]] = self._req
            pred = np.zeros(m, dtype=np.int64)
            pred[:self._pred.shape[0]] = self._pred
            self._req, self._pred = req, pred
            self._run = np.zeros(m, dtype=np.int64)
            self._wq = np.zeros(m + 1, dtype=np.int64)
        return self._req, self._pred

    def order(self, running: np.ndarray, waiting: np.ndarray,
              more_running: Sequence[int] = (), more_waiting: Sequence[int] = ()) -> None:
        """The rows in scheduler order: ``running`` rows then ``more_running``, then the
        waiting queue from its head, ``waiting`` then ``more_waiting`` (all within
        :meth:`rows`' room). A new revision."""
        a, b = len(running), len(waiting)
        nr, nw = a + len(more_running), b + len(more_waiting)
        if nr + nw > self._req.shape[0]:
            raise ValueError("RowState.order: more rows than its room (call rows() first)")
        self._run[:a] = running
        self._wq[:b] = waiting
        if more_running:
            self._run[a:nr] = more_running
        if more_waiting:
            self._wq[b:nw] = more_waiting
        st = self._st
        st[kn.NRUN], st[kn.WC] = nr, nw
        self._revision += 1

    def date(self, time: float) -> None:
        """The state's clock (forecasts count from it); the base stays."""
        self._time = time

    def forecaster(self) -> LiveForecaster:
        """The forecaster kept across changes (as :meth:`duetime.engine.engine.Engine.
        forecaster`)."""
        live = self._live
        if live is None:
            live = self._live = LiveForecaster(self)
        return live.sync()

    # -- LiveEngine -----------------------------------------------------------------------------

    @property
    def revision(self) -> tuple[int, int, float]:
        return (self._revision, 0, 0.0)

    @property
    def time(self) -> float:
        return self._time

    @property
    def num_running(self) -> int:
        return int(self._st[kn.NRUN])

    @property
    def num_waiting(self) -> int:
        return int(self._st[kn.WC])

    @property
    def cache_table(self) -> np.ndarray | None:
        return None

    def replay_state(self, sigma: float) -> tuple:
        raise ForecastError("RowState has no prefix cache")

    def replay_base(self, sigma: float, state: tuple, rec: np.ndarray, cum: np.ndarray,
                    rec_t: np.ndarray, room: np.ndarray, target: int,
                    max_steps: int) -> tuple[int, int, int]:
        return kn.live_base(self._req, self._pred, self._run, self._wq, self._st, sigma, *state,
                            rec, cum, rec_t, room, target, max_steps)

    def snapshot(self) -> Snapshot:
        return self._snapshot()
