"""TTFT and end-to-end forecasts from a snapshot (the SFS estimator's core).

A forecast appends a probe request at the tail of the waiting queue and replays the scheduler
until the probe's first token (or its finish), with no arrivals.

Further probes of the same snapshot are cheap. Everything ahead of the probe evolves the same
whatever its length: it is last in the waiting queue, and once admitted it is last in the
running order, so it only takes budget nobody else wants and is the first to be preempted. So
the :class:`Forecaster` replays the snapshot *without* a probe once (the base trajectory, as
segments) and answers each probe from it: find the first step where the queue ahead has drained
with budget, a seat and KV blocks left; then the probe takes, step by step, the budget the base
left after its running requests, until its prompt is done. Its time is the base time plus its
own batch-time terms (the models are additive over requests). If the base trajectory preempts
after the probe would have been admitted, or runs the KV cache too short to hold the probe,
the probe changes what others do, and the forecaster replays the snapshot with the probe
instead (exact, just slower). The equivalence with the reference loop is tested.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Literal

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.fast import FastReplay, Segment
from duetime.engine.remaining import DEFAULT_SIGMA, stop_length
from duetime.engine.request import Request
from duetime.engine.scheduler import EngineStuck, ReferenceEngine, blocks_for
from duetime.engine.snapshot import Snapshot

Until = Literal["first_token", "finish"]
PROBE_ID = "probe"
DEFAULT_MAX_STEPS = 1_000_000


class ForecastError(ValueError):
    """A forecast that cannot be made (bad probe, or the replay cannot finish)."""


@dataclass(slots=True)
class Forecast:
    """``estimate_s`` is measured from the snapshot's ``time``; ``steps`` counts replayed steps
    up to and including the probe's event; ``trace`` lists them when asked for."""

    estimate_s: float
    steps: int
    trace: list[dict[str, Any]] | None = field(default=None)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"estimate_s": self.estimate_s, "steps": self.steps}
        if self.trace is not None:
            d["trace"] = self.trace
        return d


def _requests(snapshot: Snapshot, sigma: float) -> tuple[list[Request], list[Request]]:
    """Fresh engine requests from a snapshot; stop lengths from the predictions."""
    def make(r) -> Request:
        return Request(r.id, r.prompt_tokens,
                       stop_length(r.predicted_output_tokens, r.output_tokens, sigma),
                       output=r.output_tokens, computed=r.computed_tokens, arrival=r.arrival)
    return [make(r) for r in snapshot.running], [make(r) for r in snapshot.waiting]


def _probe_id(snapshot: Snapshot) -> str:
    ids = {r.id for r in snapshot.running} | {r.id for r in snapshot.waiting}
    pid = PROBE_ID
    i = 1
    while pid in ids:
        i += 1
        pid = f"{PROBE_ID}#{i}"
    return pid


def _check_probe(config: SchedulerConfig, prompt_tokens: int,
                 predicted_output_tokens: int | None, until: str) -> int:
    if until not in ("first_token", "finish"):
        raise ForecastError(f"until: must be 'first_token' or 'finish', got {until!r}")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ForecastError(f"prompt_tokens: must be an integer >= 1, got {prompt_tokens!r}")
    if prompt_tokens >= config.max_model_len:
        raise ForecastError(f"prompt_tokens: {prompt_tokens} does not fit max_model_len "
                            f"{config.max_model_len}")
    if blocks_for(prompt_tokens, config.block_size) > config.num_gpu_blocks:
        raise ForecastError(f"prompt_tokens: {prompt_tokens} tokens need more KV blocks than "
                            f"the instance has ({config.num_gpu_blocks} x {config.block_size})")
    if until == "finish":
        if predicted_output_tokens is None:
            raise ForecastError("predicted_output_tokens: required when until='finish'")
        if (isinstance(predicted_output_tokens, bool)
                or not isinstance(predicted_output_tokens, int) or predicted_output_tokens < 1):
            raise ForecastError("predicted_output_tokens: must be an integer >= 1, got "
                                f"{predicted_output_tokens!r}")
        return predicted_output_tokens
    return 1


def replay(snapshot: Snapshot, prompt_tokens: int, predicted_output_tokens: int | None = None,
           until: Until = "first_token", *, reference: bool = False, trace: bool = False,
           sigma: float = DEFAULT_SIGMA, max_steps: int = DEFAULT_MAX_STEPS) -> Forecast:
    """Replay the snapshot with the probe appended, step by step or with the fast engine.

    ``reference=True`` (implied by ``trace``) uses the plain per-request loop: the oracle.
    """
    stop = _check_probe(snapshot.config, prompt_tokens, predicted_output_tokens, until)
    running, waiting = _requests(snapshot, sigma)
    probe = Request(_probe_id(snapshot), prompt_tokens, stop, arrival=snapshot.time)
    waiting.append(probe)
    attr = "first_token" if until == "first_token" else "finished"
    t0 = snapshot.time
    try:
        if reference or trace:
            eng = ReferenceEngine(snapshot.config, snapshot.model, time=t0, running=running,
                                  waiting=waiting)
            steps: list[dict[str, Any]] | None = [] if trace else None
            while getattr(probe, attr) is None:
                if eng.steps >= max_steps:
                    raise ForecastError(f"replay did not reach the probe's {until} within "
                                        f"{max_steps} steps")
                rec = eng.step()
                if steps is not None and rec is not None:
                    steps.append(rec.to_dict())
            return Forecast(getattr(probe, attr) - t0, eng.steps, steps)
        fast = FastReplay(snapshot.config, snapshot.model, time=t0, running=running,
                          waiting=waiting)
        while getattr(probe, attr) is None:
            if fast.k >= max_steps:
                raise ForecastError(f"replay did not reach the probe's {until} within "
                                    f"{max_steps} steps")
            fast.advance()
        return Forecast(getattr(probe, attr) - t0, fast.k)
    except EngineStuck as e:
        raise ForecastError(f"replay cannot progress: {e}") from None


