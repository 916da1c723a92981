"""The reference step loop: vLLM V1 continuous batching, one request at a time.

This is the plain, readable statement of the rules in ``docs/scheduling-rules.md`` (vLLM's own
scheduler being the oracle it is tested against in ``tests/e2e``), and the oracle that the
compiled replay (``duetime.engine.scheduler_kernel``) is tested against. It is also a stepping engine
for callers that want every step (traces, small simulations): add requests at step boundaries,
call :meth:`ReferenceEngine.step`, read the :class:`StepRecord` it returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.kv import KVLedger, stuck_reason
from duetime.engine.request import Request


class EngineStuck(RuntimeError):
    """Work is resident but can never progress: the waiting head cannot be admitted (and
    nothing runs), or it outgrows the whole KV cache and is preempted and recomputed for ever
    (a livelock, seen the second time it preempts itself alone with no output since)."""


@dataclass(slots=True)
class StepRecord:
    """What one step did. Times are the step's start and end on the engine clock."""

    index: int
    start: float
    end: float
    prefill: dict[str, int] = field(default_factory=dict)
    decode: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    first_token_ids: list[str] = field(default_factory=list)  # got their first token
    finished_ids: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # requests that produced an output token
    scheduled: list[tuple[str, int]] = field(default_factory=list)  # in schedule order
    hits: list[tuple[str, int]] = field(default_factory=list)  # prefix-cache hits, in tokens
    skipped: list[str] = field(default_factory=list)  # max_loras: skipped waiting requests
    outputs_of: int | None = None  # async: the step whose outputs the three lists above are

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {"end": self.end, "duration": self.duration, "prefill": dict(self.prefill),
                "decode": list(self.decode), "preempted": list(self.preempted)}


