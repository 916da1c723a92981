"""A stepping engine on the compiled kernel: the instance model of the simulator, the emulator's
clock and the gateway's shadow replica.

Same rules as :class:`~duetime.engine.scheduler.ReferenceEngine`, step for step (tested), at
compiled speed: a step over a few hundred resident requests costs microseconds. Besides the
scheduler's own operations (``add`` at the waiting tail, ``step``, ``run_until``) it owns the
operations a live server needs, all by request id:

* ``abort``: a client went away (or the request finished elsewhere): it leaves the batch at once
  and frees its KV blocks (vLLM's ``abort_requests``);
* ``observe`` / ``observe_many``: a request is known to have produced ``n`` tokens (a router saw
  them stream): its prefill is done and it decodes from there;
* ``set_clock`` / ``advance_clock``: the engine's clock follows a real one;
* ``compact``: forget finished requests (``retain_finished=False`` does it by itself).

Every read is public and read-only (:meth:`request`, :meth:`lookup`, :meth:`history`,
:meth:`running_ids`, :meth:`snapshot`); the arrays behind them (layout in
:mod:`duetime.engine.scheduler_kernel`) never leave this module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.block_pool_kernel import (
    drop_keys,
    key_match,
    new_key_map,
    new_pool,
    new_undo,
    pool_allocate,
    pool_release,
    queue_of,
    reclaim,
    store_free,
)
from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import Forecaster, config_array, replay_state, weights_array
from duetime.engine.kv import blocks_for, stuck_reason
from duetime.engine.kv_kernel import HELD, kv_release, kv_take
from duetime.engine.live_forecast import LiveForecaster
from duetime.engine.prefix_state import PrefixState, with_room
from duetime.engine.scheduler import EngineStuck
from duetime.engine.snapshot import RequestTable, Snapshot
from duetime.engine.wait_estimate import run_until_publishing, summarize

ASYNC_COLUMNS = [kn.PEND, kn.INF, kn.NINF, kn.STALE]  # what an observation settles
COMPACT_AT = 4096  # without retained history: reclaim finished rows past this many rows


@dataclass(slots=True)
class StepEvents:
    """What one step did: its start and end, how many requests it scheduled and preempted,
    which requests got their first token or finished at its end, and (:attr:`tokens`) which
    produced an output token (vLLM's per-step engine outputs)."""

    index: int
    start: float
    end: float
    scheduled: int
    first_token_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted: int = 0
    _made: np.ndarray | None = field(default=None, repr=False)
    _ids: list[str] | None = field(default=None, repr=False)
    # when the outputs listed (first_token_ids, finished_ids, tokens) were made: the step's end; with
    # asynchronous scheduling they are the previous step's, made at this step's start
    outputs_at: float = math.nan
    # prefix caching: tokens of the requests admitted after a cache lookup, and of those the
    # tokens found cached (vLLM's prefix_cache_queries / prefix_cache_hits)
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def tokens(self) -> list[str]:
        """Ids of the requests that produced one output token in this step (when the step was
        asked for them: ``Engine.step(tokens=True)``; else empty)."""
        if self._made is None or self._ids is None:
            return []
        ids = self._ids
        return [ids[r] for r in self._made.tolist()]


class RequestColumns:
    """Requests' state column by column, read-only (copies, or views that cannot be written):
    ``prompt``, ``output``, ``computed``, ``stop``, ``predicted``, ``arrival``, ``first_token``
    and ``finish_time`` (NaN until stamped; an aborted request's finish time is the clock when
    it was aborted), ``finished``; ``ids`` in the same order."""

    __slots__ = ("_done", "_ids", "arrival", "computed", "finish_time", "first_token", "output",
                 "predicted", "prompt", "stop")

    def __init__(self, ids, prompt: np.ndarray, output: np.ndarray, computed: np.ndarray,
                 stop: np.ndarray, predicted: np.ndarray, arrival: np.ndarray,
                 first_token: np.ndarray, finish_time: np.ndarray, done: np.ndarray) -> None:
        self._ids = ids  # a list, or a callable that makes it (built when first read)
        self.prompt = prompt
        self.output = output
        self.computed = computed
        self.stop = stop
        self.predicted = predicted
        self.arrival = arrival
        self.first_token = first_token
        self.finish_time = finish_time
        self._done = done

    @property
    def ids(self) -> list[str]:
        if callable(self._ids):
            self._ids = self._ids()
        return self._ids

    @property
    def finished(self) -> np.ndarray:
        return self._done == 1

    def __len__(self) -> int:
        return len(self.prompt)


class Engine:
    """One instance's scheduler, replayed by the compiled kernel.

    ``add`` queues a request at the tail of the waiting queue; ``step`` runs one scheduler step
    and returns its :class:`StepEvents` (``None`` when there is nothing to do). Request ids are
    strings, unique over the engine's life. Finished requests are kept (their times stay
    readable) unless ``retain_finished`` is False; the arrays grow by doubling.
    """

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 capacity: int = 256, noise: float = 0.0, seed: int | None = None,
                 retain_finished: bool = True) -> None:
        """``noise`` > 0: each step's duration is multiplied by a mean-one log-normal factor
        with this log-space spread (a simulated instance's "true" timing). ``seed``: the
        engine's own noise stream (step k's factor is a function of the seed and k, whenever
        the engine is stepped); default a random one. ``retain_finished`` False: rows of finished
        requests are reclaimed once the arrays hold more than ``COMPACT_AT`` rows, mostly
        finished (a server that runs for days)."""
        self.config = config
        self.model = model
        self.noise = float(noise)
        self.retain_finished = retain_finished
        n = max(capacity, 4)
        self._req = np.zeros((n, kn.REQ_COLUMNS), dtype=np.int64)
        self._stamps = np.full((n, 2), np.nan)
        self._run = np.zeros(n, dtype=np.int64)
        self._wq = np.zeros(n, dtype=np.int64)
        self._st = np.zeros(kn.ST_SIZE, dtype=np.int64)
        self._st[kn.LONE] = -1
        self._st[kn.FREE] = config.usable_blocks
        self._st[kn.NSEED] = (int.from_bytes(os.urandom(7), "little") if seed is None
                              else int(seed) & ((1 << 62) - 1))
        self._clock = np.array([float(time)])
        self._cfg = config_array(config)
        self._w = weights_array(model)
        self._floor_w = self._floor_weights()
        self._work = np.zeros((kn.WORK_ROWS, n), dtype=np.int64)
        self._adapters = kn.adapter_scratch(config.max_loras, n)  # (None without LoRA)
        self._out = np.zeros(kn.OUT_SIZE, dtype=np.int64)
        # prefix caching: the block pool and the arenas of blocks and known keys (kernel doc)
        self.caching = config.enable_prefix_caching
        if self.caching:
            self._pool = new_pool(config.num_gpu_blocks)
            self._kmap = new_key_map(config.num_gpu_blocks)
            self._undo = new_undo(self._pool, self._kmap)  # for forecasts (prefix_state)
            self._rb = np.zeros(1024, dtype=np.int64)
            self._rk = np.zeros(1024, dtype=np.int64)
        else:
            self._pool, self._kmap, self._rb, self._rk, self._undo = kn.NO_POOL
        self._rb_used = self._rk_used = self._uid = 0
        self._rb_looked = 0  # the block arena's used part when add() last looked at it
        self._pred = np.zeros(n, dtype=np.int64)  # predicted output length (the router's view)
        self._arrival = np.zeros(n)
        self._ids: list[str] = []
        self._rows: dict[str, int] = {}
        self._revision = 0
        self._snap: tuple[tuple[int, int, float], Snapshot] | None = None
        self._live: LiveForecaster | None = None
        self._layout_watchers: list[Callable[[], None]] = []
        self._load_row: np.ndarray | None = None
        self.lora_seen = False  # a request on a LoRA adapter was added (snapshots carry them)

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
    def kv_usage(self) -> float:
        """Fraction of the usable KV cache in use (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self._st[kn.FREE] / self.config.usable_blocks

    @property
    def idle(self) -> bool:
        return self._st[kn.NRUN] == 0 and self._st[kn.WC] == 0

    @property
    def revision(self) -> tuple[int, int, float]:
        """Changes whenever the engine's state or clock does (a cache key): the count of
        changes made outside the kernel, the steps and the clock."""
        return (self._revision, int(self._st[kn.K]), float(self._clock[0]))

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the engine's arrays (its per-request rows and, with prefix caching,
        the block and key arenas): what a long-lived replica costs."""
        arrays = (self._req, self._stamps, self._run, self._pred, self._arrival, self._wq,
                  self._work, self._rb, self._rk)
        return sum(int(a.nbytes) for a in arrays)

    @property
    def num_added(self) -> int:
        """Requests added and still remembered (all of them while finished ones are kept)."""
        return len(self._ids)

    def has(self, request_id: str) -> bool:
        """Whether the request is in the engine and not finished (nor aborted)."""
        r = self._rows.get(request_id)
        return r is not None and not self._req[r, kn.DONE]

    def known(self, request_id: str) -> bool:
        """Whether the id was ever used here and is remembered (ids are never reused)."""
        return request_id in self._rows

    def request(self, request_id: str) -> dict[str, object]:
        """A request's current state (tokens, and stamps as floats or None)."""
        r = self._rows[request_id]
        row = self._req[r].tolist()
        first, fin = self._stamps[r].tolist()
        return {"id": request_id, "prompt_tokens": row[kn.PROMPT], "output_tokens": row[kn.OUTPUT],
                "stop": row[kn.STOP], "computed_tokens": row[kn.COMP],
                "blocks": row[HELD], "finished": bool(row[kn.DONE]),
                "first_token": None if first != first else first,
                "finish_time": None if fin != fin else fin}

    def live_adapters(self) -> frozenset[int]:
        """The LoRA adapters of the requests that have been scheduled and not finished: running
        ones, and waiting ones with output (preempted) — what vLLM 0.32's
        ``vllm:lora_requests_info`` lists, by id (a request waiting for its first step is not
        listed there)."""
        if not self.lora_seen:
            return frozenset()
        wait = self._waiting_rows()
        rows = np.concatenate((self._run[:int(self._st[kn.NRUN])],
                               wait[self._req[wait, kn.OUTPUT] > 0]))
        ids = np.unique(self._req[rows, kn.LORA])
        return frozenset(ids[ids > 0].tolist())

    def _columns(self, rows: np.ndarray) -> RequestColumns:
        req, ids = self._req, self._ids
        return RequestColumns([ids[r] for r in rows.tolist()], req[rows, kn.PROMPT],
                              req[rows, kn.OUTPUT], req[rows, kn.COMP], req[rows, kn.STOP],
                              self._pred[rows], self._arrival[rows], self._stamps[rows, 0],
                              self._stamps[rows, 1], req[rows, kn.DONE])

    def lookup(self, request_ids: Sequence[str]) -> RequestColumns:
        """These requests' state, in the order given (KeyError for an unknown id)."""
        rows = np.fromiter((self._rows[i] for i in request_ids), dtype=np.int64,
                           count=len(request_ids))
        return self._columns(rows)

    def history(self, last: int | None = None) -> RequestColumns:
        """The remembered requests in the order they were added (the ``last`` ones). The
        columns are read-only views, valid until the engine next changes (copy to keep)."""
        n = len(self._ids)
        lo = 0 if last is None else max(0, n - last)
        req, stamps = self._req[lo:n], self._stamps[lo:n]
        pred, arrival = self._pred[lo:n], self._arrival[lo:n]
        for a in (req, stamps, pred, arrival):  # fresh views: their columns are read-only too
            a.flags.writeable = False
        ids = self._ids
        return RequestColumns(lambda: ids[lo:n], req[:, kn.PROMPT], req[:, kn.OUTPUT],
                              req[:, kn.COMP], req[:, kn.STOP], pred, arrival, stamps[:, 0],
                              stamps[:, 1], req[:, kn.DONE])

    def running_ids(self) -> list[str]:
        return [self._ids[r] for r in self._run[:self._st[kn.NRUN]].tolist()]

    def waiting_ids(self) -> list[str]:
        return [self._ids[r] for r in self._waiting_rows().tolist()]

    def _waiting_rows(self) -> np.ndarray:
        n = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        return self._wq[(h + np.arange(c)) % n] if c else np.zeros(0, dtype=np.int64)

    def _floor_weights(self) -> tuple[float, float]:
        """(fixed, per prefill token) weights of :meth:`first_token_floor`; NaN if any weight
        of the model is negative (then no floor holds)."""
        w = self._w
        return (math.nan, math.nan) if (w < 0).any() else (float(w[0]), float(w[2]))

    def first_token_floor(self, prompt_tokens: int) -> float:
        """A time before which a request of ``prompt_tokens`` added now cannot get its first
        token (a lower bound of what a forecast from this engine's snapshot says; cheap: no
        snapshot, no replay). Under FCFS every prefill token of the requests ahead is
        scheduled before or with the probe's last chunk, each step takes at most the token
        budget, and costs at least its fixed part plus its prefill tokens' part (the other
        terms are not negative). With prefix caching any prompt may be cached but its last
        token: one token, nothing ahead. A model with a negative weight bounds nothing."""
        w0, w_pre = self._floor_w
        if math.isnan(w0):
            return -math.inf
        if self.caching:
            tokens = 1
        else:
            tokens = max(prompt_tokens, 1) + kn.prefill_backlog(self._req, self._run, self._wq,
                                                                  self._st)
        steps = -(-tokens // self.config.max_num_batched_tokens)
        return self._clock[0] + steps * w0 + tokens * w_pre

    # -- clock ----------------------------------------------------------------------------------

    def advance_clock(self, t: float) -> None:
        """Move an idle engine's clock forward to ``t`` (an arrival after a quiet spell)."""
        if not self.idle:
            raise RuntimeError("advance_clock: the engine is busy; step it instead")
        self.set_clock(t)

    def set_clock(self, t: float) -> None:
        """Move the clock forward to ``t`` (a busy engine too: its next step starts then, e.g.
        when a server woke late). Never backwards."""
        if t > self._clock[0]:
            self._clock[0] = t
            self._changed()

    # -- stepping API ---------------------------------------------------------------------------

    def add(self, request_id: str, prompt_tokens: int, stop: int, *,
            output_tokens: int = 0, predicted_output_tokens: int | None = None,
            arrival: float | None = None, hashes: Sequence[int] | np.ndarray = (),
            lora: int = 0) -> None:
        """Queue a request (``stop``: the output length it stops at) at the waiting tail.

        ``predicted_output_tokens`` (default: ``stop``) is what :meth:`snapshot` shows a router.
        ``hashes`` (prefix caching): the int64 keys of the full blocks of its sequence, as far
        as known, its adapter in them (see :class:`~duetime.engine.request.Request`);
        ``lora``: its LoRA adapter (vLLM's ``lora_int_id``; 0: the base model).
        """
        if request_id in self._rows:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        if prompt_tokens < 1 or stop < 1 or output_tokens < 0:
            raise ValueError("prompt_tokens and stop must be >= 1, output_tokens >= 0")
        if isinstance(lora, bool) or not isinstance(lora, int | np.integer) or lora < 0:
            raise ValueError(f"lora: must be an adapter id >= 0 (0: the base model), got "
                             f"{lora!r}")
        if prompt_tokens + output_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request_id!r}: {prompt_tokens + output_tokens} tokens "
                             f"reach max_model_len {self.config.max_model_len}")
        if self.caching:  # (its slices go where a forecast's lease may still lie)
            self._reclaim()
            # finished rows' slices are most of a sizeable block arena: reclaimed, not kept
            # until COMPACT_AT rows (each copy is paid for by as many finished slices); looked
            # at once the arena's used part has doubled since the last look
            if not self.retain_finished and self._rb_used > max(
                    4 * self._cap(self.config.max_model_len, 0), 2 * self._rb_looked):
                if 2 * self._live_blocks() < self._rb_used:
                    self.compact()
                self._rb_looked = self._rb_used
        r = len(self._ids)
        if r >= self._req.shape[0]:
            if not self.retain_finished and r >= COMPACT_AT and (
                    2 * (self.num_running + self.num_waiting) < r):
                self.compact()
            else:
                self._grow()
            r = len(self._ids)
        self._ids.append(request_id)
        self._rows[request_id] = r
        self._req[r] = 0
        self._req[r, kn.PROMPT], self._req[r, kn.OUTPUT], self._req[r, kn.STOP] = (
            prompt_tokens, output_tokens, stop)
        self._pred[r] = stop if predicted_output_tokens is None else predicted_output_tokens
        self._arrival[r] = self._clock[0] if arrival is None else arrival
        if lora:
            self._req[r, kn.LORA] = lora
            self.lora_seen = True
        if self.caching:
            self._place(r, np.asarray(hashes, dtype=np.int64))
        n = self._wq.shape[0]
        self._wq[(self._st[kn.WH] + self._st[kn.WC]) % n] = r
        self._st[kn.WC] += 1
        self._changed()

    def _blocks_cap(self, r: int) -> int:
        """The most blocks row ``r`` can hold (its whole sequence, up to max_model_len)."""
        req = self._req
        return self._cap(int(req[r, kn.PROMPT]), max(int(req[r, kn.STOP]), int(req[r, kn.OUTPUT])))

    def _cap(self, prompt_tokens: int, output_tokens: int) -> int:
        tokens = prompt_tokens + output_tokens + 1
        return blocks_for(min(tokens, self.config.max_model_len), self.config.block_size)

    def _live_blocks(self) -> int:
        """The block arena's entries that running and waiting rows' slices take."""
        live = np.concatenate((self._run[:int(self._st[kn.NRUN])], self._waiting_rows()))
        return int(self._req[live, kn.BCAP].sum())

    def _place(self, r: int, keys: np.ndarray) -> None:
        """Prefix caching: row ``r`` gets its slices of the arenas (blocks, keys) and an id
        for its own keys; a slice too small for its blocks moves to the end."""
        req = self._req
        cap = self._blocks_cap(r)
        held = int(req[r, HELD])
        if self._rb_used + cap > self._rb.shape[0]:
            self._rb = np.concatenate((self._rb, np.zeros(max(cap, self._rb.shape[0]),
                                                          dtype=np.int64)))
        at = self._rb_used
        if held:
            self._rb[at:at + held] = self._rb[req[r, kn.BOFF]:req[r, kn.BOFF] + held]
        req[r, kn.BOFF], req[r, kn.BCAP] = at, cap
        self._rb_used += cap
        if keys is not None:
            if self._rk_used + len(keys) > self._rk.shape[0]:
                self._rk = np.concatenate((self._rk, np.zeros(max(len(keys), self._rk.shape[0]),
                                                              dtype=np.int64)))
            k = self._rk_used
            self._rk[k:k + len(keys)] = keys
            req[r, kn.KOFF], req[r, kn.NKEY] = k, len(keys)
            self._rk_used += len(keys)
            req[r, kn.UID] = self._uid
            self._uid += 1

    def _grow(self) -> None:
        """Double the arrays; rows keep their numbers (the order requests were added)."""
        old = self._req.shape[0]
        waiting = self._waiting_rows()

        def more(a: np.ndarray, fill: float) -> np.ndarray:
            return np.concatenate((a, np.full((old, *a.shape[1:]), fill, dtype=a.dtype)))

        self._req = more(self._req, 0)
        self._stamps = more(self._stamps, np.nan)
        self._run = more(self._run, 0)
        self._pred = more(self._pred, 0)
        self._arrival = more(self._arrival, 0.0)
        self._wq = np.zeros(2 * old, dtype=np.int64)
        self._wq[:len(waiting)] = waiting
        self._st[kn.WH] = 0
        self._work = np.zeros((kn.WORK_ROWS, 2 * old), dtype=np.int64)
        self._adapters = kn.adapter_scratch(self.config.max_loras, 2 * old)
        self._relaid()

    def _changed(self) -> None:
        """Requests or their state changed from outside the steps: a new revision, and the
        kernel's livelock watch starts over."""
        self._revision += 1
        self._st[kn.LONE] = -1
        self._publish()

    def publish_load(self, row: np.ndarray) -> None:
        """Keep this engine's wait summary in ``row`` from now on (a row of a
        :class:`~duetime.engine.wait_estimate.LoadBoard`), refreshed at every change."""
        self._load_row = row
        self._publish()
        self._relaid()

    def watch_layout(self, changed: Callable[[], None]) -> None:
        """Call ``changed`` whenever :meth:`kernel_arrays` would return other arrays (they
        grew, were compacted, the model or the load row changed)."""
        self._layout_watchers.append(changed)

    def kernel_arrays(self) -> tuple:
        """The arrays the compiled scheduler steps, for a caller that steps many engines at
        once (:class:`~duetime.engine.batch_stepper.BatchStepper`; engines without prefix
        caching or LoRA adapters): req, stamps, run, wq, st, clock, cfg, weights, work, out,
        the predicted lengths, the load row (or ``None``). Valid until :meth:`watch_layout` says not."""
        return (self._req, self._stamps, self._run, self._wq, self._st, self._clock,
                self._cfg, self._w, self._work, self._out, self._pred, self._load_row)

    def _relaid(self) -> None:
        for changed in self._layout_watchers:
            changed()

    def _publish(self) -> None:
        if self._load_row is not None:
            summarize(self._req, self._pred, self._run, self._wq, self._st, self._clock,
                      self._cfg, self._w, self._load_row)

    def compact(self) -> None:
        """Forget finished requests (their rows are otherwise kept forever). Scheduler state,
        order and every live request's state are unchanged; live requests keep the order they
        were added in (:meth:`history`)."""
        if self.caching:
            self._reclaim()
        nrun = int(self._st[kn.NRUN])
        run_rows, wait_rows = self._run[:nrun].copy(), self._waiting_rows()
        live = np.sort(np.concatenate((run_rows, wait_rows)))
        size = max(256, 2 * len(live))
        k = len(live)

        def keep(a: np.ndarray, fill: float) -> np.ndarray:
            out = np.full((size, *a.shape[1:]), fill, dtype=a.dtype)
            out[:k] = a[live]
            return out

        self._req = keep(self._req, 0)
        if self.caching:
            self._pack_arenas(k)
        self._stamps = keep(self._stamps, np.nan)
        self._pred = keep(self._pred, 0)
        self._arrival = keep(self._arrival, 0.0)
        self._ids = [self._ids[r] for r in live.tolist()]
        self._rows = {rid: i for i, rid in enumerate(self._ids)}
        self._run = np.zeros(size, dtype=np.int64)
        self._run[:nrun] = np.searchsorted(live, run_rows)
        self._wq = np.zeros(size, dtype=np.int64)
        self._wq[:len(wait_rows)] = np.searchsorted(live, wait_rows)
        self._st[kn.WH] = 0
        self._work = np.zeros((kn.WORK_ROWS, size), dtype=np.int64)
        self._adapters = kn.adapter_scratch(self.config.max_loras, size)
        self._changed()
        self._relaid()

    def step(self, *, tokens: bool = False) -> StepEvents | None:
        """Run one scheduler step; ``None`` when there is nothing to do. ``tokens``: also
        list which requests produced a token (:attr:`StepEvents.tokens`; found by comparing
        outputs before and after, so that the kernel pays nothing when nobody asks)."""
        if self.idle:
            return None
        self._reclaim()
        start = float(self._clock[0])
        if tokens:
            rows = np.concatenate((self._run[:self._st[kn.NRUN]], self._waiting_rows()))
            before = self._req[rows, kn.OUTPUT]
        got = kn.step(self._req, self._stamps, self._run, self._wq, self._st, self._clock,
                      self._cfg, self._w, self._work, self._out, self._pool, self._kmap,
                      self._rb, self._rk, None, self._adapters, self.noise)
        out = self._out
        self._publish()
        self._raise_if_stuck(got, int(out[4]))
        ids = self._ids
        made = None
        if tokens:  # in schedule order: running in order, then the admitted, FCFS
            made = rows[self._req[rows, kn.OUTPUT] > before]
        end = float(self._clock[0])
        return StepEvents(int(self._st[kn.K]) - 1, start, end, got,
                          [ids[r] for r in self._work[1, :out[5]].tolist()],
                          [ids[r] for r in self._work[0, :out[6]].tolist()], int(out[7]),
                          made, ids, start if self.config.async_scheduling else end,
                          int(out[8]), int(out[9]))

    def _raise_if_stuck(self, code: int, row: int) -> None:
        if code == kn.STUCK:
            if row >= 0:
                req = self._req
                raise EngineStuck(stuck_reason(
                    self._ids[row], int(req[row, kn.PROMPT]), int(req[row, kn.OUTPUT]),
                    int(req[row, kn.STOP]), self.config))
            raise EngineStuck("no request can be scheduled")  # pragma: no cover

    def run_until(self, t: float, *, stop_on_finish: bool = False) -> list[str]:
        """Step while the clock is before ``t`` (the last step may end after it); an idle
        engine's clock jumps to ``t``. With ``stop_on_finish`` it returns early, after the first
        step in which requests finished, and returns their ids (else ``[]``)."""
        if self.caching:
            self._reclaim()
        if self._load_row is None:
            code, detail = kn.run_until(self._req, self._stamps, self._run, self._wq, self._st,
                                        self._clock, self._cfg, self._w, self._work, self._out,
                                        self._pool, self._kmap, self._rb, self._rk, None,
                                        self._adapters, t, stop_on_finish, self.noise)
        else:
            code, detail = run_until_publishing(
                self._req, self._stamps, self._run, self._wq, self._st, self._clock, self._cfg,
                self._w, self._work, self._out, self._pool, self._kmap, self._rb, self._rk,
                self._adapters, t, stop_on_finish, self.noise, self._pred, self._load_row)
        if code < 0:
            self._raise_if_stuck(code, detail)
        if code == kn.IDLE and t != float("inf"):
            self.set_clock(t)
        if code == kn.FINISHED:
            return [self._ids[r] for r in self._work[0, :self._out[6]].tolist()]
        return []

    def drain(self) -> None:
        """Run until idle (the clock stays at the last step's end)."""
        self.run_until(float("inf"))

    # -- live operations --------------------------------------------------------------------------

    def _remove_running(self, r: int) -> bool:
        nrun = int(self._st[kn.NRUN])
        run = self._run
        hit = np.flatnonzero(run[:nrun] == r)
        if hit.size == 0:
            return False
        i = int(hit[0])
        run[i:nrun - 1] = run[i + 1:nrun].copy()
        self._st[kn.NRUN] = nrun - 1
        if self.caching:
            self._reclaim()
            self._st[kn.FREE] += kn.release_blocks(self._req, r, self._pool, self._rb, None)
        else:
            self._st[kn.FREE] += kv_release(self._req, r)
        return True

    def _remove_waiting(self, r: int) -> bool:
        n = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        if c == 0:
            return False
        idx = (h + np.arange(c)) % n
        items = self._wq[idx]
        hit = np.flatnonzero(items == r)
        if hit.size == 0:
            return False
        rest = np.delete(items, int(hit[0]))
        self._wq[idx[:c - 1]] = rest
        self._st[kn.WC] = c - 1
        return True

    def abort(self, request_id: str) -> bool:
        """Take a request out of the batch now (its blocks are freed; it counts as finished at
        the current clock). Returns False if it was unknown or already finished."""
        r = self._rows.get(request_id)
        if r is None or self._req[r, kn.DONE]:
            return False
        if not self._remove_running(r):
            self._remove_waiting(r)
        self._req[r, kn.DONE] = 1
        self._stamps[r, 1] = self._clock[0]
        self._changed()
        return True

    def end(self, request_id: str, output_tokens: int) -> bool:
        """The request really ended with ``output_tokens`` tokens (a replica told so by the
        instance): with asynchronous scheduling, if its tokens in flight reach that count it
        stops as the instance's did (left out of the next step's schedule, its blocks freed
        after it); otherwise it is aborted now. Returns False if unknown or already over."""
        r = self._rows.get(request_id)
        if r is None or self._req[r, kn.DONE]:
            return False
        req = self._req
        pend = int(req[r, kn.PEND])
        if self.config.async_scheduling and pend > 0 and (
                int(req[r, kn.OUTPUT]) + pend == output_tokens):
            req[r, kn.STOP] = output_tokens
            self._changed()
            return True
        return self.abort(request_id)

    def observe(self, request_id: str, output_tokens: int) -> bool:
        """The request has really produced ``output_tokens`` (>= 1) tokens: its prefill is done
        and it decodes from there. A waiting request is moved to the tail of the running order
        (if a seat and its blocks are free; otherwise the engine keeps its own view). Returns
        whether the engine changed."""
        r = self._rows.get(request_id)
        if r is None or output_tokens < 1 or self._req[r, kn.DONE]:
            return False
        req = self._req
        prompt = int(req[r, kn.PROMPT])
        if prompt + output_tokens >= self.config.max_model_len:
            return False
        computed = prompt + output_tokens - 1
        if req[r, kn.OUTPUT] == output_tokens and req[r, kn.COMP] == computed:
            return False
        need = blocks_for(computed, self.config.block_size) - int(req[r, HELD])
        nrun = int(self._st[kn.NRUN])
        running = bool(np.any(self._run[:nrun] == r))
        if need > self._st[kn.FREE]:
            return False
        if not running:
            if nrun >= self.config.max_num_seqs or not self._remove_waiting(r):
                return False
            self._run[nrun] = r
            self._st[kn.NRUN] = nrun + 1
        req[r, kn.COMP] = computed
        req[r, kn.OUTPUT] = output_tokens
        req[r, ASYNC_COLUMNS] = 0  # settled: no token in flight
        if req[r, kn.STOP] <= output_tokens:
            req[r, kn.STOP] = output_tokens + 1
        if self.caching:  # its new blocks come from the pool; its full ones are registered
            self._reclaim()
            held = int(req[r, HELD])
            if need < 0:  # the engine ran ahead of what it really made: the extra blocks go
                # back (last first, as vLLM frees them), and it no longer counts them cached
                back = pool_release(self._pool, self._rb, int(req[r, kn.BOFF]) + held + need,
                                    -need, None)
                req[r, HELD] = held + need
                req[r, kn.NCACHED] = min(int(req[r, kn.NCACHED]), held + need)
                self._st[kn.FREE] += back
            else:
                if held + need > int(req[r, kn.BCAP]):
                    self._place(r, None)
                pool_allocate(self._pool, self._kmap, self._rb, int(req[r, kn.BOFF] + held),
                              need, None)
                req[r, HELD] += need
                self._st[kn.FREE] -= need
            kn.register_blocks(req, r, self._pool, self._kmap, self._rb, self._rk, computed,
                               self.config.block_size, None)
        else:
            self._st[kn.FREE] -= kv_take(req, r, need)
        if self._stamps[r, 0] != self._stamps[r, 0]:
            self._stamps[r, 0] = self._clock[0]
        self._changed()
        return True

    def observe_many(self, request_ids: Sequence[str], output_tokens: Sequence[int]) -> int:
        """:meth:`observe` for many requests at once, vectorised, for those already running
        (others are left alone: correct them one by one with :meth:`observe`). Returns how many
        were corrected."""
        nrun = int(self._st[kn.NRUN])
        if nrun == 0 or not len(request_ids):
            return 0
        if self.caching:  # blocks have identities: one by one
            running = set(self.running_ids())
            return sum(self.observe(i, int(o)) for i, o in zip(request_ids, output_tokens,
                                                               strict=True) if i in running)
        get = self._rows.get
        rows = np.fromiter((get(i, -1) for i in request_ids), dtype=np.int64,
                           count=len(request_ids))
        outs = np.asarray(output_tokens, dtype=np.int64)
        req = self._req
        keep = (rows >= 0) & (outs >= 1)
        rows, outs = rows[keep], outs[keep]
        keep = np.isin(rows, self._run[:nrun]) & (req[rows, kn.DONE] == 0)
        rows, outs = rows[keep], outs[keep]
        comp = req[rows, kn.PROMPT] + outs - 1
        keep = (comp + 1 < self.config.max_model_len) & (
            (req[rows, kn.OUTPUT] != outs) | (req[rows, kn.COMP] != comp))
        if not keep.any():
            return 0
        rows, outs, comp = rows[keep], outs[keep], comp[keep]
        need = blocks_for(comp, self.config.block_size)
        delta = int((need - req[rows, HELD]).sum())
        if delta > self._st[kn.FREE]:
            return 0
        self._st[kn.FREE] -= delta
        req[rows, HELD] = need
        req[rows, kn.COMP] = comp
        req[rows, kn.OUTPUT] = outs
        req[np.ix_(rows, ASYNC_COLUMNS)] = 0  # settled: no token in flight
        req[rows, kn.STOP] = np.maximum(req[rows, kn.STOP], outs + 1)
        self._changed()
        return int(rows.size)

    def cached_prefix(self, hashes: Sequence[int] | np.ndarray) -> int:
        """Prefix caching: how many leading blocks of these block keys the instance holds in
        its cache now (the lookup vLLM makes when it admits a request; 0 without caching).
        What a router with a precise view of the cache (vLLM's KV events) knows."""
        if not self.caching:
            return 0
        self._reclaim()
        return int(key_match(self._kmap, np.asarray(hashes, dtype=np.int64)))

    def set_model(self, model: BatchTimeModel) -> None:
        """Steps from now on take ``model``'s time (an emulated instance whose speed changes
        while it runs). The step in flight keeps the duration it was given."""
        self.model = model
        self._w = weights_array(model)
        self._floor_w = self._floor_weights()
        self._changed()
        self._relaid()

    def cache_store(self, hashes: Sequence[int] | np.ndarray) -> int:
        """Prefix caching: the instance reports these block keys cached (vLLM's KV event
        ``BlockStored``): those the engine lacks become free cached blocks, most recently
        used (a free block is taken for each, from the head of the free queue, as vLLM would
        evict). Returns how many were added. For a router that mirrors an instance's events
        into its replica of it."""
        return self._tell(store_free, hashes)

    def cache_drop(self, hashes: Sequence[int] | np.ndarray) -> int:
        """Prefix caching: the instance reports these block keys evicted (vLLM's
        ``BlockRemoved``): they leave the cache. Returns how many blocks lost a key."""
        return self._tell(drop_keys, hashes)

    def cache_clear(self) -> int:
        """Prefix caching: the instance's cache was emptied (vLLM's ``AllBlocksCleared``, or a
        restart): every key leaves. Returns how many blocks lost one."""
        if not self.caching:
            return 0
        self._reclaim()
        pool = self._pool
        return self._tell(drop_keys, np.unique(pool[pool[:, 1] != 0, 2]))

    def _tell(self, kernel, hashes: Sequence[int] | np.ndarray) -> int:
        if not self.caching:
            return 0
        keys = np.asarray(hashes, dtype=np.int64)
        if keys.size == 0:
            return 0
        self._reclaim()
        n = int(kernel(self._pool, self._kmap, keys))
        if n:
            self._changed()
        return n

    @property
    def prefix_queries(self) -> int:
        """Prefix caching: tokens of the requests admitted after a cache lookup, so far."""
        return int(self._st[kn.PQ])

    @property
    def prefix_hits(self) -> int:
        """Prefix caching: of those, the tokens found cached (not computed again), so far."""
        return int(self._st[kn.PH])

    @property
    def cached_blocks(self) -> int:
        """Prefix caching: blocks registered in the cache (held or free; 0 without caching)."""
        if not self.caching:
            return 0
        self._reclaim()
        return int(self._pool[:, 1].sum())

    def _reclaim(self) -> None:
        """Prefix caching: put back what a forecaster kept of its replay on the engine's cache
        (:func:`duetime.engine.block_pool_kernel.lease`) before the engine reads or changes it."""
        reclaim(self._pool, self._kmap, self._undo)

    # -- the router's view ------------------------------------------------------------------------

    def snapshot(self, time: float | None = None) -> Snapshot:
        """The router's view: running and waiting requests in scheduler order, with their
        *predicted* output lengths, at the engine's clock (or ``time``). Built once per state
        (a snapshot is immutable)."""
        key = self.revision
        if time is None and self._snap is not None and self._snap[0] == key:
            return self._snap[1]
        nrun = int(self._st[kn.NRUN])
        rows_r = self._run[:nrun]
        rows_w = self._waiting_rows()
        req, ids = self._req, self._ids
        lora = self.lora_seen

        def table(rows: np.ndarray) -> RequestTable:
            # (asynchronous scheduling: computed = prompt + output while a token is in flight)
            kept = rows.copy()  # (the engine's running order changes as it steps)
            return RequestTable(lambda: [ids[r] for r in kept.tolist()], req[rows, kn.PROMPT],
                                req[rows, kn.COMP], req[rows, kn.OUTPUT], self._pred[rows],
                                self._arrival[rows], req[rows, kn.LORA] if lora else None)

        snap = Snapshot(self.config, self.model,
                        time=float(self._clock[0]) if time is None else time,
                        running=table(rows_r), waiting=table(rows_w),
                        prefix=self._prefix_state(rows_r, rows_w) if self.caching else None)
        if time is None:
            self._snap = (key, snap)
        return snap

    def forecaster(self) -> Forecaster:
        """The forecaster of the engine's current state: one kept across the engine's changes
        and read from its arrays, with or without prefix caching
        (:mod:`duetime.engine.live_forecast`). Its forecasts are measured from :attr:`time` and
        equal those of ``forecast(self.snapshot(), ...)``."""
        live = self._live
        if live is None:
            live = self._live = LiveForecaster(self)
        return live.sync()

    def replay_state(self, sigma: float) -> tuple:
        """The replay arrays of the current state, with prefix caching borrowing the engine's
        cache (:func:`~duetime.engine.forecasting.replay_state`): what ``_state(snapshot())``
        gives, without building the snapshot (a live forecaster's fresh base)."""
        nrun = int(self._st[kn.NRUN])
        rows_r = self._run[:nrun]
        rows_w = self._waiting_rows()
        req, pred = self._req, self._pred
        loras = ((req[rows_r, kn.LORA], req[rows_w, kn.LORA])
                 if self.lora_seen and self.config.max_loras else (None, None))
        return replay_state(self.config, self.model,
                            (req[rows_r, kn.PROMPT], req[rows_r, kn.COMP],
                             req[rows_r, kn.OUTPUT], pred[rows_r]),
                            (req[rows_w, kn.PROMPT], req[rows_w, kn.OUTPUT], pred[rows_w]),
                            self._prefix_state(rows_r, rows_w) if self.caching else None,
                            sigma, loras=loras)

    @property
    def cache_table(self) -> np.ndarray | None:
        """Prefix caching: the key table a forecaster's replay borrows (None without)."""
        return self._kmap if self.caching else None

    def replay_base(self, sigma: float, state: tuple, rec: np.ndarray, cum: np.ndarray,
                    rec_t: np.ndarray, room: np.ndarray, target: int,
                    max_steps: int) -> tuple[int, int, int]:
        """Read the current state into a forecaster's replay arrays ``state`` (req, stamps,
        run, wq, st, clock, cfg, weights, the LoRA scratch or None: see
        :mod:`~duetime.engine.scheduler_kernel`), as a snapshot of it would be replayed, and record
        its base from the start (:func:`~duetime.engine.scheduler_kernel.live_base`; without
        prefix caching)."""
        return kn.live_base(self._req, self._pred, self._run, self._wq, self._st, sigma,
                            *state, rec, cum, rec_t, room, target, max_steps)

    def _prefix_state(self, rows_r: np.ndarray, rows_w: np.ndarray) -> PrefixState:
        """The cache behind a snapshot: borrowed, valid while the engine does not change."""
        rows = np.concatenate((rows_r, rows_w))
        cols = self._req[rows][:, [kn.BOFF, HELD, kn.NCACHED, kn.KOFF, kn.NKEY, kn.UID]]
        revision = self.revision
        return PrefixState(self._pool, self._kmap, self._rb, self._rk, cols,
                           int(self._st[kn.FREE]), self._uid, self._undo,
                           lambda: self.revision == revision, self._forecast_arenas)

    def _pack_arenas(self, k: int) -> None:
        """The arenas keep only the first ``k`` rows' slices (the live ones, after
        :meth:`compact`), moved down in place in the order they lie, their capacity kept: a
        shadow replica's requests each reserve a whole ``max_model_len`` of blocks, so arenas
        cut to the live slices were grown again by the next forecast's room, every few requests
        (allocations and copies of hundreds of KB on a gateway's hot path). Of a block slice
        only its held blocks are copied: the entries past them are written before they are
        read (as :meth:`_place` moves a slice)."""
        req, rb, rk = self._req, self._rb, self._rk
        used = 0
        for i in np.argsort(req[:k, kn.BOFF], kind="stable").tolist():
            row = req[i]
            b, c, h = int(row[kn.BOFF]), int(row[kn.BCAP]), int(row[HELD])
            if h and used != b:  # (used <= b: the slices below it are the live ones before it)
                rb[used:used + h] = rb[b:b + h]
            row[kn.BOFF] = used
            used += c
        self._rb_used = used
        used = 0
        for i in np.argsort(req[:k, kn.KOFF], kind="stable").tolist():
            row = req[i]
            ko, nk = int(row[kn.KOFF]), int(row[kn.NKEY])
            if nk and used != ko:
                rk[used:used + nk] = rk[ko:ko + nk]
            row[kn.KOFF] = used
            used += nk
        self._rk_used = used

    def _forecast_arenas(self, blocks: int, keys: int) -> tuple[np.ndarray, int, np.ndarray, int]:
        """The arenas with room for a forecast's new slices past the engine's
        (:attr:`PrefixState.arena`)."""
        self._rb = with_room(self._rb, self._rb_used, blocks)
        self._rk = with_room(self._rk, self._rk_used, keys)
        return self._rb, self._rb_used, self._rk, self._rk_used

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting or the queues are inconsistent
        (tests)."""
        nrun = int(self._st[kn.NRUN])
        rows = self._run[:nrun]
        if self.caching:  # blocks held (shared ones once) and the free queue are all of them
            self._reclaim()
            req, rb = self._req, self._rb
            held_ids = {int(b) for r in rows.tolist()
                        for b in rb[req[r, kn.BOFF]:req[r, kn.BOFF] + req[r, HELD]]}
            queue = queue_of(self._pool)
            assert len(queue) == int(self._st[kn.FREE]), "free count"
            assert len(held_ids) + len(queue) == self.config.usable_blocks, "blocks leak"
            assert all(self._pool[b, 0] >= 1 for b in held_ids)
            held = int(self._req[rows, HELD].sum())
        else:
            held = int(self._req[rows, HELD].sum())
            assert held + int(self._st[kn.FREE]) == self.config.usable_blocks, "blocks leak"
        assert nrun <= self.config.max_num_seqs
        assert len(set(rows.tolist())) == nrun
        waiting = self._waiting_rows()
        assert not set(waiting.tolist()) & set(rows.tolist())
        assert (self._req[waiting, HELD] == 0).all()
        bs = self.config.block_size
        for r in rows.tolist():
            assert self._req[r, HELD] == blocks_for(int(self._req[r, kn.COMP]), bs)
            assert not self._req[r, kn.DONE]