class Forecaster:
    """Answers many TTFT probes of one snapshot from one base replay (see module doc)."""

    def __init__(self, snapshot: Snapshot, *, sigma: float = DEFAULT_SIGMA,
                 max_steps: int = DEFAULT_MAX_STEPS) -> None:
        self.snapshot = snapshot
        self.sigma = sigma
        self.max_steps = max_steps
        cfg = snapshot.config
        self._cap = cfg.chunk_cap
        self._budget = cfg.max_num_batched_tokens
        self._bs = cfg.block_size
        self._model: BatchTimeModel = snapshot.model
        self._intercept = self._model.duration(0, 0, 0, 0, 0, 0, 0)
        running, waiting = _requests(snapshot, sigma)
        self._base = FastReplay(cfg, snapshot.model, time=snapshot.time, running=running,
                                waiting=waiting)
        self._segs: list[Segment] = []
        # Probe tokens the base leaves after its running phase, summed over whole segments:
        # _room[i] = Σ_{j<i} min(cap, running_budget_j) · m_j. Likewise squares and step counts.
        self._room: list[int] = [0]
        self._room_sq: list[int] = [0]
        self._room_steps: list[int] = [0]
        self._first_drained: int | None = None
        self._done = False

    # -- the base trajectory --------------------------------------------------------------------

    def _extend(self) -> bool:
        """Replay one more base segment; ``False`` when the base has gone idle."""
        if self._done:
            return False
        base = self._base
        if base.k >= self.max_steps:
            raise ForecastError(f"the snapshot's replay exceeded {self.max_steps} steps")
        try:
            seg = base.advance()
        except EngineStuck as e:
            raise ForecastError(f"replay cannot progress: {e}") from None
        if seg is None:
            self._done = True
            return False
        i = len(self._segs)
        self._segs.append(seg)
        y = min(self._cap, seg.running_budget)
        self._room.append(self._room[-1] + y * seg.m)
        self._room_sq.append(self._room_sq[-1] + y * y * seg.m)
        self._room_steps.append(self._room_steps[-1] + (seg.m if y > 0 else 0))
        if self._first_drained is None and seg.drained:
            self._first_drained = i
        return True

    def _segment(self, i: int) -> Segment | None:
        while i >= len(self._segs):
            if not self._extend():
                return None
        return self._segs[i]

    def _end_of(self, seg: Segment, j: int) -> float:
        """End time of the ``j``-th step (1-based) of a base segment."""
        if j == seg.m:
            return seg.t_end
        n, s1, s2 = seg.decoders  # only stretches have m > 1
        return seg.t_start + self._model.stretch(n, s1, s2, j)

    # -- probes ---------------------------------------------------------------------------------

    def first_token(self, prompt_tokens: int) -> Forecast:
        """TTFT forecast for a probe of ``prompt_tokens`` tokens at the queue's tail."""
        cfg = self.snapshot.config
        _check_probe(cfg, prompt_tokens, None, "first_token")
        p = prompt_tokens
        cap = self._cap
        bs = self._bs

        # 1. Admission: the first segment whose first step drains the queue ahead with budget,
        #    a seat and KV blocks for the probe's first chunk (within a stretch nothing improves).
        i = self._first_drained
        while i is None:
            if not self._extend():
                break
            i = self._first_drained
        seg = None
        x0 = 0
        if i is not None:
            while True:
                seg = self._segment(i)
                if seg is None:
                    break
                if seg.drained and seg.budget > 0 and seg.seats:
                    x0 = min(p, cap, seg.budget)
                    if blocks_for(x0, bs) <= seg.free_first:
                        break
                i += 1
        if seg is None:  # the base went idle first: the probe runs alone from then on
            return self._alone(p, 0, self._base.t, self._base.k, 0.0)

        # 2. Progress: the rest of the admission segment, then whole segments, until done.
        ia = i
        rem = p - x0
        if rem == 0:
            return self._finish(p, ia, 1, x0 * x0, 1, [ia])
        y = min(cap, seg.running_budget)
        within = y * (seg.m - 1)
        if within >= rem:  # done inside the admission stretch
            j = -(-rem // y)
            last = rem - (j - 1) * y
            sq = x0 * x0 + (j - 1) * y * y + last * last
            return self._finish(p, ia, 1 + j, sq, 1 + j, [ia])
        # Whole segments after ia: find the one where the room reaches what is left.
        need = rem - within
        sq0 = x0 * x0 + y * y * (seg.m - 1)
        steps0 = 1 + (seg.m - 1 if y > 0 else 0)
        base_room = self._room[ia + 1]
        while self._room[-1] - base_room < need and self._extend():
            pass
        ie = bisect_left(self._room, base_room + need) - 1
        if ie < ia + 1 or ie >= len(self._segs):  # base went idle before the prompt was done
            used = self._room[-1] - base_room
            c = x0 + within + used
            sq = sq0 + self._room_sq[-1] - self._room_sq[ia + 1]
            nsteps = steps0 + self._room_steps[-1] - self._room_steps[ia + 1]
            if not self._kv_ok(ia, len(self._segs) - 1, c):
                return self._replay(p)
            if any(self._segs[s].preempted for s in range(ia + 1, len(self._segs))):
                return self._replay(p)
            extra = self._model.duration(0, c, sq, c * (c + 1) // 2, 0, nsteps * p,
                                         nsteps * p * p) - self._intercept
            return self._alone(p, c, self._base.t, self._base.k, extra)
        segE = self._segs[ie]
        got = self._room[ie] - base_room
        left = need - got
        yE = min(cap, segE.running_budget)
        j = -(-left // yE)
        last = left - (j - 1) * yE
        sq = (sq0 + self._room_sq[ie] - self._room_sq[ia + 1] + (j - 1) * yE * yE
              + last * last)
        nsteps = steps0 + self._room_steps[ie] - self._room_steps[ia + 1] + j
        span = range(ia + 1, ie + 1)
        if any(self._segs[s].preempted for s in span):
            return self._replay(p)
        return self._finish(p, ie, j, sq, nsteps, [ia, *span])

    def _kv_ok(self, first: int, last: int, tokens: int) -> bool:
        """Did the base leave room for the probe's blocks in every segment of the span?"""
        need = blocks_for(tokens, self._bs)
        segs = self._segs
        return all(segs[s].free_last >= need for s in range(first, last + 1))

    def _finish(self, p: int, ie: int, j: int, sq: int, nsteps: int,
                span: list[int]) -> Forecast:
        """The probe's prompt completes in step ``j`` of segment ``ie``."""
        segE = self._segs[ie]
        if len(span) == 1 and j == 1:  # one step: the exact free count is known
            if segE.free_first < blocks_for(p, self._bs):
                return self._replay(p)
        elif not self._kv_ok(span[0], span[-1], p):
            return self._replay(p)
        extra = self._model.duration(0, p, sq, p * (p + 1) // 2, 0, nsteps * p,
                                     nsteps * p * p) - self._intercept
        end = self._end_of(segE, j) + extra
        return Forecast(end - self.snapshot.time, segE.k0 + j)

    def _alone(self, p: int, c: int, t: float, k: int, extra: float) -> Forecast:
        """The probe has ``c`` of ``p`` tokens computed when the base goes idle at ``t``, step
        ``k``; ``extra`` is its batch-time share so far. It runs alone from there."""
        rem = p - c
        if rem == 0:  # cannot happen: the base was idle after the step that completed it
            return Forecast(t + extra - self.snapshot.time, k)
        y = min(self._cap, self._budget)
        j = -(-rem // y)
        last = rem - (j - 1) * y
        sq = (j - 1) * y * y + last * last
        attn = p * (p + 1) // 2 - c * (c + 1) // 2
        own = self._model.duration(0, rem, sq, attn, 0, j * p, j * p * p) + (
            (j - 1) * self._intercept)
        return Forecast(t + extra + own - self.snapshot.time, k + j)

    def _replay(self, p: int) -> Forecast:
        return replay(self.snapshot, p, None, "first_token", sigma=self.sigma,
                      max_steps=self.max_steps)


def forecaster(snapshot: Snapshot) -> Forecaster:
    """The snapshot's forecaster, built once and kept on the (immutable) snapshot."""
    fc = snapshot._cache.get("forecaster")
    if fc is None:
        fc = snapshot._cache["forecaster"] = Forecaster(snapshot)
    return fc


def forecast(snapshot: Snapshot, prompt_tokens: int, predicted_output_tokens: int | None = None,
             until: Until = "first_token", trace: bool = False) -> Forecast:
    """Forecast the probe's TTFT (``until="first_token"``) or end-to-end latency
    (``until="finish"``, needs ``predicted_output_tokens``) from ``snapshot.time``.

    With ``trace=True`` every replayed step is listed (this uses the reference loop).
    """
    if trace:
        return replay(snapshot, prompt_tokens, predicted_output_tokens, until, trace=True)
    if until == "first_token":
        return forecaster(snapshot).first_token(prompt_tokens)
    return replay(snapshot, prompt_tokens, predicted_output_tokens, until)
