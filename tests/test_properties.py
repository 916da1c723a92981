"""Property-based tests (hypothesis) of the V1 scheduler rules, the forecast and the fast paths.

Strategies build small but consistent engine states: a :class:`SchedulerConfig` with a token
budget of 4..64, ``max_num_seqs`` 1..16, block sizes 1/2/4/16, KV caches from tight (a few
blocks beyond what the running requests hold) to ample, and a prefill threshold that is off or
small; running requests that are decoding, partially prefilled or recomputing after a
preemption; waiting requests (some preempted, with outputs); both batch-time models with
positive coefficients.

Engine properties (``ReferenceEngine`` stepped for up to :data:`ENGINE_STEPS` steps, checked at
every step boundary): token budget and threshold, KV accounting, the sequence cap, FCFS
admission, token conservation, decodes before new prefills, and ``EngineStuck`` only when one
request cannot fit the KV cache.

Forecast properties (``Snapshot`` + ``forecast``): the TTFT forecast is non-decreasing in the
probe's prompt length (ample and tight KV); more work queued ahead of the probe never brings its
first token to an earlier step (ample KV) nor, with paper4, lowers its TTFT when a request is
added. The stronger "never lowers the TTFT" is false under the V1 rules and these batch-time
models: the counterexamples hypothesis found are kept as documented strict xfails. The compiled
replay equals the reference loop exactly, the forecaster within rounding.

``DUETIME_PROPERTY_SCALE=15`` multiplies every example count (a deeper local search, ~4 min).

Rules: ``docs/scheduling-rules.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from duetime.engine import (
    EngineStuck,
    Forecaster,
    ForecastError,
    Paper4,
    ReferenceEngine,
    Request,
    ResidentRequest,
    SchedulerConfig,
    Sfs6,
    Snapshot,
    StepRecord,
    forecast,
    replay,
    stop_length,
)
from duetime.engine.kv import blocks_for
from snapshots import PAPER4, SFS6, random_snapshot

ENGINE_STEPS = 200       # steps of the reference engine per example
MAX_STEPS = 20_000       # bound on every replay
AMPLE_BLOCKS = 1_000_000
REL = 1e-12              # relative float slack of the monotonicity checks


def clock_slack(time: float, estimate: float, steps: float) -> float:
    """Rounding of a time computed on the absolute clock: forecasts add step durations to the
    snapshot's ``time`` (a fraction of an ulp of the clock per step) and subtract it at the end,
    by different paths in the forecaster and the reference loop."""
    if math.isinf(estimate) or math.isinf(steps):
        return 0.0
    return (steps + 2) * math.ulp(abs(time) + abs(estimate))


# Exploring locally, the same examples every run in CI (``CI`` set); no timing deadlines.
BASE = settings(deadline=None, derandomize=bool(os.environ.get("CI")),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALE = float(os.environ.get("DUETIME_PROPERTY_SCALE", "1"))


def props(max_examples: int) -> settings:
    return settings(BASE, max_examples=max(1, int(max_examples * SCALE)))


# -- strategies ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """One request: ``stop`` is the true stop length (engine) or the prediction (snapshot)."""

    id: str
    prompt: int
    computed: int
    output: int
    stop: int

    def request(self) -> Request:
        return Request(self.id, self.prompt, self.stop, output=self.output,
                       computed=self.computed)

    def resident(self) -> ResidentRequest:
        return ResidentRequest(self.id, self.prompt, self.computed, self.output, self.stop, 0.0)


@dataclass(frozen=True)
class State:
    config: SchedulerConfig
    model: Paper4 | Sfs6
    running: tuple[Spec, ...]
    waiting: tuple[Spec, ...]
    time: float = 0.0

    def engine(self) -> tuple[ReferenceEngine, dict[str, Request]]:
        run = [s.request() for s in self.running]
        wait = [s.request() for s in self.waiting]
        eng = ReferenceEngine(self.config, self.model, time=self.time, running=run, waiting=wait)
        return eng, {r.id: r for r in run + wait}

    def snapshot(self) -> Snapshot:
        snap = Snapshot(self.config, self.model, time=self.time,
                        running=[s.resident() for s in self.running],
                        waiting=[s.resident() for s in self.waiting])
        snap.check()
        return snap


coefficients = st.one_of(
    st.floats(min_value=1e-9, max_value=1e-1, allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-9, 1e-6, 1e-3, 1.0]))
models = st.one_of(
    st.sampled_from([PAPER4, SFS6]),
    st.builds(Paper4, b0=coefficients, b1=coefficients, b2=coefficients, b3=coefficients),
    st.builds(Sfs6, c0=coefficients, cp=coefficients, cpsq=coefficients, cd=coefficients,
              cs=coefficients, css=coefficients))
prompts = st.one_of(st.integers(1, 12), st.integers(1, 48), st.integers(1, 160))


@st.composite
def requests(draw, max_len: int, kind: str, snapshot: bool) -> tuple[int, int, int, int]:
    """``(prompt, computed, output, stop)`` of one request of ``kind``: ``decode`` (O >= 1,
    C = P + O - 1), ``prefill`` (O = 0, C < P), ``recompute`` (O >= 1, C < P + O - 1) or
    ``waiting`` (C = 0, O mostly 0). Engine requests stop at 1..20 with O < stop; snapshot
    predictions are 1..20 and may be below O (the forecast's conditional rule)."""
    p = min(draw(prompts), max_len - 2)
    o_max = min(19, max_len - p - 1)
    if kind == "prefill" or (kind == "waiting" and draw(st.integers(0, 4))):
        o = 0
    else:
        o = draw(st.integers(1, o_max))
    if kind == "decode":
        c = p + o - 1
    elif kind == "prefill":
        c = draw(st.integers(0, p - 1))
    elif kind == "recompute":
        c = draw(st.integers(0, p + o - 2))
    else:
        c = 0
    stop = draw(st.integers(1, 20) if snapshot else st.integers(o + 1, 20))
    return p, c, o, stop


@st.composite
def states(draw, kv: str = "any", snapshot: bool = False, max_running: int = 8,
           max_waiting: int = 6, full_isl: bool | None = None,
           asyn: bool | None = False) -> State:
    """A consistent engine state; ``kv`` is ``tight`` (0..40 blocks beyond those held),
    ``ample`` (no preemption can happen) or ``any``; ``full_isl`` fixes
    ``scheduler_reserve_full_isl`` (and then no watermark), else both are drawn; ``asyn``
    fixes ``async_scheduling`` (the invariants below state the synchronous loop; the
    asynchronous one is checked against vLLM by tests/e2e/test_scheduler_diff.py), None
    draws it."""
    budget = draw(st.integers(4, 64))
    seqs = draw(st.integers(1, min(16, budget)))
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    thr = draw(st.one_of(st.just(0), st.integers(1, 24)))
    max_len = draw(st.sampled_from([24, 64, 4096]))
    kinds = st.sampled_from(["decode", "decode", "prefill", "recompute"])
    run_kinds = draw(st.lists(kinds, max_size=min(seqs, max_running)))
    n_wait = draw(st.integers(0, max_waiting))
    running = tuple(Spec(f"r{i}", *draw(requests(max_len, k, snapshot)))
                    for i, k in enumerate(run_kinds))
    asy = draw(st.booleans()) if asyn is None else asyn
    if asy:  # some with their next token in flight: every token computed (vLLM's placeholder)
        running = tuple(Spec(s.id, s.prompt, s.prompt + s.output, s.output, s.stop)
                        if draw(st.booleans()) else s for s in running)
    waiting = tuple(Spec(f"w{i}", *draw(requests(max_len, "waiting", snapshot)))
                    for i in range(n_wait))
    held = sum(blocks_for(s.computed, bs) for s in running)
    if kv == "tight":
        extra = draw(st.integers(0, 40))
    elif kv == "ample":
        extra = AMPLE_BLOCKS
    else:
        extra = draw(st.one_of(st.integers(0, 40), st.integers(0, 400), st.just(AMPLE_BLOCKS)))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=max_len,
                          block_size=bs,
                          num_gpu_blocks=max(1, held + extra) + 1,  # (+ vLLM's null block)
                          long_prefill_token_threshold=thr,
                          scheduler_reserve_full_isl=(draw(st.sampled_from([True, True, False]))
                                                      if full_isl is None else full_isl),
                          watermark=(draw(st.sampled_from([0.0, 0.0, 0.0, 0.02, 0.2]))
                                     if full_isl is None else 0.0),
                          async_scheduling=asy)
    time = draw(st.one_of(st.just(0.0), st.floats(0.0, 1000.0)))
    return State(cfg, draw(models), running, waiting, time)


