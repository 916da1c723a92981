"""TTFT and end-to-end forecasts from a snapshot (the SFS estimator's core).

Replays run on a clock that starts at 0 at the snapshot (snapshot times may be Unix epochs,
whose rounding would otherwise add ~1e-7 s per step); traces report absolute step ends.

A forecast appends a probe request at the tail of the waiting queue and replays the scheduler
until the probe's first token (or its finish), with no arrivals.

Further probes of the same snapshot are cheap. Everything ahead of the probe evolves the same
whatever its length: it is last in the waiting queue, and once admitted it is last in the
running order, so it only takes budget nobody else wants and is the first to be preempted. So
the :class:`Forecaster` replays the snapshot *without* a probe once (the base trajectory,
recorded step by step and extended on demand) and answers each probe from the record: the
first step where the queue ahead has drained with budget, a seat and KV blocks left admits it
(with LoRA adapters, the first that went through the queue with room for its adapter: requests
skipped for theirs may stay ahead; ``docs/engine.md``);
after that it takes, step by step, the budget the base left after its running requests, until
its prompt is done. Its time is the base time plus its own batch-time terms (the models are
additive over requests). If the base preempts after the probe would have been admitted, or
leaves too few KV blocks to hold the probe, the probe would change what others do, and the
forecaster replays the snapshot with the probe instead (exact, just slower). Both paths are
tested against the reference loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine._jit import njit
from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.block_pool_kernel import (
    U_EV,
    U_EVCAP,
    U_NEV,
    holds,
    key_get,
    key_put,
    lease,
    new_key_map,
    reclaim,
    undo_all,
)
from duetime.engine.config import SchedulerConfig
from duetime.engine.kv import block_shift, blocks_for, stuck_reason
from duetime.engine.prefix_json import block_keys
from duetime.engine.remaining import DEFAULT_SIGMA
from duetime.engine.request import Request
from duetime.engine.scheduler import EngineStuck, ReferenceEngine
from duetime.engine.snapshot import Snapshot

Until = Literal["first_token", "finish"]
PROBE_ID = "probe"
DEFAULT_MAX_STEPS = 1_000_000


class ForecastError(ValueError):
    """A forecast that cannot be made (a bad probe, or a replay past its step cap)."""


@dataclass(slots=True)
class Forecast:
    """``estimate_s`` is measured from the snapshot's ``time``; ``steps`` counts replayed steps
    up to and including the probe's event; ``trace`` lists them when asked for. A probe that
    will never get there (the queue ahead of it is blocked for good: a request that can never
    be admitted) has ``estimate_s`` = inf and the ``reason``."""

    estimate_s: float
    steps: int
    trace: list[dict[str, Any]] | None = field(default=None)
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: an infinite estimate is ``null``, with its ``reason``."""
        finite = math.isfinite(self.estimate_s)
        d: dict[str, Any] = {"estimate_s": self.estimate_s if finite else None,
                             "steps": self.steps}
        if self.reason is not None:
            d["reason"] = self.reason
        if self.trace is not None:
            d["trace"] = self.trace
        return d


def _probe_id(snapshot: Snapshot) -> str:
    ids = set(snapshot.running_table.ids) | set(snapshot.waiting_table.ids)
    pid = PROBE_ID
    i = 1
    while pid in ids:
        i += 1
        pid = f"{PROBE_ID}#{i}"
    return pid


@lru_cache(maxsize=256)
def config_array(cfg: SchedulerConfig) -> np.ndarray:
    """The kernel's ``cfg`` array of a scheduler config (see :mod:`~duetime.engine.scheduler_kernel`)."""
    return np.array([cfg.max_num_batched_tokens, cfg.chunk_cap, cfg.max_num_seqs,
                     cfg.max_model_len, cfg.block_size, cfg.usable_blocks,
                     block_shift(cfg.block_size), cfg.watermark_blocks,
                     int(cfg.scheduler_reserve_full_isl), int(cfg.async_scheduling),
                     cfg.max_loras], dtype=np.int64)


@lru_cache(maxsize=256)
def weights_array(model: BatchTimeModel) -> np.ndarray:
    """The kernel's ``w``: the model's weights, then its LoRA ones (shared: never written)."""
    return np.array((*model.weights, *model.lora_weights), dtype=np.float64)


def _state(snapshot: Snapshot, sigma: float, probe: tuple[int, int] | None = None,
           probe_hashes: Sequence[int] | np.ndarray | None = None, probe_lora: int = 0) -> tuple:
    """Fresh replay arrays for the snapshot (see :mod:`~duetime.engine.scheduler_kernel`); ``probe`` = (prompt, stop)
    joins the queue's tail (with its block keys ``probe_hashes`` under prefix caching, on
    adapter ``probe_lora``). With
    prefix caching the replay borrows the cache behind the snapshot
    (:mod:`duetime.engine.prefix_state`): the caller puts it back with :func:`_give_back`."""
    cfg = snapshot.config
    if cfg.enable_prefix_caching and snapshot.prefix is None:
        raise ForecastError("config.enable_prefix_caching: this snapshot carries no cache "
                            "state (take it from a live engine, or use snapshot version 2)")
    run, wait = snapshot.running_table, snapshot.waiting_table
    loras = (run.lora, wait.lora) if cfg.max_loras else (None, None)
    return replay_state(cfg, snapshot.model, (run.prompt, run.computed, run.output,
                                              run.predicted),
                        (wait.prompt, wait.output, wait.predicted), snapshot.prefix, sigma,
                        probe, probe_hashes, loras, probe_lora)


