"""One simulated instance: a compiled engine with the "true" timing, and the live view of it a
router gets (the policies' :class:`~duetime.estimate.base.InstanceView`, with a
``prefix_index`` when the engine caches prefixes: :mod:`duetime.sim.cache_view`)."""

from __future__ import annotations

from duetime.engine.engine import Engine
from duetime.engine.snapshot import Snapshot
from duetime.engine.spec import InstanceSpec
from duetime.engine.wait_estimate import LoadBoard
from duetime.estimate.base import InstanceStats
from duetime.sim.cache_view import prefix_index_for

STATS_WINDOW = 256  # recent requests an instance's time-averaged stats look at


class SimInstance:
    """One simulated instance and the live view of it a router gets. ``now`` is the simulated
    time of the decision being made (set by the simulator before it routes).

    ``prefix_index``: the router's view of the engine's prefix cache, ``cache_view``
    ``precise`` (the engine's own cache) or ``estimated`` (learnt from the policies' ``record``
    calls); ``None`` when the spec's config does not enable prefix caching."""

    def __init__(self, name: str, spec: InstanceSpec, *, noise: float = 0.0,
                 cache_view: str = "precise", seed: int | None = None) -> None:
        """``seed``: the engine's step-noise stream (:class:`~duetime.engine.engine.Engine`)."""
        self.name = name
        self.spec = spec
        self.engine = Engine(spec.config, spec.batch_time, noise=noise, seed=seed)
        self.now = 0.0
        self.prefix_index = prefix_index_for(self.engine, cache_view)
        self.board: LoadBoard | None = None
        self.board_index = -1

    def join_board(self, board: LoadBoard, index: int) -> None:
        """Keep the engine's wait summary in row ``index`` of the pool's ``board`` (what a
        router ranks replicas by: :meth:`duetime.estimate.sfs.SfsEstimator.wait_estimates`)."""
        self.board, self.board_index = board, index
        board.attach(self.engine, index)

    # InstanceView
    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    request_overhead_s = 0.0  # the simulator's requests reach the engine at once

    def sync(self) -> None:
        """An idle engine's clock brought to ``now`` (the simulator steps only the engines
        with work; an idle one's clock follows the decision's time when it is read)."""
        eng = self.engine
        if eng.idle and eng.time < self.now:
            eng.set_clock(self.now)

    def snapshot(self) -> Snapshot:
        self.sync()
        return self.engine.snapshot()

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