# -- running the engine --------------------------------------------------------------------------

@dataclass(frozen=True)
class View:
    """The engine at a step boundary: per request ``(P, C, O, B)``, the two orders, the clock."""

    reqs: dict[str, tuple[int, int, int, int]]
    running: list[str]
    waiting: list[str]
    free: int
    time: float

    @classmethod
    def of(cls, eng: ReferenceEngine) -> View:
        reqs = {r.id: (r.prompt, r.computed, r.output, r.blocks)
                for r in [*eng.running, *eng.waiting]}
        return cls(reqs, [r.id for r in eng.running], [r.id for r in eng.waiting],
                   eng.free_blocks, eng.time)

    def decoding(self, rid: str) -> bool:
        p, c, o, _ = self.reqs[rid]
        return o >= 1 and p + o - c == 1


@dataclass
class Run:
    state: State
    requests: dict[str, Request]
    views: list[View] = field(default_factory=list)   # views[i] before step i, views[i+1] after
    records: list[StepRecord] = field(default_factory=list)
    stuck: EngineStuck | None = None                    # raised at step len(records)
    engine: ReferenceEngine | None = None               # as it was left

    def steps(self):
        """``(before, record, after)`` of every completed step."""
        return zip(self.views, self.records, self.views[1:], strict=False)

    def admitted(self, before: View, rec: StepRecord) -> list[str]:
        """Requests that got tokens this step coming from the waiting queue, in order."""
        waiting = set(before.waiting)
        return [rid for rid in [*rec.prefill, *rec.decode] if rid in waiting]