def replay_state(cfg: SchedulerConfig, model: BatchTimeModel, running: tuple, waiting: tuple,
                 prefix: Any, sigma: float, probe: tuple[int, int] | None = None,
                 probe_hashes: Sequence[int] | np.ndarray | None = None,
                 loras: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
                 probe_lora: int = 0) -> tuple:
    """The replay arrays of a state given as columns: ``running`` = (prompt, computed, output,
    predicted), ``waiting`` = (prompt, output, predicted), in scheduler order, their adapters
    ``loras`` = (running, waiting; None: the base model's), and its cache (a
    :class:`~duetime.engine.prefix_state.PrefixState`, or None); what a snapshot of that
    state gives (:func:`_state`), and what a live engine's forecaster reads without one."""
    cfg_arr = config_array(cfg)
    r_lora, w_lora = loras
    if r_lora is None and w_lora is None:  # (two arguments fewer to dispatch)
        req, stamps, running_rows, wq, st, clock = kn.prepare(
            *running, *waiting, cfg.block_size, cfg_arr[kn.SHIFT], cfg.usable_blocks, sigma,
            0.0)
    else:  # (the kernel takes both or neither)
        r_lora = np.zeros(len(running[0]), np.int64) if r_lora is None else r_lora
        w_lora = np.zeros(len(waiting[0]), np.int64) if w_lora is None else w_lora
        req, stamps, running_rows, wq, st, clock = kn.prepare(
            *running, *waiting, cfg.block_size, cfg_arr[kn.SHIFT], cfg.usable_blocks, sigma,
            0.0, r_lora, w_lora)
    caching = prefix is not None and cfg.enable_prefix_caching
    if st[kn.FREE] < 0 and not caching:  # (with caching, shared blocks count once: below)
        raise ForecastError(f"snapshot: the running requests hold "
                            f"{cfg.usable_blocks - int(st[kn.FREE])} KV blocks but the instance "
                            f"has {cfg.usable_blocks} (num_gpu_blocks = {cfg.num_gpu_blocks}, "
                            "one is the null block)")
    if probe is not None:
        req[-1, kn.PROMPT], req[-1, kn.STOP] = probe
        if probe_lora:
            req[-1, kn.LORA] = probe_lora
        st[kn.WC] += 1
    pool = kn.NO_POOL
    if caching:
        try:
            pool = prefix.replay_arrays(req, st, cfg.block_size, cfg.max_model_len,
                                        probe_hashes)
        except ValueError as e:
            raise ForecastError(str(e)) from None
    return (req, stamps, running_rows, wq, st, clock, cfg_arr, weights_array(model), *pool,
            kn.adapter_scratch(cfg.max_loras, req.shape[0]) if cfg.max_loras else None)


def _give_back(state: tuple) -> None:
    """Put back the cache a replay borrowed (see :func:`_state`)."""
    if state[12] is not None:
        undo_all(state[8], state[9], state[12])


def _request_id(snapshot: Snapshot, r: int, probe_id: str) -> str:
    n_run, n_wait = len(snapshot.running_table), len(snapshot.waiting_table)
    if r < n_run:
        return snapshot.running_table.ids[r]
    if r < n_run + n_wait:
        return snapshot.waiting_table.ids[r - n_run]
    return probe_id


def _stuck_reason(snapshot: Snapshot, req: np.ndarray, head: int, probe_id: str) -> str:
    """Why a replay cannot go on: the waiting head can never run to its end."""
    if head < 0:  # pragma: no cover - a stuck step always has a waiting head
        return "no request can be scheduled"
    return stuck_reason(_request_id(snapshot, head, probe_id), int(req[head, kn.PROMPT]),
                        int(req[head, kn.OUTPUT]), int(req[head, kn.STOP]), snapshot.config)


def _kernel_error(code: int, max_steps: int, what: str) -> ForecastError:
    if code == kn.STEP_CAP:
        return ForecastError(f"replay did not reach {what} within {max_steps} steps")
    return ForecastError(f"replay ended before {what} (code {code})")  # pragma: no cover