class ReferenceEngine:
    """One instance's scheduler, replayed step by step with explicit per-request state."""

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 running: Iterable[Request] = (), waiting: Iterable[Request] = (),
                 free_blocks: int | None = None, steps: int = 0) -> None:
        """Running requests hold ``ceil(computed / block_size)`` blocks each unless
        ``free_blocks`` is given (a caller handing over exact state keeps its own count)."""
        self.config = config
        self.model = model
        self.time = time
        self.steps = steps
        self.running: list[Request] = list(running)
        self.waiting: deque[Request] = waiting if isinstance(waiting, deque) else deque(waiting)
        self.kv = KVLedger.of(config, free_blocks)
        # async: the last step's requests and who samples; a running request with all its
        # tokens computed has its next token in flight (a state taken between the two)
        self._inflight: list[tuple[Request, bool]] = []
        if config.async_scheduling:
            for r in self.running:
                if r.computed == r.prompt + r.output:
                    r.pending = 1
                    self._inflight.append((r, True))
        self._lone: Request | None = None  # the livelock watch (see step)
        self._quiet = False
        # False: a livelock goes on as in vLLM (a caller that will add requests later)
        self.watch_livelock = True
        if free_blocks is None:
            for r in self.running:
                self.kv.hold(r, r.computed)
            for r in self.waiting:
                r.blocks = 0
                r.block_ids = []
                r.num_cached = 0
        if self.kv.free_blocks < 0:
            raise ValueError(f"running requests hold {self.kv.used_blocks} KV blocks but the "
                             f"instance has only {config.usable_blocks} (of "
                             f"num_gpu_blocks = {config.num_gpu_blocks}, one is the null block)")

    @property
    def free_blocks(self) -> int:
        return self.kv.free_blocks

    # -- stepping API -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request at the tail of the waiting queue (takes effect at the next step)."""
        request.blocks = 0
        request.block_ids = []
        request.num_cached = 0
        self.waiting.append(request)
        self._lone = None  # the livelock watch starts over (see step)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and not self._inflight

    def step(self) -> StepRecord | None:
        """Run one scheduler step; ``None`` when there is nothing to do.

        The phases of vLLM's ``Scheduler.schedule()`` and ``update_from_output``
        (``docs/scheduling-rules.md``), one method each: the running requests
        (:meth:`_schedule_running`), the waiting ones if nobody was preempted
        (:meth:`_schedule_waiting`), the step's duration (:meth:`_execute`), the outputs
        (:meth:`_apply` or :meth:`_apply_async`), the finished requests' leaving and the
        livelock watch.

        With ``async_scheduling`` (vLLM's ``AsyncScheduler`` under the engine core's batch
        queue of two) the step is scheduled before the previous step's output is applied:
        a request that will sample counts a placeholder token (``pending``) and is scheduled
        again on it; one whose in-flight token is its last is not; outputs of step k are
        applied after step k+1 is scheduled, so a finishing request holds its seat and blocks
        for one more schedule. Its record's ``first_token_ids``, ``finished_ids`` and ``tokens`` are
        then those of the previous step (``outputs_of``), stamped with that step's end.
        """
        if self.idle:
            return None
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # a lone request ignores the long-prefill threshold (nobody to starve)
        cap = cfg.chunk_cap if len(self.running) + len(self.waiting) > 1 else budget
        rec = StepRecord(self.steps, self.time, self.time)
        budget, scheduled = self._schedule_running(budget, cap, rec)
        if not rec.preempted:
            self._schedule_waiting(budget, cap, rec, scheduled)
        rec.scheduled = [(r.id, n) for r, n in scheduled]
        if not scheduled and not rec.preempted and not self._inflight:
            raise EngineStuck(self._stuck_reason())
        # A step that only preempted runs no model: it takes no time (as in vLLM).
        end = self.time + (self._execute(scheduled, rec) if scheduled else 0.0)
        rec.end = end
        if cfg.async_scheduling:
            self._apply_async(scheduled, rec)
        else:
            self._apply(scheduled, end, rec)
        if rec.finished_ids:
            self._drop_finished()
        if rec.preempted and not scheduled:
            self._watch_livelock()
        self.time = end
        self.steps += 1
        return rec

    def _schedule_running(self, budget: int, cap: int,
                          rec: StepRecord) -> tuple[int, list[tuple[Request, int]]]:
        """Phase 1 (vLLM's "schedule the RUNNING requests"): each running request in order,
        while budget remains, gets its next chunk; while too few blocks are free for it, the
        *last* running request is preempted (recompute: its blocks are freed, its computed
        tokens forgotten, and it goes to the front of the waiting queue), maybe itself: then
        it is not scheduled and the phase ends. Returns the budget left and the requests
        scheduled with their token counts, in order."""
        kv = self.kv
        max_len = self.config.max_model_len
        running, waiting = self.running, self.waiting
        inflight = ({r.id for r, _ in self._inflight} if self.config.async_scheduling
                    else ())
        scheduled: list[tuple[Request, int]] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            if r.pending and r.computed + 2 - r.pending >= r.prompt + r.stop:
                i += 1  # its token in flight is its last: no step beyond it
                continue
            n = min(r.prompt + r.output + r.pending - r.computed, cap, budget,
                    max_len - r.computed - 1)
            if n <= 0:  # its token in flight reaches max_model_len
                i += 1
                continue
            target = r.computed + n
            need = kv.need(r, target)
            ok = True
            while not kv.fits(need):
                v = running.pop()
                kv.free(v)
                v.computed = 0
                v.pending = 0
                v.stale = v.id in inflight
                waiting.appendleft(v)
                rec.preempted.append(v.id)
                if v is r:  # still too big with all after it preempted: it waits
                    ok = False
                    break
            if not ok:
                break
            kv.take(r, need, min(target, r.prompt + r.output))
            scheduled.append((r, n))
            budget -= n
            i += 1
        return budget, scheduled

    def _schedule_waiting(self, budget: int, cap: int, rec: StepRecord,
                          scheduled: list[tuple[Request, int]]) -> None:
        """Phase 2 (vLLM's "schedule the WAITING requests"; only in a step that preempted
        nobody): the waiting queue's head, FCFS, while budget and a seat remain, gets its
        first chunk if the block ledger admits it (its whole sequence fits, with the
        watermark while others run); if not, admission stops: nobody behind it is admitted.
        With prefix caching, a request with nothing computed first looks up its cached
        prefix and computes only the rest. With ``max_loras``, a request whose adapter is not
        among the step's adapters (those of the requests scheduled so far) when they are
        ``max_loras`` already is skipped, before any lookup: it leaves the queue for the rest
        of the phase (the next ones are tried) and goes back to its front, in queue order,
        when the phase ends. Appends to ``scheduled``."""
        kv = self.kv
        cfg = self.config
        running, waiting = self.running, self.waiting
        max_loras = cfg.max_loras
        # (vLLM asserts the running ones are at most max_loras; a snapshot given from outside
        # may have more: then none is added)
        loras = {r.lora for r, _ in scheduled if r.lora > 0} if max_loras else set()
        skipped: list[Request] = []
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[0]
            # (a stale output is applied before the next schedule: with a batch queue
            # of two vLLM never has to skip a request for it)
            assert not r.stale
            if max_loras and r.lora > 0 and len(loras) >= max_loras and r.lora not in loras:
                skipped.append(waiting.popleft())  # its adapter would exceed max_loras
                continue
            length = r.prompt + r.output
            # prefix caching: the cached run of its full blocks is not computed again
            hits = kv.lookup(r) if r.computed == 0 else ()
            c = r.computed + len(hits) * kv.block_size
            n = min(length - c, cap, budget)
            need = kv.admit(r, min(length, cfg.max_model_len), c + n, bool(running), hits)
            if need is None:
                break
            waiting.popleft()
            running.append(r)
            if max_loras and r.lora > 0:
                loras.add(r.lora)
            if hits:
                kv.reuse(r, hits)
                r.computed = c
                rec.hits.append((r.id, c))
            kv.take(r, need, min(c + n, length))
            scheduled.append((r, n))
            budget -= n
        waiting.extendleft(reversed(skipped))
        rec.skipped = [r.id for r in skipped]

    def _execute(self, scheduled: list[tuple[Request, int]], rec: StepRecord) -> float:
        """The step's duration: the batch-time model of the composition (exact integer
        features, ``docs/engine.md``; a token in flight counts as the output it will be).
        Lists each request as a decode or a prefill of ``n`` tokens in ``rec``."""
        n_dec = n_pre = pre_sq = pre_attn = dec_ctx = len_sum = len_sq = 0
        for r, n in scheduled:
            c = r.computed
            out = r.output + r.pending
            length = r.prompt + out
            len_sum += length
            len_sq += length * length
            if out >= 1 and length - c == 1:
                n_dec += 1
                dec_ctx += c
                rec.decode.append(r.id)
            else:
                n_pre += n
                pre_sq += n * n
                pre_attn += n * c + n * (n + 1) // 2
                rec.prefill[r.id] = n
        dur = self.model.duration(n_dec, n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq)
        if self.config.max_loras and any(r.lora > 0 for r, _ in scheduled):
            dur += self.model.lora_duration(n_dec, n_pre)  # (a step with LoRA: all its tokens)
        return dur

    def _apply(self, scheduled: list[tuple[Request, int]], end: float,
               rec: StepRecord) -> None:
        """Synchronously, at the step's end: each scheduled request's computed tokens grow
        (vLLM's ``_update_after_schedule``); one that has computed all its tokens samples one
        (``update_from_output``)."""
        for r, n in scheduled:
            r.computed += n
            if r.computed == r.prompt + r.output:
                self._sampled(r, end, rec)

    def _apply_async(self, scheduled: list[tuple[Request, int]], rec: StepRecord) -> None:
        """Asynchronously: this step's requests compute their tokens, and one whose chunk
        reaches the end of its sequence counts a placeholder; then the previous step's
        outputs are applied, stamped with its end (this step's start), a preempted request's
        stale one too; this step's requests are the ones in flight now."""
        rec.outputs_of = self.steps - 1
        sampling = []
        for r, n in scheduled:
            r.computed += n
            samples = r.computed >= r.prompt + r.output + r.pending
            if samples:
                r.pending += 1
            sampling.append((r, samples))
        for r, samples in self._inflight:
            if r.finished is not None:
                continue
            stale, r.stale = r.stale, False
            if samples:
                if not stale:
                    r.pending -= 1
                self._sampled(r, self.time, rec, cache=not stale)
        self._inflight = sampling

    def _drop_finished(self) -> None:
        """Finished requests leave the running order (and, asynchronously, the waiting queue,
        where one preempted with its last token in flight went)."""
        self.running = [r for r in self.running if r.finished is None]
        if len(self.waiting) and any(r.finished is not None for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.finished is None)

    def _watch_livelock(self) -> None:
        """A step that only preempted: the head preempted itself and nothing runs after this
        step (whoever was skipped has just finished). A livelock if this happened before
        with no output since: every request waits with nothing computed, in the same order,
        with the same outputs, so the steps since then repeat for ever."""
        assert not self.running
        lone = self.waiting[0]
        if self._lone is lone and self._quiet and self.watch_livelock:
            raise EngineStuck(self._stuck_reason())
        self._lone, self._quiet = lone, True

    def _sampled(self, r: Request, t: float, rec: StepRecord, cache: bool = False) -> None:
        """``r`` gets an output token at time ``t``; it may finish (its blocks go back).
        Asynchronously (``cache``: it was running when the token was sampled), its blocks full
        of known computed tokens are registered in the prefix cache first, as vLLM's
        ``AsyncScheduler`` does when it applies an output."""
        r.output += 1
        if cache and self.kv.pool is not None:
            self.kv.take(r, 0, min(r.computed - r.pending, r.prompt + r.output))
        self._quiet = False
        rec.tokens.append(r.id)
        if r.output == 1:
            r.first_token = t
            rec.first_token_ids.append(r.id)
        if r.output >= r.stop or r.prompt + r.output >= self.config.max_model_len:
            r.finished = t
            self.kv.free(r)
            rec.finished_ids.append(r.id)

    def _stuck_reason(self) -> str:
        head = self.waiting[0] if self.waiting else None
        if head is not None:
            return stuck_reason(head.id, head.prompt, head.output, head.stop, self.config)
        return "no running request can be scheduled"