def run_engine(state: State, steps: int = ENGINE_STEPS) -> Run:
    eng, reqs = state.engine()
    run = Run(state, reqs, [View.of(eng)], engine=eng)
    for _ in range(steps):
        try:
            rec = eng.step()
        except EngineStuck as e:
            run.stuck = e
            break
        if rec is None:
            break
        run.records.append(rec)
        run.views.append(View.of(eng))
    return run


engine_states = states(kv="any")


# -- 1-6, and EngineStuck: the engine's invariants -----------------------------------------------

@props(200)
@given(engine_states)
def test_token_budget_and_threshold(state: State) -> None:
    """1. Σ prefill chunks + decodes <= max_num_batched_tokens; each chunk <= the threshold,
    unless the request was alone (vLLM lifts the threshold then: nobody to starve)."""
    cfg = state.config
    run = run_engine(state)
    for before, rec, _ in run.steps():
        assert sum(rec.prefill.values()) + len(rec.decode) <= cfg.max_num_batched_tokens
        assert len(set(rec.decode)) == len(rec.decode)
        assert not set(rec.decode) & set(rec.prefill)
        alone = len(before.running) + len(before.waiting) <= 1
        for n in rec.prefill.values():
            assert n >= 1
            if cfg.long_prefill_token_threshold and not alone:
                assert n <= cfg.long_prefill_token_threshold


@props(200)
@given(engine_states)
def test_kv_accounting(state: State) -> None:
    """2. Free blocks never negative and conserved; a running request holds exactly
    ceil(computed / block_size) blocks, a waiting one none."""
    cfg = state.config
    run = run_engine(state)
    for v in run.views:
        assert v.free >= 0
        assert sum(v.reqs[r][3] for r in v.running) + v.free == cfg.usable_blocks
        for rid in v.running:
            _, c, _, b = v.reqs[rid]
            assert b == blocks_for(c, cfg.block_size), rid
        for rid in v.waiting:
            _, c, _, b = v.reqs[rid]
            assert (c, b) == (0, 0), rid


@props(150)
@given(engine_states)
def test_sequence_cap(state: State) -> None:
    """3. len(running) <= max_num_seqs after every step."""
    run = run_engine(state)
    for v in run.views:
        assert len(v.running) <= state.config.max_num_seqs


@props(200)
@given(engine_states)
def test_fcfs_admission(state: State) -> None:
    """4. Requests enter the running list from the queue's head, in queue order, at the tail of
    the running order, and never in a step that preempted; preempted requests go to the front
    of the queue in their running order; everything else keeps its order."""
    run = run_engine(state)
    for before, rec, after in run.steps():
        admitted = run.admitted(before, rec)
        assert admitted == before.waiting[:len(admitted)]
        if rec.preempted:
            assert not admitted
        done, pre = set(rec.finished_ids), set(rec.preempted)
        assert after.running == ([r for r in before.running if r not in pre | done]
                                 + [r for r in admitted if r not in done])
        assert after.waiting == [*reversed(rec.preempted), *before.waiting[len(admitted):]]


