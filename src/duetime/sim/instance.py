"""One simulated instance: a compiled engine with the "true" timing, and the live view of it a
router gets (the policies' :class:`~duetime.estimate.base.InstanceView`, with a
``prefix_index`` when the engine caches prefixes: :mod:`duetime.sim.cache_view`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from duetime.engine.engine import Engine
from duetime.engine.forecasting import Forecaster
from duetime.engine.frontend import FrontedEngine, Frontend, FrontendModel
from duetime.engine.snapshot import Snapshot
from duetime.engine.spec import InstanceSpec
from duetime.engine.wait_estimate import LoadBoard
from duetime.estimate.base import InstanceStats
from duetime.sim.cache_view import prefix_index_for

STATS_WINDOW = 256  # recent requests an instance's time-averaged stats look at


class SimClock:
    """The simulated time of the decision being made, shared by a pool's instances: the
    simulator sets it once per decision, not once per instance (90 attribute writes a request
    at 90 instances)."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now


class SimInstance:
    """One simulated instance and the live view of it a router gets. ``now`` is the simulated
    time of the decision being made (set by the simulator before it routes; its ``clock``,
    which the instances of one simulation share).

    ``prefix_index``: the router's view of the engine's prefix cache, ``cache_view``
    ``precise`` (the engine's own cache) or ``estimated`` (learnt from the policies' ``record``
    calls); ``None`` when the spec's config does not enable prefix caching."""

    def __init__(self, name: str, spec: InstanceSpec, *, noise: float = 0.0,
                 cache_view: str = "precise", seed: int | None = None,
                 step_scale: float = 1.0, clock: SimClock | None = None) -> None:
        """``seed``: the engine's step-noise stream (:class:`~duetime.engine.engine.Engine`).
        ``step_scale``: the engine's steps take this many times what ``spec`` (the
        calibration, which ``spec`` keeps) says. ``clock``: the decision time it shares with
        other instances (its own by default)."""
        self.name = name
        self.spec = spec
        self.engine = Engine(spec.config, spec.batch_time.scaled(1.0 / step_scale),
                             noise=noise, seed=seed)
        self.clock = SimClock() if clock is None else clock
        self.prefix_index = prefix_index_for(self.engine, cache_view)
        self.board: LoadBoard | None = None
        self.board_index = -1
        # the spec's API server between the clients and the engine (engine/frontend.py)
        self.fronted = (None if spec.frontend is None
                        else FrontedEngine(self.engine, Frontend(spec.frontend)))

    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, t: float) -> None:
        self.clock.now = t

    def join_board(self, board: LoadBoard, index: int) -> None:
        """Keep the engine's wait summary in row ``index`` of the pool's ``board`` (what a
        router ranks replicas by: :meth:`duetime.estimate.sfs.SfsEstimator.wait_estimates`)."""
        self.board, self.board_index = board, index
        board.attach(self.engine, index)

    # -- time (the simulator's loop): through the frontend where the spec has one ----------

    def busy_until(self) -> float:
        """When the instance next has something to do (inf when nothing): its engine's clock
        while it has work (or, with a frontend, its next hand-off or outputs to send)."""
        if self.fronted is not None:
            return self.fronted.busy_until()
        eng = self.engine
        return math.inf if eng.idle else eng.time

    def submit(self, rid: str, prompt: int, output: int, predicted: int, t: float,
               hashes: Sequence[int] = (), lora: int = 0) -> None:
        """A request sent at ``t`` (the instance has been advanced to ``t``): at the engine's
        waiting tail now, or when its frontend hands it over (``lora``: its adapter)."""
        if self.fronted is None:
            self.engine.add(rid, prompt, output, predicted_output_tokens=predicted, arrival=t,
                            hashes=hashes, lora=lora)
        else:
            self.fronted.submit(rid, prompt, output, t, predicted=predicted, hashes=hashes,
                                lora=lora)

    def advance(self, t: float) -> None:
        """Step until the clock is at ``t`` (the last step may end after it), as
        ``Engine.run_until``; with a frontend, step by step through it
        (:class:`~duetime.engine.frontend.FrontedEngine`)."""
        if self.fronted is None:
            self.engine.run_until(t)
        else:
            self.fronted.advance(t)

    def drain(self) -> None:
        """Run until nothing is left (requests still in the frontend included)."""
        self.advance(math.inf)

    def delivered(self, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(first token, finish) times of requests ``ids`` as their clients see them: the
        engine's, or past the frontend where there is one."""
        if self.fronted is None:
            done = self.engine.lookup(ids)
            return done.first_token, done.finish_time
        got = self.fronted.delivered
        rows = np.array([(got[i].first, got[i].last) if i in got else (math.nan, math.nan)
                         for i in ids], dtype=float).reshape(len(ids), 2)
        return rows[:, 0], rows[:, 1]

    # InstanceView
    @property
    def lora_adapters(self) -> tuple[frozenset[int], int]:
        """The adapters of the requests scheduled and not finished, and ``max_loras``: what
        vLLM's ``vllm:lora_requests_info`` tells a router (its running and waiting lists are
        one list: :meth:`~duetime.engine.engine.Engine.live_adapters`)."""
        return self.engine.live_adapters(), self.engine.config.max_loras

    @property
    def frontend(self) -> FrontendModel | None:
        """The spec's API-server costs (the forecasts add their queue)."""
        return self.spec.frontend

    def frontend_wait_s(self, now: float) -> float:
        """The backlog a request sent ``now`` waits behind at the frontend (the simulator
        knows it exactly)."""
        return 0.0 if self.fronted is None else self.fronted.frontend.wait_s(now)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    @property
    def request_overhead_s(self) -> float:
        """0: the simulator's requests reach the engine at once; with a frontend, a lone
        request's own work there (its queue is the forecast's frontend delay)."""
        fm = self.spec.frontend
        return 0.0 if fm is None else fm.own_s

    def sync(self) -> None:
        """An idle engine's clock brought to ``now`` (the simulator steps only the engines
        with work; an idle one's clock follows the decision's time when it is read); behind a
        frontend, the requests it has handed over by ``now`` queued at the engine
        (:meth:`~duetime.engine.frontend.FrontedEngine.hand_over`)."""
        eng = self.engine
        if eng.idle and eng.time < self.now:
            eng.set_clock(self.now)
        if self.fronted is not None:
            self.fronted.hand_over(self.now)

    def snapshot(self) -> Snapshot:
        self.sync()
        return self.engine.snapshot()

    def forecaster(self) -> Forecaster:
        """The engine's forecaster of its state at ``now`` (kept across decisions:
        :meth:`duetime.engine.engine.Engine.forecaster`)."""
        self.sync()
        return self.engine.forecaster()

    def first_token_floor(self, prompt_tokens: int) -> float:
        """See :meth:`duetime.engine.engine.Engine.first_token_floor` (what a router may
        skip a forecast with)."""
        self.sync()
        return self.engine.first_token_floor(prompt_tokens)

    @property
    def stats(self) -> InstanceStats:
        """Averages over the instance's last ``STATS_WINDOW`` requests, as seen at ``now``."""
        h = self.engine.history(last=STATS_WINDOW)
        if not len(h):
            return InstanceStats()
        arrival, first, fin = h.arrival, h.first_token, h.finish_time
        got_first = first <= self.now
        done = fin <= self.now
        return InstanceStats(
            elapsed_s=max(self.now - float(arrival[0]), 1e-9), arrivals=len(h),
            ttft_s_sum=float((first - arrival)[got_first].sum()),
            ttft_count=int(got_first.sum()),
            e2e_s_sum=float((fin - arrival)[done].sum()), e2e_count=int(done.sum()),
            prompt_tokens_sum=int(h.prompt.sum()), output_tokens_sum=int(h.output[done].sum()))