def _check_probe(config: SchedulerConfig, prompt_tokens: int,
                 predicted_output_tokens: int | None, until: str) -> int:
    if until not in ("first_token", "finish"):
        raise ForecastError(f"until: must be 'first_token' or 'finish', got {until!r}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int | np.integer) or (
            prompt_tokens < 1):
        raise ForecastError(f"prompt_tokens: must be an integer >= 1, got {prompt_tokens!r}")
    if prompt_tokens >= config.max_model_len:
        raise ForecastError(f"prompt_tokens: {prompt_tokens} does not fit max_model_len "
                            f"{config.max_model_len}")
    if blocks_for(int(prompt_tokens), config.block_size) > config.usable_blocks:
        raise ForecastError(f"prompt_tokens: {prompt_tokens} tokens need more KV blocks than "
                            f"the instance has ({config.usable_blocks} x {config.block_size})")
    if until == "finish":
        if predicted_output_tokens is None:
            raise ForecastError("predicted_output_tokens: required when until='finish'")
        if (isinstance(predicted_output_tokens, bool)
                or not isinstance(predicted_output_tokens, int | np.integer)
                or predicted_output_tokens < 1):
            raise ForecastError("predicted_output_tokens: must be an integer >= 1, got "
                                f"{predicted_output_tokens!r}")
        return int(predicted_output_tokens)
    return 1


# rows a LoRA probe's admission is looked for in Python before the compiled scan takes over
SCAN_AFTER = 8


def _check_lora(lora: int) -> int:
    if isinstance(lora, bool) or not isinstance(lora, int | np.integer) or lora < 0:
        raise ForecastError(f"lora: must be an adapter id >= 0 (0: the base model), got "
                            f"{lora!r}")
    return int(lora)


def replay(snapshot: Snapshot, prompt_tokens: int, predicted_output_tokens: int | None = None,
           until: Until = "first_token", *, reference: bool = False, trace: bool = False,
           sigma: float = DEFAULT_SIGMA, max_steps: int = DEFAULT_MAX_STEPS,
           prompt_hashes: Sequence[int] | np.ndarray | None = None,
           lora: int = 0) -> Forecast:
    """Replay the snapshot with the probe appended, compiled or step by step.

    ``reference=True`` (implied by ``trace``) uses the plain per-request Python loop: the oracle
    (not with prefix caching: it cannot borrow a live engine's cache). ``prompt_hashes``: the
    probe's block keys, with prefix caching (else its blocks are its own); ``lora``: the
    probe's adapter (0: the base model).
    """
    stop = _check_probe(snapshot.config, prompt_tokens, predicted_output_tokens, until)
    lora = _check_lora(lora)
    prompt_tokens = int(prompt_tokens)
    try:
        prompt_hashes = block_keys(prompt_hashes)
    except ValueError as e:
        raise ForecastError(f"prompt_hashes: {e}") from None
    pid = _probe_id(snapshot)
    # asynchronous scheduling applies a step's outputs in the next step: count the steps up
    # to the one that made the probe's token
    late = int(snapshot.config.async_scheduling)
    t0 = 0.0  # replay on a clock relative to the snapshot: no rounding of large epoch times
    what = f"the probe's {until}"
    if reference or trace:
        if snapshot.config.enable_prefix_caching:
            raise ForecastError("a traced or reference replay does not model prefix caching "
                                "from a snapshot; the compiled replay does")
        req = _state(snapshot, sigma)[0]
        n_run, n_wait = len(snapshot.running_table), len(snapshot.waiting_table)

        def make(r: int) -> Request:
            return Request(_request_id(snapshot, r, pid), int(req[r, kn.PROMPT]),
                           int(req[r, kn.STOP]), output=int(req[r, kn.OUTPUT]),
                           computed=int(req[r, kn.COMP]), lora=int(req[r, kn.LORA]))

        probe = Request(pid, prompt_tokens, stop, arrival=t0, lora=lora)
        eng = ReferenceEngine(snapshot.config, snapshot.model, time=t0,
                              running=[make(r) for r in range(n_run)],
                              waiting=[*(make(r) for r in range(n_run, n_run + n_wait)), probe])
        attr = "first_token" if until == "first_token" else "finished"
        steps: list[dict[str, Any]] | None = [] if trace else None
        try:
            while getattr(probe, attr) is None:
                if eng.steps >= max_steps:
                    raise ForecastError(f"replay did not reach {what} within {max_steps} steps")
                rec = eng.step()
                if steps is not None and rec is not None:
                    step = rec.to_dict()
                    step["end"] += snapshot.time
                    steps.append(step)
        except EngineStuck as e:
            return Forecast(math.inf, eng.steps, steps, reason=str(e))
        return Forecast(getattr(probe, attr) - t0, eng.steps - late, steps)
    state = _state(snapshot, sigma, (prompt_tokens, stop), prompt_hashes, lora)
    try:
        code, detail = kn.run_probe(*state, state[0].shape[0] - 1, until == "finish",
                                    max_steps)
    finally:
        _give_back(state)
    st = state[4]
    if code == kn.STUCK:
        return Forecast(math.inf, int(st[kn.K]),
                        reason=_stuck_reason(snapshot, state[0], detail, pid))
    if code != kn.REACHED:
        raise _kernel_error(code, max_steps, what)
    stamps = state[1]
    return Forecast(float(stamps[-1, 0 if until == "first_token" else 1]) - t0,
                    int(st[kn.K]) - late)