@props(200)
@given(engine_states)
def test_no_token_lost_or_invented(state: State) -> None:
    """5. Computed tokens grow by exactly the scheduled amount (or reset to 0 on preemption,
    outputs kept); outputs grow by at most 1 per step, only when computed reaches P + O; a
    finished request stopped at its stop (or max_model_len); no request vanishes."""
    cfg = state.config
    run = run_engine(state)
    everyone = set(run.requests)
    finished: set[str] = set()
    assert set(run.views[0].reqs) == everyone
    for before, rec, after in run.steps():
        assert after.time >= before.time
        assert rec.start == before.time and rec.end == after.time
        if rec.prefill or rec.decode:
            assert rec.end > rec.start  # positive coefficients: work takes time
        scheduled = {**rec.prefill, **dict.fromkeys(rec.decode, 1)}
        assert set(scheduled) <= set(before.reqs)
        assert set(rec.preempted) <= set(before.running) - set(scheduled)
        assert set(rec.finished_ids) <= set(scheduled)
        for rid, (p, c, o, _) in before.reqs.items():
            req = run.requests[rid]
            if rid in rec.finished_ids:
                assert rid not in after.reqs
                c2, o2 = req.computed, req.output
            else:
                _, c2, o2, _ = after.reqs[rid]
            if rid in rec.preempted:
                assert (c2, o2) == (0, o)
                continue
            n = scheduled.get(rid, 0)
            if rid in rec.decode:
                assert before.decoding(rid)
            elif n:
                assert not before.decoding(rid) and n <= p + o - c
            assert c2 == c + n
            sampled = n > 0 and c + n == p + o
            assert o2 == o + sampled
            assert (rid in rec.first_token_ids) == (sampled and o == 0)
            if sampled and o == 0:
                assert req.first_token == rec.end
        for rid in rec.finished_ids:
            req = run.requests[rid]
            assert req.output == req.stop or req.prompt + req.output >= cfg.max_model_len
            assert req.finished == rec.end
        finished |= set(rec.finished_ids)
        present = [*after.running, *after.waiting]
        assert len(present) == len(set(present)) == len(after.reqs)
        assert set(present) | finished == everyone
        assert not set(present) & finished
    for rid in everyone - finished:
        assert run.requests[rid].finished is None


@props(200)
@given(engine_states)
def test_decodes_before_new_prefills(state: State) -> None:
    """6. If a newly admitted request got tokens in a step, every running request got its
    tokens first: in particular every decoder its decode token."""
    run = run_engine(state)
    for before, rec, _ in run.steps():
        if run.admitted(before, rec):
            assert not rec.preempted
            decoders = [r for r in before.running if before.decoding(r)]
            assert set(decoders) <= set(rec.decode)
            assert set(before.running) <= set(rec.decode) | set(rec.prefill)


@props(150)
@given(states(kv="tight"))
def test_engine_stuck_only_when_the_head_can_never_be_admitted(state: State) -> None:
    """``EngineStuck`` is an allowed end only when the waiting head can never run to its end,
    not even alone in the empty cache: nothing runs and its whole sequence (vLLM's
    full-sequence admission; else its lone first chunk, the whole budget) needs more blocks
    than the cache has, or it outgrows the cache before it finishes (a livelock: it preempts
    itself, alone, twice with no output in between)."""
    cfg = state.config
    run = run_engine(state)
    if run.stuck is not None:
        eng = run.engine
        assert eng.waiting and not eng.running, str(run.stuck)
        head = eng.waiting[0]
        p, o = head.prompt, head.output
        tokens = (min(p + o, cfg.max_model_len) if cfg.scheduler_reserve_full_isl
                  else min(p + o, cfg.max_num_batched_tokens))
        if blocks_for(tokens, cfg.block_size) > cfg.usable_blocks:
            return
        most = min(p + head.stop - 1, cfg.max_model_len - 1)
        assert blocks_for(most, cfg.block_size) > cfg.usable_blocks, str(run.stuck)


