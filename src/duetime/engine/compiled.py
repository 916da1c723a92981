"""A stepping engine on the compiled kernel: the instance model for simulators and emulators.

Same API shape as :class:`~duetime.engine.scheduler.ReferenceEngine` (add requests at step
boundaries, step, read what happened) and the same rules, step for step (tested), at compiled
speed: a step over a few hundred resident requests costs microseconds, so a simulated instance
or an emulated server can run many times faster than real time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from duetime.engine import kernel as kn
from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.scheduler import EngineStuck
from duetime.engine.snapshot import RequestTable, Snapshot


@dataclass(slots=True)
class StepEvents:
    """What one step did: its start and end, and which requests got their first token or
    finished at its end, and how many were preempted."""

    index: int
    start: float
    end: float
    scheduled: int
    first_token: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: int = 0


class Engine:
    """One instance's scheduler, replayed by the compiled kernel.

    ``add`` queues a request at the tail of the waiting queue; ``step`` runs one scheduler step
    and returns its :class:`StepEvents` (``None`` when there is nothing to do). Request ids are
    strings and must be unique. Rows of finished requests are not reused; the arrays grow by
    doubling.
    """

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 capacity: int = 256, noise: float = 0.0, seed: int | None = None) -> None:
        """``noise`` > 0: each step's duration is multiplied by a mean-one log-normal factor
        with this log-space spread (a simulated instance's "true" timing). ``seed`` seeds the
        (process-global) generator of that noise."""
        self.config = config
        self.model = model
        self.noise = float(noise)
        if seed is not None:
            kn.seed(seed)
        n = max(capacity, 4)
        self._req = np.zeros((n, 6), dtype=np.int64)
        self._stamps = np.full((n, 2), np.nan)
        self._run = np.zeros(n, dtype=np.int64)
        self._wq = np.zeros(n, dtype=np.int64)
        self._st = np.zeros(5, dtype=np.int64)
        self._st[kn.FREE] = config.num_gpu_blocks
        self._clock = np.array([float(time)])
        self._cfg = np.array([config.max_num_batched_tokens, config.chunk_cap,
                              config.max_num_seqs, config.max_model_len, config.block_size,
                              config.num_gpu_blocks, kn.block_shift(config.block_size)],
                             dtype=np.int64)
        self._w = np.array(model.weights, dtype=np.float64)
        self._work = np.zeros((2, n), dtype=np.int64)
        self._out = np.zeros(8, dtype=np.int64)
        self._pred = np.zeros(n, dtype=np.int64)  # predicted output length (the router's view)
        self._arrival = np.zeros(n)
        self._ids: list[str] = []
        self._rows: dict[str, int] = {}

    # -- state ----------------------------------------------------------------------------------

    @property
    def time(self) -> float:
        return float(self._clock[0])

    @property
    def steps(self) -> int:
        return int(self._st[kn.K])

    @property
    def num_running(self) -> int:
        return int(self._st[kn.NRUN])

    @property
    def num_waiting(self) -> int:
        return int(self._st[kn.WC])

    @property
    def free_blocks(self) -> int:
        return int(self._st[kn.FREE])

    @property
    def idle(self) -> bool:
        return self._st[kn.NRUN] == 0 and self._st[kn.WC] == 0

    def advance_clock(self, t: float) -> None:
        """Move an idle engine's clock forward to ``t`` (an arrival after a quiet spell)."""
        if not self.idle:
            raise RuntimeError("advance_clock: the engine is busy; step it instead")
        self._clock[0] = max(self._clock[0], t)

    def request(self, request_id: str) -> dict[str, object]:
        """A request's current state (tokens, and stamps as floats or None)."""
        r = self._rows[request_id]
        row = self._req[r].tolist()
        first, fin = self._stamps[r].tolist()
        return {"id": request_id, "prompt_tokens": row[kn.PROMPT], "output_tokens": row[kn.OUTPUT],
                "stop": row[kn.STOP], "computed_tokens": row[kn.COMP], "blocks": row[kn.BLOCKS],
                "finished": bool(row[kn.DONE]),
                "first_token": None if first != first else first,
                "finish_time": None if fin != fin else fin}

    def running_ids(self) -> list[str]:
        return [self._ids[r] for r in self._run[:self._st[kn.NRUN]].tolist()]

    def waiting_ids(self) -> list[str]:
        n = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        return [self._ids[int(self._wq[(h + i) % n])] for i in range(c)]

    # -- stepping API ---------------------------------------------------------------------------

    def add(self, request_id: str, prompt_tokens: int, stop: int, *,
            output_tokens: int = 0, predicted_output_tokens: int | None = None,
            arrival: float | None = None) -> int:
        """Queue a request (``stop``: the output length it stops at) at the waiting tail.

        ``predicted_output_tokens`` (default: ``stop``) is what :meth:`snapshot` shows a router.
        Returns the request's row (for :meth:`stamps`)."""
        if request_id in self._rows:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        if prompt_tokens < 1 or stop < 1 or output_tokens < 0:
            raise ValueError("prompt_tokens and stop must be >= 1, output_tokens >= 0")
        if prompt_tokens + output_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request_id!r}: {prompt_tokens + output_tokens} tokens "
                             f"reach max_model_len {self.config.max_model_len}")
        r = len(self._ids)
        if r >= self._req.shape[0]:
            self._grow()
        self._ids.append(request_id)
        self._rows[request_id] = r
        self._req[r] = (prompt_tokens, output_tokens, stop, 0, 0, 0)
        self._pred[r] = stop if predicted_output_tokens is None else predicted_output_tokens
        self._arrival[r] = self._clock[0] if arrival is None else arrival
        n = self._wq.shape[0]
        self._wq[(self._st[kn.WH] + self._st[kn.WC]) % n] = r
        self._st[kn.WC] += 1
        return r

    def _grow(self) -> None:
        old = self._req.shape[0]
        new = 2 * old
        waiting = [int(self._wq[(self._st[kn.WH] + i) % old]) for i in range(self._st[kn.WC])]
        self._req = np.concatenate((self._req, np.zeros((old, 6), dtype=np.int64)))
        self._stamps = np.concatenate((self._stamps, np.full((old, 2), np.nan)))
        self._run = np.concatenate((self._run, np.zeros(old, dtype=np.int64)))
        self._pred = np.concatenate((self._pred, np.zeros(old, dtype=np.int64)))
        self._arrival = np.concatenate((self._arrival, np.zeros(old)))
        self._wq = np.zeros(new, dtype=np.int64)
        self._wq[:len(waiting)] = waiting
        self._st[kn.WH] = 0
        self._work = np.zeros((2, new), dtype=np.int64)

    def step(self) -> StepEvents | None:
        """Run one scheduler step; ``None`` when there is nothing to do."""
        if self.idle:
            return None
        start = float(self._clock[0])
        got = kn.step(self._req, self._stamps, self._run, self._wq, self._st, self._clock,
                      self._cfg, self._w, self._work, self._out, self.noise)
        out = self._out
        self._raise_if_stuck(got, int(out[4]))
        ids = self._ids
        return StepEvents(int(self._st[kn.K]) - 1, start, float(self._clock[0]), got,
                          [ids[r] for r in self._work[1, :out[5]].tolist()],
                          [ids[r] for r in self._work[0, :out[6]].tolist()], int(out[7]))

    def _raise_if_stuck(self, code: int, row: int) -> None:
        if code == kn.TOO_BIG:
            raise EngineStuck(f"request {self._ids[row]!r} needs more KV blocks than the "
                              f"instance has ({self.config.num_gpu_blocks})")
        if code == kn.STUCK:
            raise EngineStuck("no request can be scheduled: the waiting queue's head needs "
                              "more KV blocks than can be freed")

    def run_until(self, t: float, *, stop_on_finish: bool = False) -> list[str]:
        """Step while the clock is before ``t`` (the last step may end after it); an idle
        engine's clock jumps to ``t``. With ``stop_on_finish`` it returns early, after the first
        step in which requests finished, and returns their ids (else ``[]``)."""
        code, detail = kn.run_until(self._req, self._stamps, self._run, self._wq, self._st,
                                    self._clock, self._cfg, self._w, self._work, self._out,
                                    t, stop_on_finish, self.noise)
        self._raise_if_stuck(code, detail)
        if code == kn.IDLE and t != float("inf"):
            self._clock[0] = max(self._clock[0], t)
        if code == kn.FINISHED:
            return [self._ids[r] for r in self._work[0, :self._out[6]].tolist()]
        return []

    def drain(self) -> None:
        """Run until idle (the clock stays at the last step's end)."""
        self.run_until(float("inf"))

    def stamps(self) -> np.ndarray:
        """First-token and finish times per row, in the order requests were added (NaN until
        stamped). A view: copy it if you keep it."""
        return self._stamps[:len(self._ids)]

    def snapshot(self, time: float | None = None) -> Snapshot:
        """The router's view: running and waiting requests in scheduler order, with their
        *predicted* output lengths, at the engine's clock (or ``time``)."""
        nrun = int(self._st[kn.NRUN])
        rows_r = self._run[:nrun]
        n = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        rows_w = self._wq[(h + np.arange(c)) % n] if c else np.zeros(0, dtype=np.int64)
        req, ids = self._req, self._ids

        def table(rows: np.ndarray) -> RequestTable:
            return RequestTable([ids[r] for r in rows.tolist()], req[rows, kn.PROMPT],
                                req[rows, kn.COMP], req[rows, kn.OUTPUT], self._pred[rows],
                                self._arrival[rows])

        return Snapshot(self.config, self.model,
                        time=float(self._clock[0]) if time is None else time,
                        running=table(rows_r), waiting=table(rows_w))