@njit(cache=True, nogil=True)
def events_by_key(undo):  # pragma: no cover - jit
    """The key events of the replay on the log's pool so far (see
    :mod:`duetime.engine.block_pool_kernel`), grouped by key (the groups in the order of
    their keys' first events) and in time order per key: (keys, stamps, signs, index),
    ``index`` a key table (:func:`~duetime.engine.block_pool_kernel.key_get`) from each key
    to 1 + where its events start; or empty arrays and False if the events overflowed the
    log. (Grouped in two passes through a key table, not sorted: 4-5x faster for the
    400-900 events of a first forecast with caching, which sorting cost ~10% of.)"""
    n = undo[U_NEV]
    if n > undo[U_EVCAP]:
        e = np.empty(0, dtype=np.int64)
        return e, e, e, new_key_map(1), False
    ev = undo[undo[U_EV]:undo[U_EV] + 3 * n].reshape(n, 3)
    index = new_key_map(n)  # first: each key's group + 1
    group = np.empty(n, dtype=np.int64)
    count = np.zeros(n + 1, dtype=np.int64)
    groups = 0
    for i in range(n):
        g = key_get(index, ev[i, 1])
        if g < 0:
            groups += 1
            g = groups
            key_put(index, ev[i, 1], g)
        group[i] = g - 1
        count[g - 1] += 1
    at = np.empty(groups, dtype=np.int64)  # where each group's next event goes
    s = 0
    for g in range(groups):
        at[g] = s
        s += count[g]
    keys = np.empty(n, dtype=np.int64)
    stamps = np.empty(n, dtype=np.int64)
    signs = np.empty(n, dtype=np.int64)
    for i in range(n):
        j = at[group[i]]
        at[group[i]] = j + 1
        keys[j] = ev[i, 1]
        stamps[j] = ev[i, 0]
        signs[j] = ev[i, 2]
    for g in range(groups):  # then: where each key's events start
        start = at[g] - count[g]
        key_put(index, keys[start], start + 1)
    return keys, stamps, signs, index, True


@njit(cache=True, nogil=True)
def hits_at(kmap, keys, ev_key, ev_stamp, ev_sign, ev_index, stamp):  # pragma: no cover - jit
    """How many leading ``keys`` are cached at ``stamp``. A key with events in the replay is
    cached as its last event up to ``stamp`` says (before its first one: as it was at the
    snapshot, the opposite of that event); one without is cached at every stamp as the table
    has it (``kmap``: the snapshot's, or the replay's on it, kept by a forecaster's lease:
    both agree on keys the replay did not change). ``ev_*``: see :func:`events_by_key`."""
    n = ev_key.shape[0]
    for i in range(keys.shape[0]):
        k = keys[i]
        lo = key_get(ev_index, k) - 1 if n else -2
        if lo < 0:
            present = key_get(kmap, k) >= 0
        else:
            j = lo
            while j + 1 < n and ev_key[j + 1] == k and ev_stamp[j + 1] <= stamp:
                j += 1
            present = ev_sign[j] > 0 if ev_stamp[j] <= stamp else ev_sign[lo] < 0
        if not present:
            return i
    return keys.shape[0]


_TOKENS = itertools.count(1)  # the forecasters' lease tokens (block_pool_kernel.lease)


class _EventsLost(Exception):
    """The base's key events overflowed their log: the probe is replayed exactly."""