# -- 7, 8: forecast monotonicity -----------------------------------------------------------------
#
# Why these hold. Everything ahead of the probe evolves the same whatever the probe is (it is
# last in the queue and, once admitted, last in the running order, so it is the first victim of
# a preemption and the only request a preemption keeps out). With ample KV, each step leaves
# the probe the budget L_k after everything ahead, and its progress min(rem, cap, L_k) per step
# is monotone in its remaining tokens and in L_k. Hence:
#  * a longer probe reaches its first token in the same or a later step, and every step costs
#    at least as much (both models are non-decreasing in every feature): 7 holds. With tight
#    KV and admission by first chunk a longer probe also needs at least as many blocks at
#    every point, and hypothesis finds no counterexample (none in 4500 examples either); with
#    vLLM's full-sequence admission a longer probe can be kept out of a step in which a
#    shorter one is admitted and later preempted, wasting its prefill
#    (test_longer_probe_can_get_its_first_token_sooner);
#  * more work ahead leaves less budget and fewer seats at every step, so the probe's first
#    token comes in the same or a later *step* (8, in steps). In *time* it holds for paper4 when
#    a request is added (the probe's own cost b1·p + b3·p(p+1)/2 does not depend on how its
#    prompt is chunked), but not in general: see the xfail cases below.

def _ttft(snap: Snapshot, p: int) -> tuple[float, float]:
    """(TTFT, steps); (inf, inf) when the probe never gets there (a blocked queue)."""
    f = forecast(snap, p)
    return (f.estimate_s, f.steps) if math.isfinite(f.estimate_s) else (math.inf, math.inf)


def _ttft_or_inf(snap: Snapshot, p: int) -> tuple[float, float]:
    """A forecast that cannot be made (a probe that can never fit the KV cache) is +inf."""
    try:
        return _ttft(snap, p)
    except ForecastError:
        return math.inf, math.inf


def _probe_range(snap: Snapshot, hi: int) -> range:
    cfg = snap.config
    hi = min(hi, cfg.max_model_len - 1, cfg.usable_blocks * cfg.block_size)
    return range(1, hi + 1)


def _assert_non_decreasing(snap: Snapshot, xs, ys: list[tuple[float, float]]) -> None:
    """Forecasts ``ys`` = (estimate_s, steps) non-decreasing along ``xs`` in both, up to float
    rounding (:data:`REL`, :func:`clock_slack`) in time."""
    for (x0, (t0, k0)), (x1, (t1, k1)) in zip(zip(xs, ys, strict=True),
                                              zip(xs[1:], ys[1:], strict=True), strict=False):
        assert k1 >= k0, (x0, k0, x1, k1)
        slack = REL * abs(t0) + clock_slack(snap.time, t0, max(k0, k1))
        assert t1 >= t0 or t1 >= t0 - slack, (x0, t0, x1, t1)


def _check_monotone_in_prompt(snap: Snapshot) -> None:
    ps = list(_probe_range(snap, 160))
    _assert_non_decreasing(snap, ps, [_ttft_or_inf(snap, p) for p in ps])


@props(120)
@given(states(kv="ample", snapshot=True))
def test_forecast_monotone_in_prompt_length(state: State) -> None:
    """7. With ample KV, ``forecast(snap, p)`` is non-decreasing in ``p`` (time and steps)."""
    _check_monotone_in_prompt(state.snapshot())


@props(150)
@given(states(kv="tight", snapshot=True, full_isl=False))
def test_forecast_monotone_in_prompt_length_tight_kv(state: State) -> None:
    """7, with tight KV (preemption, recompute; a forecast that cannot be made is +inf)."""
    _check_monotone_in_prompt(state.snapshot())


def _with_waiting(state: State, waiting: tuple[Spec, ...]) -> Snapshot:
    return State(state.config, state.model, state.running, waiting, state.time).snapshot()


@st.composite
def added_work(draw, kv: str) -> tuple[State, Spec, int]:
    state = draw(states(kv=kv, snapshot=True))
    p, c, o, stop = draw(requests(state.config.max_model_len, "waiting", True))
    probe = draw(st.sampled_from(list(_probe_range(state.snapshot(), 160))))
    return state, Spec("extra", p, c, o, stop), probe


@st.composite
def longer_prompt(draw, kv: str) -> tuple[State, int, int, int]:
    state = draw(states(kv=kv, snapshot=True).filter(lambda s: s.waiting))
    i = draw(st.integers(0, len(state.waiting) - 1))
    w = state.waiting[i]
    # A longer prompt must not bring the request's end forward through max_model_len (see
    # test_longer_queued_prompt_can_lower_ttft: the third case).
    room = state.config.max_model_len - 1 - w.prompt - stop_length(w.stop, w.output)
    assume(room >= 1)
    more = draw(st.integers(1, min(room, 64)))
    probe = draw(st.sampled_from(list(_probe_range(state.snapshot(), 160))))
    return state, i, more, probe


def _lengthened(state: State, i: int, more: int) -> tuple[Spec, ...]:
    w = state.waiting[i]
    return (*state.waiting[:i], Spec(w.id, w.prompt + more, 0, w.output, w.stop),
            *state.waiting[i + 1:])


@props(150)
@given(added_work("ample"))
def test_forecast_monotone_in_added_waiting_request(case: tuple[State, Spec, int]) -> None:
    """8a. With ample KV, queueing one more request ahead of the probe never brings its first
    token to an earlier step, and (paper4) never lowers its TTFT. For sfs6 the TTFT can drop:
    test_more_queued_work_can_lower_ttft."""
    state, extra, probe = case
    base = _with_waiting(state, state.waiting)
    more = _with_waiting(state, (*state.waiting, extra))
    (t0, k0), (t1, k1) = _ttft(base, probe), _ttft(more, probe)
    assert k1 >= k0
    if isinstance(state.model, Paper4):
        _assert_non_decreasing(base, ["without", "with"], [(t0, k0), (t1, k1)])


@props(150)
@given(longer_prompt("ample"))
def test_forecast_monotone_in_waiting_prompt_length(case: tuple[State, int, int, int]) -> None:
    """8b. With ample KV, a longer prompt in the queue ahead never brings the probe's first
    token to an earlier step (its TTFT can drop: test_longer_queued_prompt_can_lower_ttft)."""
    state, i, more, probe = case
    base = _with_waiting(state, state.waiting)
    grown = _with_waiting(state, _lengthened(state, i, more))
    assert _ttft(grown, probe)[1] >= _ttft(base, probe)[1]


# Counterexamples to "more work ahead never lowers the probe's TTFT", found and minimized by
# hypothesis (except the "-fresh" case, built by hand), kept as strict xfails: they follow from the V1 rules and the
# batch-time models, they are not engine bugs. Each case: config, model, running, waiting,
# the same with more work ahead, probe prompt.

def _snap(cfg: dict, model, running=(), waiting=()) -> Snapshot:
    """``num_gpu_blocks`` in ``cfg`` counts usable blocks (vLLM's null block is added)."""
    cfg = {"num_gpu_blocks": AMPLE_BLOCKS, **cfg}
    cfg["num_gpu_blocks"] += 1
    config = SchedulerConfig(**{"max_model_len": 4096, "block_size": 1, **cfg})
    snap = Snapshot(config, model, running=[ResidentRequest(*r) for r in running],
                    waiting=[ResidentRequest(*w) for w in waiting])
    snap.check()
    return snap


EQUAL = Sfs6(c0=0.0625, cp=0.0625, cpsq=0.0625, cd=0.0625, cs=0.0625, css=0.0625)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="see the case ids")
@pytest.mark.parametrize(("cfg", "model", "running", "waiting", "extra", "probe"), [
    # sfs6 charges cs·L + css·L² for every step a request is scheduled in: 'extra' takes the
    # last seat in step 2, the probe waits and then prefills its 3 tokens in one chunk instead
    # of two (2 + 1); the chunk saved costs more than 'extra'. Same 3 steps, TTFT 3.625 -> 3.375.
    pytest.param({"max_num_batched_tokens": 4, "max_num_seqs": 2, "max_model_len": 24}, EQUAL,
                 [("r0", 1, 1, 1, 1)], [("w0", 1, 0, 0, 1), ("w1", 1, 0, 1, 1)],
                 ("extra", 1, 0, 0, 1), 3, id="ample-sfs6-fewer-probe-chunks"),
    # Recompute preemption throws the probe's work away (admission by first chunk, without
    # vLLM's default full-sequence reservation). Without 'extra' the probe is admitted in step
    # 3 (2 tokens) and preempted in step 4 by r3's decode; with 'extra' it is kept out by the
    # KV cache until step 5 and wastes nothing. Same 6 steps, TTFT -2e-5 s (realistic paper4
    # coefficients).
    pytest.param({"max_num_batched_tokens": 4, "max_num_seqs": 4, "max_model_len": 24,
                  "num_gpu_blocks": 5, "long_prefill_token_threshold": 2,
                  "scheduler_reserve_full_isl": False}, PAPER4,
                 [("r0", 1, 1, 1, 1), ("r1", 1, 1, 1, 1), ("r2", 1, 1, 1, 1), ("r3", 1, 1, 1, 4)],
                 [], ("extra", 1, 0, 0, 1), 3, id="tight-kv-probe-work-wasted"),
    # The same with fewer *steps* (11 -> 10): slowed by 'extra', the probe holds its blocks at
    # other moments and r5's decodes preempt it once instead of twice.
    pytest.param({"max_num_batched_tokens": 6, "max_num_seqs": 6, "max_model_len": 24,
                  "num_gpu_blocks": 25, "long_prefill_token_threshold": 4,
                  "scheduler_reserve_full_isl": False}, PAPER4,
                 [("r0", 1, 1, 1, 1), ("r1", 1, 1, 1, 1), ("r2", 1, 0, 1, 1), ("r3", 1, 2, 2, 1),
                  ("r4", 1, 0, 2, 1), ("r5", 1, 16, 16, 3)],
                 [], ("extra", 1, 0, 0, 2), 9, id="tight-kv-fewer-preemptions"),
])
def test_more_queued_work_can_lower_ttft(cfg, model, running, waiting, extra, probe) -> None:
    base = _snap(cfg, model, running, waiting)
    more = _snap(cfg, model, running, [*waiting, extra])
    (t0, k0), (t1, k1) = _ttft(base, probe), _ttft(more, probe)
    assert t1 >= t0 and k1 >= k0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="see the case ids")