class Forecaster:
    """Answers many TTFT probes of one snapshot from one base replay (see module doc)."""

    def __init__(self, snapshot: Snapshot, *, sigma: float = DEFAULT_SIGMA,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        self.snapshot = snapshot
        self._setup(snapshot.config, snapshot.model, sigma, max_steps)
        self._state = None if self._caching else self._fresh_state()

    @property
    def time(self) -> float:
        """The instant forecasts are measured from (the snapshot's time)."""
        return self.snapshot.time

    @property
    def streams(self) -> int:
        """Requests resident ahead of a probe (running and waiting)."""
        return len(self.snapshot.running_table) + len(self.snapshot.waiting_table)

    def _fresh_state(self) -> tuple:
        """The replay arrays of the forecast state, before any step (see :func:`_state`)."""
        return _state(self.snapshot, self.sigma)

    def _setup(self, cfg: SchedulerConfig, model: BatchTimeModel, sigma: float,
               max_steps: int) -> None:
        self.config = cfg
        self.sigma = sigma
        self.max_steps = max_steps
        self._cap = cfg.chunk_cap
        self._budget = cfg.max_num_batched_tokens
        self._spare = cfg.watermark_blocks  # the probe is admitted while others run
        self._full = cfg.scheduler_reserve_full_isl
        self._bs = cfg.block_size
        self._model = model
        # with prefix caching the base borrows the engine's cache and keeps its changes between
        # calls (a lease on the pool: see block_pool_kernel); if another replay or the engine took
        # the cache back meanwhile, it is replayed from the snapshot again. Its key events tell
        # when a probe's blocks were cached (see _hits)
        self._caching = cfg.enable_prefix_caching
        self._token = next(_TOKENS)
        self._gen = -1  # the log's generation that holds the lease
        self._events: tuple[np.ndarray, ...] | None = None  # see events_by_key
        self._room = np.zeros(3, dtype=np.int64)  # see scheduler_kernel.run_base
        self._loras = cfg.max_loras
        self._landed: int | None = None  # the base step the last probe's prompt ended in
        self._lora_priced = bool(cfg.max_loras) and self._model.prices_lora
        self._rec = np.empty((64, self._rec_columns()), dtype=np.int64)
        self._cum = np.zeros((65, 4), dtype=np.int64)
        self._rec_t = np.empty(64)
        self._n = 0
        self._done = False
        self._failed = False

    # -- the base trajectory --------------------------------------------------------------------

    def _extend(self, more: int) -> bool:
        """Record base steps until the probe room since admission first reached the queue's
        tail (drained it, without LoRA) has grown by
        ``more`` (> 0) tokens; ``False`` if the base had nothing more to do."""
        if self._done:
            return False
        n0 = self._n
        target = int(self._room[0]) + max(more, 1)
        if self._caching:  # (each extension indexes the key events again: go twice as far)
            target = max(target, 2 * int(self._room[0]))
        state = self._state
        if self._caching and (state is None or not holds(state[12], self._token, self._gen)):
            state = self._state = self._fresh_state()  # from the snapshot again
            self._n = 0
            self._room[:] = 0
        try:
            code = self._record(state, target)
        except BaseException:
            if self._caching:
                _give_back(state)
                self._state = None
            raise
        if self._caching:
            keys, stamps, signs, index, ok = events_by_key(state[12])
            self._events = (keys, stamps, signs, index) if ok else None
            self._gen = lease(state[12], self._token)
        self._ended(code)
        return self._n > n0

    def _record(self, state: tuple, target: int) -> int:
        """Step the base on and record it until its room reaches ``target`` (growing the
        record as needed); returns run_base's code."""
        while True:
            code, n, _ = kn.run_base(*state, self._rec, self._cum, self._rec_t, self._n,
                                     self._room, target, self.max_steps)
            self._n = n
            if code != kn.FULL:
                return code
            self._grow_record()

    def _grow_record(self) -> None:
        grow = self._rec.shape[0]
        self._rec = np.concatenate((self._rec, np.empty((grow, self._rec.shape[1]),
                                                        dtype=np.int64)))
        self._cum = np.concatenate((self._cum, np.zeros((grow, 4), dtype=np.int64)))
        self._rec_t = np.concatenate((self._rec_t, np.empty(grow)))

    def _rec_columns(self) -> int:
        """Columns of the base's record: with ``max_loras``, each step's adapters too (see
        :func:`~duetime.engine.scheduler_kernel.run_base`)."""
        return 3 if not self._loras else kn.REC_ADAPTERS + self._loras

    def _ended(self, code: int) -> None:
        if code != kn.REACHED:
            # Idle, or the base cannot go on (KV livelock, step cap): a probe that needs more
            # than what was recorded runs alone after idle, or is replayed exactly.
            self._done = True
            self._failed = code != kn.IDLE

    # -- probes ---------------------------------------------------------------------------------

    def ttft(self, prompt_tokens: int,
             prompt_hashes: Sequence[int] | np.ndarray | None = None, *,
             lora: int = 0) -> Forecast:
        """TTFT forecast (``until="first_token"``) for a probe of ``prompt_tokens`` tokens at the queue's tail
        (``prompt_hashes``: its block keys, with prefix caching, the adapter in them;
        ``lora``: its adapter, 0 the base model)."""
        try:
            return self._ttft(prompt_tokens, prompt_hashes, lora)
        except _EventsLost:
            return self._replay(int(prompt_tokens), prompt_hashes, lora)

    def _ttft(self, prompt_tokens: int,
              prompt_hashes: Sequence[int] | np.ndarray | None, lora: int) -> Forecast:
        _check_probe(self.config, prompt_tokens, None, "first_token")
        if lora and (type(lora) is not int or lora < 0):
            lora = _check_lora(lora)
        p = int(prompt_tokens)
        cap = self._cap
        bs = self._bs
        keys = None
        if self._caching:
            self._check_cache()
            try:
                keys = block_keys(prompt_hashes)
            except ValueError as e:
                raise ForecastError(f"prompt_hashes: {e}") from None
            if keys is not None:
                keys = keys[:(p - 1) // bs]  # vLLM recomputes the last token
                if not len(keys):
                    keys = None

        # 1. Admission: the first step that goes through the queue ahead and leaves budget, a
        #    seat and KV blocks for the probe (its whole prompt, with vLLM's full-sequence
        #    admission; else its first chunk) with the watermark to spare, and with
        #    max_loras room for its adapter. Admitted while others ahead were skipped for
        #    their adapters (then its adapter is among the step's), it changes nothing in
        #    that step; in later ones it could (their budget, their adapters) only where the
        #    base admits a request: such steps count as the preempting ones below.
        room = self._room
        while not room[1] and self._extend(p):
            pass
        x0 = 0
        c = 0  # with prefix caching: the probe's tokens found cached at its admission
        s = int(room[2]) if room[1] else None
        if s is not None:
            need_flags = kn.TAIL | kn.SEATS
            loras = self._loras
            passed = 0  # rows passed over for a LoRA probe (see SCAN_AFTER)
            while True:
                if s >= self._n:
                    # (a probe on a cold adapter may wait long: the base grows geometrically)
                    if not self._extend(max(p, cap, int(room[0]) if loras else 0)):
                        s = None
                        break
                    continue
                # (one row read as Python ints: a call into the kernel, or reading its
                # fields one by one, would cost a fifth of a probe here)
                row = self._rec[s].tolist()
                la, free, flags = row[0], row[1], row[2]
                if flags & need_flags != need_flags or la <= 0 or (
                        loras and lora > 0 and row[kn.REC_NL] == loras
                        and lora not in row[kn.REC_ADAPTERS:kn.REC_ADAPTERS + loras]):
                    s += 1
                    passed += 1
                    if loras and passed >= SCAN_AFTER:  # (compiled past the first rows: a
                        # cold adapter may wait a thousand steps; a call costs ~1 us)
                        s = kn.scan_admission(self._rec, s, self._n, lora, loras)
                    continue
                if loras and lora > 0 and row[kn.REC_NL] > loras:
                    # the step ran more adapters than max_loras (a snapshot vLLM would not
                    # make): its record lists only the first ones
                    return self._replay(p, keys, lora)
                h = 0 if keys is None else self._hits(keys, 2 * s)
                c = h * bs
                x0 = min(p - c, cap, la)
                need = blocks_for(p if self._full else c + x0, bs) - h + self._spare
                if need + h <= free:  # (even if every hit block costs a free one)
                    break
                if h and need <= free:  # it depends on whether nobody holds them
                    return self._replay(p, keys, lora)
                s += 1
        if s is None:  # the base went idle first: the probe runs alone from then on
            if self._failed:
                return self._replay(p, keys, lora)
            c = 0 if keys is None else self._hits(keys, 1 << 62) * bs
            return self._alone(p, c, 0.0, lora)

        if int(self._rec[s, 2]) & kn.NO_MODEL:
            return self._replay(p, keys, lora)  # the probe would run the step's model alone
        # 2. Progress: the budget the base leaves after its running requests, step by step.
        rem = p - c - x0
        if rem == 0:
            return self._finish(p, s, x0 * x0, 1, c,
                                self._lora_extra(lora, s, s, x0, x0) if self._lora_priced
                                else 0.0)
        base = int(self._cum[s + 1, 0])
        while int(self._cum[self._n, 0]) - base < rem and self._extend(
                max(rem - (int(self._cum[self._n, 0]) - base), int(room[0]))):
            pass
        cum = self._cum
        n = self._n
        e = int(np.searchsorted(cum[:n + 1, 0], base + rem)) - 1
        last = min(e, n - 1)
        c_s = cum[s + 1].tolist()
        c_last = cum[last + 1].tolist()
        if c_last[3] - c_s[3]:
            return self._replay(p, keys, lora)
        if int(self._rec[s:last + 1, 1].min()) < blocks_for(p, bs):
            # KV may run short with the probe resident: replay exactly
            return self._replay(p, keys, lora)
        if e >= n:  # the base went idle before the prompt was done
            if self._failed:
                return self._replay(p, keys, lora)
            done = c + x0 + c_last[0] - base
            sq = x0 * x0 + c_last[1] - c_s[1]
            nsteps = 1 + c_last[2] - c_s[2]
            extra = self._lora_extra(lora, s, n - 1, x0, None) if self._lora_priced else 0.0
            return self._alone(p, done, self._marginal(p, c, done, sq, nsteps) + extra, lora)
        c_e = cum[e].tolist()
        left = rem - (c_e[0] - base)
        sq = x0 * x0 + c_e[1] - c_s[1] + left * left
        nsteps = 2 + c_e[2] - c_s[2]
        return self._finish(p, e, sq, nsteps, c, self._lora_extra(lora, s, e, x0, left)
                            if self._lora_priced else 0.0)

    def _hits(self, keys: np.ndarray, stamp: int) -> int:
        """The probe's blocks found cached when it is looked up: its keys cached at the
        snapshot, changed by the base's key events up to ``stamp`` (2 x step: those of that
        step's scheduling, which precede the probe's admission at its tail)."""
        ev = self._events
        if ev is None:
            raise _EventsLost
        state = self._state
        if state is not None and not holds(state[12], self._token, self._gen):
            # another replay took the cache since this base was recorded: its changes are put
            # back, so that the table is the snapshot's where this base's events are silent
            # (answered from the record, a base may not lean on a table another replay moved on)
            reclaim(state[8], state[9], state[12])
        return hits_at(self._cache_table(), keys, ev[0], ev[1], ev[2], ev[3], stamp)

    def _check_cache(self) -> None:
        """With prefix caching: raise if the cache behind the state is gone or stale."""
        if self.snapshot.prefix is None:
            raise ForecastError("config.enable_prefix_caching: this snapshot carries no "
                                "cache state (take it from a live engine, or use snapshot "
                                "version 2)")
        if not self.snapshot.prefix.is_current():
            raise ForecastError("snapshot: the engine has changed since this snapshot was "
                                "taken; a forecast with prefix caching needs a current one")

    def _cache_table(self) -> Any:
        """The key table of the cache the base borrows (see :func:`hits_at`)."""
        return self.snapshot.prefix.kmap

    def _marginal(self, p: int, c0: int, c1: int, sq: int, nsteps: int) -> float:
        """The probe's own batch-time terms: its prompt tokens ``c0`` to ``c1`` computed in
        ``nsteps`` chunks whose squares sum to ``sq`` (the attention sum does not depend on
        how they were chunked: Σ pre·ctx + pre(pre+1)/2 = c1(c1+1)/2 - c0(c0+1)/2; ``c0``
        are the tokens found cached)."""
        return self._model.duration(0, c1 - c0, sq, (c1 * (c1 + 1) - c0 * (c0 + 1)) // 2, 0,
                                    nsteps * p, nsteps * p * p) - self._model.intercept

    def _lora_extra(self, lora: int, s: int, e: int, x0: int, last: int | None) -> float:
        """What LoRA adds to base steps ``s`` .. ``e`` with the probe in them, on adapter
        ``lora`` (0: the base model) taking ``x0`` tokens in step ``s``, the budget the base
        left in those between, and ``last`` in step ``e`` (None: that budget too): a step
        that holds a LoRA request costs more over all its tokens
        (:mod:`~duetime.engine.batch_time`), so a probe on an adapter pays that for a
        base-only step it joins, and a base probe pays it for its own tokens in a step with
        LoRA (called only when the model prices LoRA)."""
        x = np.diff(self._cum[s:e + 2, 0])  # y: the probe's tokens in a step between
        x[0] = x0
        if last is not None and e > s:
            x[-1] = last
        rec = self._rec[s:e + 1]
        on = x > 0  # (a step with no budget left does not schedule it)
        lora_steps = rec[:, kn.REC_NL] > 0
        m = self._model
        if not lora:
            return m.lora_prefill * int(x[on & lora_steps].sum())
        joined = on & ~lora_steps  # base-only steps it makes LoRA steps
        return (m.lora_prefill * int(x.sum()) + m.lora_step * int(joined.sum())
                + m.lora_prefill * int(rec[joined, kn.REC_PRE].sum())
                + m.lora_decode * int(rec[joined, kn.REC_DEC].sum()))

    def _finish(self, p: int, e: int, sq: int, nsteps: int, c0: int = 0,
                extra: float = 0.0) -> Forecast:
        """The probe's prompt completes in base step ``e`` (``c0`` of it found cached;
        ``extra``: what LoRA adds to its steps)."""
        end = float(self._rec_t[e]) + self._marginal(p, c0, p, sq, nsteps) + extra
        self._landed = e
        return Forecast(end, e + 1)

    def _alone(self, p: int, c: int, extra: float, lora: int = 0) -> Forecast:
        """The base is idle with ``c`` of the probe's ``p`` tokens computed and ``extra`` of
        its batch time spent; it runs alone from there, whole budgets per step (a lone request
        ignores the long-prefill threshold; on adapter ``lora``, each a step with LoRA)."""
        t = (float(self._rec_t[self._n - 1]) if self._n else 0.0) + extra
        k = self._n
        rem = p - c
        y = self._budget
        j = -(-rem // y)
        last = rem - (j - 1) * y
        sq = (j - 1) * y * y + last * last
        attn = p * (p + 1) // 2 - c * (c + 1) // 2
        own = self._model.duration(0, rem, sq, attn, 0, j * p, j * p * p) + (
            (j - 1) * self._model.intercept)
        if lora and self._lora_priced:
            own += j * self._model.lora_step + self._model.lora_prefill * rem
        return Forecast(t + own, k + j)

    # -- finish times -----------------------------------------------------------------------------

    def finish(self, prompt_tokens: int, output_tokens: Sequence[int]) -> list[Forecast]:
        """Finish-time forecasts (``until="finish"``) of one probe of ``prompt_tokens`` tokens,
        one per output length in ``output_tokens`` (a length predictor's quantiles, say): its
        first token as :meth:`ttft` finds it, then one token in each later base step that
        leaves it budget, its own decode terms added (the models are additive over requests).
        Answered from the base record where the first token is, and where, up to the finish,
        the base neither preempts, admits nor runs a step without a model, and keeps blocks
        for the probe's sequence (then it changes nothing the others do), past the record's
        end in closed form once the base only decodes (:meth:`_fast_forward`); otherwise —
        and with prefix caching or LoRA adapters — the length is replayed with the probe, as
        :func:`replay` does. Synchronous and asynchronous scheduling alike (equal to the
        replay on random snapshots of both)."""
        _check_probe(self.config, prompt_tokens, None, "first_token")
        p = int(prompt_tokens)
        lengths = [_check_probe(self.config, p, n, "finish") for n in output_tokens]
        first = e = None
        if not (self._caching or self._loras):
            self._landed = None  # (set where the TTFT is answered from the record)
            first = self.ttft(p)
            e = self._landed
        return [(self._decoded(p, n, first, e) if first is not None and e is not None else None)
                or replay(self.snapshot, p, n, "finish", sigma=self.sigma,
                          max_steps=self.max_steps) for n in lengths]

    def _decoded(self, p: int, n: int, first: Forecast, e: int) -> Forecast | None:
        """The probe's finish with ``n`` output tokens, its prompt done in base step ``e``
        (``first``: that forecast), from the record, and past its end by
        :meth:`_fast_forward` once the base only decodes; None where it must be replayed."""
        if n == 1:
            return Forecast(first.estimate_s, first.steps)
        if p + n >= self.config.max_model_len:
            return None  # (truncated at max_model_len)
        d = n - 1  # decode steps j = 1..d: computed p + j - 1 before it, length p + j
        target = int(self._cum[e + 1, 2]) + d  # its decode steps: those leaving it budget
        need = blocks_for(p + d, self._bs)
        while True:
            cum, last = self._cum, self._n
            if int(cum[last, 2]) >= target:  # the record holds its last token
                k = int(np.searchsorted(cum[:last + 1, 2], target)) - 1
                if int(cum[k + 1, 3]) - int(cum[e + 1, 3]) or (
                        int(self._rec[e + 1:k + 1, 1].min()) < need):
                    return None
                base_end, steps = float(self._rec_t[k]), k + 1
                break
            if int(cum[last, 3]) - int(cum[e + 1, 3]) or (
                    last > e + 1 and int(self._rec[e + 1:last, 1].min()) < need):
                return None
            ff = self._fast_forward(target - int(cum[last, 2]), need)
            if ff is not None:
                base_end = (float(self._rec_t[last - 1]) if last else 0.0) + ff
                steps = last + target - int(cum[last, 2])
                break
            if self._failed or not self._extend(8 * self._cap):  # (a few more steps)
                return None
        ctx = d * p + d * (d - 1) // 2
        lsum = d * p + d * (d + 1) // 2
        top, low = p + d, p
        lsq = (top * (top + 1) * (2 * top + 1) - low * (low + 1) * (2 * low + 1)) // 6
        own = self._model.duration(d, 0, 0, 0, ctx, lsum, lsq) - self._model.intercept
        return Forecast(base_end + (first.estimate_s - float(self._rec_t[e])) + own, steps)

    def _fast_forward(self, steps: int, probe_blocks: int) -> float | None:
        """The base's next ``steps`` steps' time, from the end of the record, where it only
        decodes from there with the probe beside it: nobody waits, every running request has
        one token to compute, each gets its token every step (seats and budget for all and
        the probe) and the blocks suffice for all to their ends and the probe's
        ``probe_blocks``. Then request ``r`` decodes its ``m_r`` remaining tokens in the
        next ``m_r`` steps (to its stop length or ``max_model_len``), its context growing by
        one a step, and the steps' features sum in closed form (asynchronously its tokens
        in flight count as outputs, as the scheduler counts them); None otherwise."""
        state = self._state
        ok, n_dec, ctx, lsum, lsq = kn.decode_ahead(state[0], state[2], state[4], state[6],
                                                    steps, probe_blocks)
        if not ok:
            return None
        return (self._model.duration(n_dec, 0, 0, 0, ctx, lsum, lsq)
                + (steps - 1) * self._model.intercept)

    def _replay(self, p: int, prompt_hashes: Sequence[int] | np.ndarray | None = None,
                lora: int = 0) -> Forecast:
        return replay(self.snapshot, p, None, "first_token", sigma=self.sigma,
                      max_steps=self.max_steps, prompt_hashes=prompt_hashes, lora=lora)


def forecaster(snapshot: Snapshot) -> Forecaster:
    """The snapshot's forecaster, built once and kept on the (immutable) snapshot."""
    fc = snapshot._cache.get("forecaster")
    if fc is None:
        fc = snapshot._cache["forecaster"] = Forecaster(snapshot)
    return fc


def forecast(snapshot: Snapshot, prompt_tokens: int, predicted_output_tokens: int | None = None,
             until: Until = "first_token", trace: bool = False,
             prompt_hashes: Sequence[int] | np.ndarray | None = None,
             lora: int = 0) -> Forecast:
    """Forecast the probe's TTFT (``until="first_token"``) or end-to-end latency
    (``until="finish"``, needs ``predicted_output_tokens``) from ``snapshot.time``.

    With ``trace=True`` every replayed step is listed (this uses the reference loop). With
    prefix caching, ``prompt_hashes`` are the probe's block keys (the full blocks of its
    prompt, as the instance hashes them, its adapter in them): its cached prefix is not
    computed again. ``lora``: the probe's LoRA adapter (vLLM's ``lora_int_id``; 0: the base
    model), capped with the others at ``max_loras`` per step.
    """
    if trace:
        return replay(snapshot, prompt_tokens, predicted_output_tokens, until, trace=True,
                      lora=lora)
    if until == "first_token":
        return forecaster(snapshot).ttft(prompt_tokens, prompt_hashes, lora=lora)
    return replay(snapshot, prompt_tokens, predicted_output_tokens, until,
                  prompt_hashes=prompt_hashes, lora=lora)