@pytest.mark.parametrize(("cfg", "waiting", "longer", "probe"), [
    # A request's last uncomputed token is scheduled as a *decode* (O >= 1, P + O - C = 1),
    # costing b1 + b2·c, whereas a prefill token costs b1 + b3·(c + 1); with paper4's
    # realistic b2 = 5e-8 > b3 = 1e-9 a decode at context c costs more. w0 (preempted, 1
    # output) recomputes 2 tokens at 1 per step: its 2nd is a decode (c = 1). With a 2-token
    # prompt its 2nd is a prefill; the probe's 2 tokens end in step 2 either way.
    pytest.param({"max_num_batched_tokens": 4, "max_num_seqs": 2, "max_model_len": 24,
                  "long_prefill_token_threshold": 1},
                 [("w0", 1, 0, 1, 1)], [("w0", 2, 0, 1, 1)], 2, id="decode-costlier-than-prefill"),
    # The same with a fresh request: in step 2, w decodes at c = 4 (prompt 4) or prefills its
    # 5th token (prompt 5); the probe gets 3 tokens in step 2 either way. TTFT -1.95e-7 s.
    pytest.param({"max_num_batched_tokens": 4, "max_num_seqs": 2, "block_size": 16},
                 [("w", 4, 0, 0, 20)], [("w", 5, 0, 0, 20)], 3,
                 id="decode-costlier-than-prefill-fresh"),
    # max_model_len ends a request at P + O = max_model_len: w0 with a 5-token prompt stops at
    # 19 outputs instead of 20, one decode fewer; one seat, so the probe waits for w0 to finish.
    pytest.param({"max_num_batched_tokens": 4, "max_num_seqs": 1, "max_model_len": 24},
                 [("w0", 4, 0, 0, 20)], [("w0", 5, 0, 0, 20)], 1, id="max-model-len-truncation"),
])
def test_longer_queued_prompt_can_lower_ttft(cfg, waiting, longer, probe) -> None:
    base = _snap(cfg, PAPER4, waiting=waiting)
    grown = _snap(cfg, PAPER4, waiting=longer)
    assert _ttft(grown, probe)[0] >= _ttft(base, probe)[0]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="see the docstring")
def test_longer_probe_can_get_its_first_token_sooner() -> None:
    """Found by hypothesis with vLLM's full-sequence admission (so 7 with tight KV is checked
    without it). A 3-token probe fits beside r2 and is admitted in step 1, then preempted in
    step 2 by r2's decode: its prefill is wasted. A 4-token probe's whole sequence does not
    fit until r2 has finished, so it wastes nothing. Same 4 steps, TTFT 0.016220 -> 0.016200."""
    snap = _snap({"max_num_batched_tokens": 5, "max_num_seqs": 3, "max_model_len": 24,
                  "num_gpu_blocks": 6}, PAPER4,
                 running=[("r0", 1, 1, 1, 1), ("r1", 1, 1, 1, 1), ("r2", 2, 2, 1, 3)])
    assert snap.config.scheduler_reserve_full_isl
    _assert_non_decreasing(snap, [3, 4], [_ttft(snap, 3), _ttft(snap, 4)])


# -- 9: the fast paths equal the oracle ----------------------------------------------------------

def _outcome(fn):
    try:
        return fn()
    except ForecastError as e:
        return e


def _check_fast_paths(snap: Snapshot, p: int, po: int, until: str) -> None:
    ref = _outcome(lambda: replay(snap, p, po, until, reference=True, max_steps=MAX_STEPS))
    fast = _outcome(lambda: replay(snap, p, po, until, max_steps=MAX_STEPS))
    if isinstance(ref, ForecastError):
        assert isinstance(fast, ForecastError), (ref, fast)
    else:
        assert not isinstance(fast, ForecastError), fast
        assert (fast.estimate_s, fast.steps) == (ref.estimate_s, ref.steps)
    if until != "first_token":
        return
    fc = _outcome(lambda: Forecaster(snap, max_steps=MAX_STEPS).ttft(p))
    if isinstance(ref, ForecastError):
        assert isinstance(fc, ForecastError), (ref, fc)
        return
    assert not isinstance(fc, ForecastError), fc
    got = forecast(snap, p)
    for f in (fc, got):
        assert f.steps == ref.steps
        assert f.estimate_s == pytest.approx(
            ref.estimate_s, rel=1e-9, abs=clock_slack(snap.time, ref.estimate_s, ref.steps))


probe_args = st.tuples(st.one_of(st.integers(1, 16), st.integers(1, 300)), st.integers(1, 20),
                       st.sampled_from(["first_token", "finish"]))


@props(250)
@given(states(kv="any", snapshot=True, max_running=16, max_waiting=8, asyn=None), probe_args)
# A TTFT of 8e-9 s on a clock at 256 s: the forecaster and the loop differ by an ulp of the
# clock (5.7e-14 s), 7e-6 relative: see clock_slack.
@example(State(SchedulerConfig(4, 2, 24, 1, AMPLE_BLOCKS, 0), Paper4(1e-9, 1e-9, 0.0625, 1e-9),
               (), (Spec("w0", 1, 0, 0, 1),), 256.0), (2, 1, "first_token"))
def test_fast_paths_equal_the_oracle(state: State, probe) -> None:
    """9. ``replay`` compiled == ``replay(reference=True)`` exactly (or both fail), and the
    forecaster's TTFT equals the oracle within rel 1e-9 with the same step count."""
    p, po, until = probe
    snap = state.snapshot()
    _check_fast_paths(snap, min(p, snap.config.max_model_len - 1), po, until)


@props(60)
@given(st.randoms(use_true_random=False), probe_args)
def test_fast_paths_equal_the_oracle_on_shared_random_snapshots(rng, probe) -> None:
    """9, on the snapshots of ``tests/snapshots.py`` (larger budgets, longer prompts)."""
    p, po, until = probe
    snap = random_snapshot(rng, n_running=rng.randint(0, 12), n_waiting=rng.randint(0, 6))
    _check_fast_paths(snap, min(p, snap.config.max_model_len - 1), po, until)


@props(40)
@given(states(kv="any", snapshot=True, max_running=16, max_waiting=8, asyn=None),
       st.lists(st.one_of(st.integers(1, 16), st.integers(1, 300)), min_size=1, max_size=25))
def test_one_forecaster_many_probes(state: State, probes: list[int]) -> None:
    """9. One :class:`Forecaster` answering many probes (any order, repeats) of one snapshot
    agrees with the oracle on every one."""
    snap = state.snapshot()
    fc = Forecaster(snap, max_steps=MAX_STEPS)
    oracle: dict[int, object] = {}
    for p in probes:
        p = min(p, snap.config.max_model_len - 1)
        if p not in oracle:
            oracle[p] = _outcome(lambda p=p: replay(snap, p, reference=True,
                                                    max_steps=MAX_STEPS))
        ref = oracle[p]
        got = _outcome(lambda p=p: fc.ttft(p))
        if isinstance(ref, ForecastError):
            assert isinstance(got, ForecastError), (p, got)
        else:
            assert not isinstance(got, ForecastError), (p, got)
            assert got.steps == ref.steps, p
            assert got.estimate_s == pytest.approx(
                ref.estimate_s, rel=1e-9, abs=clock_slack(snap.time, ref.estimate_s, ref.steps)), p
