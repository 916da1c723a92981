"""Hand-worked traces of the reference engine against the vLLM V1 rules.

Every expected value below was worked out by hand from ``docs/scheduling-rules.md`` (the rules)
and the batch-time formulas of ``docs/engine.md`` ("Batch-time models"); the comments show the
arithmetic.

Models (simple coefficients so durations are checkable by hand):

* paper4: ``1 + 0.1·Σ(pre+dec) + 0.01·Σ c·dec + 0.001·Σ(pre·c + pre(pre+1)/2)``
* sfs6:   ``1 + 0.1·P + 0.01·Σpre² + 0.001·D + 0.0001·ΣL + 0.00001·ΣL²``

Request state is written ``(P, O, C, B)``: prompt, outputs so far, computed tokens, KV blocks.
"""

from __future__ import annotations

import pytest

from duetime.engine import Paper4, ReferenceEngine, Request, SchedulerConfig, Sfs6, StepRecord

P4 = Paper4(b0=1.0, b1=0.1, b2=0.01, b3=0.001)
S6 = Sfs6(c0=1.0, cp=0.1, cpsq=0.01, cd=0.001, cs=0.0001, css=0.00001)


def engine(*, budget: int = 100, seqs: int = 100, bs: int = 4, blocks: int = 100, thr: int = 0,
           running: tuple[Request, ...] = (), waiting: tuple[Request, ...] = (),
           model=P4, full: bool = True, watermark: float = 0.0) -> ReferenceEngine:
    """``blocks``: the *usable* KV blocks (vLLM's num_gpu_blocks is one more: the null
    block)."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=10_000,
                          block_size=bs, num_gpu_blocks=blocks + 1,
                          long_prefill_token_threshold=thr, scheduler_reserve_full_isl=full,
                          watermark=watermark)
    return ReferenceEngine(cfg, model, running=running, waiting=waiting)


def step(eng: ReferenceEngine) -> StepRecord:
    rec = eng.step()
    assert rec is not None
    return rec


def check(rec: StepRecord, *, duration: float, prefill: dict[str, int] | None = None,
          decode: list[str] | None = None, preempted: list[str] | None = None,
          first_token_ids: list[str] | None = None,
          finished_ids: list[str] | None = None) -> None:
    """The step's record, exactly (unlisted parts must be empty)."""
    assert rec.duration == pytest.approx(duration, rel=1e-12, abs=1e-12)
    assert rec.prefill == (prefill or {})
    assert rec.decode == (decode or [])
    assert rec.preempted == (preempted or [])
    assert rec.first_token_ids == (first_token_ids or [])
    assert rec.finished_ids == (finished_ids or [])


def state(r: Request) -> tuple[int, int, int, int]:
    return (r.prompt, r.output, r.computed, r.blocks)


def ids(requests) -> list[str]:
    return [r.id for r in requests]


def decoding(id: str, prompt: int, output: int, stop: int) -> Request:
    """A running request in decode: C = P + O - 1 (one token left to compute)."""
    return Request(id, prompt, stop, output=output, computed=prompt + output - 1)


# -- basics -------------------------------------------------------------------------------------

def test_idle_engine_has_no_step():
    eng = engine()
    assert eng.idle
    assert eng.step() is None
    assert eng.time == 0.0 and eng.steps == 0


def test_running_requests_get_blocks_for_their_computed_tokens():
    # ceil(C / 4): 10 -> 3, 4 -> 1, 0 -> 0; waiting holds none.
    eng = engine(blocks=20, running=(decoding("x", 10, 1, 5), Request("y", 8, 5, computed=4),
                                     Request("z", 6, 5)),
                 waiting=(Request("w", 3, 5),))
    assert [r.blocks for r in eng.running] == [3, 1, 0]
    assert eng.waiting[0].blocks == 0
    assert eng.free_blocks == 20 - 4


# -- token budget -------------------------------------------------------------------------------

def test_token_budget_is_shared_in_order_and_the_last_admission_is_partial():
    # budget 10, block 4. a(P=6,T=3), b(P=6,T=10), c(P=3,T=10) waiting.
    a, b, c = Request("a", 6, 3), Request("b", 6, 10), Request("c", 3, 10)
    eng = engine(budget=10, blocks=100, waiting=(a, b, c))

    # Step 1: a gets 6 (budget 4), b gets 4 (budget 0), c is not looked at.
    # pre_attn = a: 6*7/2 = 21, b: 4*5/2 = 10 -> 31;  1 + 0.1*10 + 0.031 = 2.031
    r1 = step(eng)
    check(r1, duration=2.031, prefill={"a": 6, "b": 4}, first_token_ids=["a"])
    assert r1.start == 0.0 and r1.end == pytest.approx(2.031)
    assert state(a) == (6, 1, 6, 2)       # prefill done: first output sampled; ceil(6/4) = 2
    assert state(b) == (6, 0, 4, 1)
    assert state(c) == (3, 0, 0, 0)
    assert ids(eng.running) == ["a", "b"] and ids(eng.waiting) == ["c"]
    assert eng.free_blocks == 97
    assert a.first_token == pytest.approx(2.031)

    # Step 2: running first: a decodes (1, c=6), b finishes its prompt (2 at c=4), then c is
    # admitted with the rest (3 <= budget 7).
    # n = 1 + 2 + 3 = 6 -> 0.6; dec ctx 6 -> 0.06; pre_attn b: 2*4 + 3 = 11, c: 6 -> 0.017
    r2 = step(eng)
    check(r2, duration=1 + 0.6 + 0.06 + 0.017, prefill={"b": 2, "c": 3}, decode=["a"],
          first_token_ids=["b", "c"])
    assert state(a) == (6, 2, 7, 2)       # 7 tokens in ceil(7/4) = 2 blocks
    assert state(b) == (6, 1, 6, 2)       # +1 block for tokens 5..6
    assert state(c) == (3, 1, 3, 1)
    assert ids(eng.running) == ["a", "b", "c"] and not eng.waiting
    assert eng.free_blocks == 95
    assert eng.time == pytest.approx(2.031 + 1.677)

    # Step 3: three decodes, ctx 7 + 6 + 3 = 16: 1 + 0.3 + 0.16 = 1.46. a reaches T = 3.
    r3 = step(eng)
    check(r3, duration=1.46, decode=["a", "b", "c"], finished_ids=["a"])
    assert a.finished == pytest.approx(2.031 + 1.677 + 1.46)
    assert state(a) == (6, 3, 8, 0)       # blocks freed at the step's end
    assert ids(eng.running) == ["b", "c"]
    assert eng.free_blocks == 100 - 2 - 1  # b holds ceil(7/4) = 2, c ceil(4/4) = 1


def test_running_decoders_take_the_budget_before_anyone_else():
    # budget 2 and three decoders: only the first two (in running order) get a token; the
    # third decoder and the waiting request get nothing, step after step.
    x = decoding("x", 10, 1, 10)   # C = 10, 3 blocks
    y = decoding("y", 20, 3, 10)   # C = 22, 6 blocks
    w = decoding("w", 5, 1, 10)    # C = 5, 2 blocks
    z = Request("z", 1, 10)
    eng = engine(budget=2, blocks=100, running=(x, y, w), waiting=(z,))
    assert eng.free_blocks == 100 - 11

    # ctx 10 + 22 = 32: 1 + 0.2 + 0.32 = 1.52
    check(step(eng), duration=1.52, decode=["x", "y"])
    # ctx 11 + 23 = 34: 1 + 0.2 + 0.34 = 1.54
    check(step(eng), duration=1.54, decode=["x", "y"])
    assert state(x) == (10, 3, 12, 3)
    assert state(y) == (20, 5, 24, 6)
    assert state(w) == (5, 1, 5, 2)        # untouched
    assert state(z) == (1, 0, 0, 0)        # never admitted
    assert ids(eng.running) == ["x", "y", "w"] and ids(eng.waiting) == ["z"]
    assert eng.free_blocks == 89


# -- chunked prefill, first token, finish -------------------------------------------------------

def test_long_prompt_is_prefilled_in_budget_sized_chunks_and_first_token_ends_the_last_chunk():
    # P = 20, budget 8, block 4, T = 1.
    a = Request("a", 20, 1)
    eng = engine(budget=8, blocks=100, waiting=(a,))

    # chunk 1: 8 at c=0: 1 + 0.8 + 0.001*(0 + 36) = 1.836
    check(step(eng), duration=1.836, prefill={"a": 8})
    assert state(a) == (20, 0, 8, 2) and a.first_token is None
    assert eng.free_blocks == 98
    # chunk 2: 8 at c=8: 1 + 0.8 + 0.001*(64 + 36) = 1.9
    check(step(eng), duration=1.9, prefill={"a": 8})
    assert state(a) == (20, 0, 16, 4) and a.first_token is None
    assert eng.free_blocks == 96
    # chunk 3: 4 at c=16: 1 + 0.4 + 0.001*(64 + 10) = 1.474; prefill done -> first token at
    # the step's end, and T = 1 so it also finishes and frees its 5 blocks.
    check(step(eng), duration=1.474, prefill={"a": 4}, first_token_ids=["a"], finished_ids=["a"])
    assert a.first_token == pytest.approx(5.21)    # 1.836 + 1.9 + 1.474
    assert a.finished == pytest.approx(5.21)
    assert state(a) == (20, 1, 20, 0)
    assert eng.free_blocks == 100 and eng.idle
    assert eng.steps == 3 and eng.time == pytest.approx(5.21)


def test_long_prefill_threshold_caps_every_chunk():
    # budget 16, threshold 5, block 4. a(P=12, T=5), b(P=3, T=2).
    a, b = Request("a", 12, 5), Request("b", 3, 2)
    eng = engine(budget=16, thr=5, blocks=100, waiting=(a, b))

    # Step 1: a gets min(12, 5, 16) = 5; b gets min(3, 5, 11) = 3 and completes.
    # pre_attn a: 15, b: 6; 1 + 0.1*8 + 0.021 = 1.821
    check(step(eng), duration=1.821, prefill={"a": 5, "b": 3}, first_token_ids=["b"])
    assert state(a) == (12, 0, 5, 2) and state(b) == (3, 1, 3, 1)
    # Step 2: a is capped at 5 again (running requests too) although budget 15 remains;
    # b decodes at c=3 and reaches T = 2.
    # 1 + 0.1*6 + 0.01*3 + 0.001*(5*5 + 15) = 1.67
    check(step(eng), duration=1.67, prefill={"a": 5}, decode=["b"], finished_ids=["b"])
    assert state(a) == (12, 0, 10, 3) and state(b) == (3, 2, 4, 0)
    assert eng.free_blocks == 97
    # Step 3: a's last 2 tokens (< threshold): 1 + 0.2 + 0.001*(2*10 + 3) = 1.223
    check(step(eng), duration=1.223, prefill={"a": 2}, first_token_ids=["a"])
    assert state(a) == (12, 1, 12, 3)
    assert a.first_token == pytest.approx(1.821 + 1.67 + 1.223)


def test_max_num_seqs_caps_admission_until_a_seat_frees_at_a_step_end():
    # max_num_seqs 2; three prompts of 2 tokens, T = 2.
    a, b, c = Request("a", 2, 2), Request("b", 2, 2), Request("c", 2, 2)
    eng = engine(seqs=2, budget=100, waiting=(a, b, c))

    # Step 1: a and b admitted, c is not (2 running). 1 + 0.4 + 0.001*(3 + 3) = 1.406
    check(step(eng), duration=1.406, prefill={"a": 2, "b": 2}, first_token_ids=["a", "b"])
    assert ids(eng.running) == ["a", "b"] and ids(eng.waiting) == ["c"]
    # Step 2: both decode (ctx 2 + 2) and finish; c is still not admitted in this step because
    # seats free only at the step's end. 1 + 0.2 + 0.04 = 1.24
    check(step(eng), duration=1.24, decode=["a", "b"], finished_ids=["a", "b"])
    assert not eng.running and ids(eng.waiting) == ["c"]
    # Step 3: c admitted. 1 + 0.2 + 0.003 = 1.203
    check(step(eng), duration=1.203, prefill={"c": 2}, first_token_ids=["c"])


def test_kv_blocks_are_allocated_per_step_at_block_boundaries():
    # P = 5, T = 6, block 4, 10 blocks. Blocks held = ceil((C + n) / 4) for the tokens computed.
    a = Request("a", 5, 6)
    eng = engine(blocks=10, waiting=(a,))
    # (duration, blocks after, free after): prefill 5 -> 2 blocks: 1 + 0.5 + 0.015
    # decodes compute tokens 6, 7, 8 (still 2 blocks), then 9 (3rd block); durations
    # 1 + 0.1 + 0.01*c for c = 5, 6, 7, 8, 9. The 6th output (T) frees everything.
    expected = [(1.515, 2, 8), (1.15, 2, 8), (1.16, 2, 8), (1.17, 2, 8), (1.18, 3, 7),
                (1.19, 0, 10)]
    for k, (dur, blocks, free) in enumerate(expected, start=1):
        rec = step(eng)
        assert rec.duration == pytest.approx(dur)
        assert (a.output, a.computed, a.blocks, eng.free_blocks) == (k, 4 + k, blocks, free)
    assert rec.finished_ids == ["a"] and eng.idle


def test_chunk_allocates_only_the_blocks_its_tokens_need():
    # P = 10, budget 6, block 4: chunk 6 -> ceil(6/4) = 2 blocks; chunk 4 -> ceil(10/4) = 3.
    a = Request("a", 10, 5)
    eng = engine(budget=6, blocks=10, waiting=(a,))
    step(eng)
    assert (a.computed, a.blocks, eng.free_blocks) == (6, 2, 8)
    step(eng)
    assert (a.computed, a.blocks, eng.free_blocks) == (10, 3, 7)
    step(eng)  # decode: token 11 still fits the 3rd block
    assert (a.computed, a.blocks, eng.free_blocks) == (11, 3, 7)


# -- KV exhaustion: FCFS blocking and preemption ------------------------------------------------

def test_failed_allocation_of_the_head_stops_admission():
    # 4 blocks of 4. r decodes (P=8, O=1, C=8: 2 blocks, T=2). Waiting: big (8 tokens, 2 blocks)
    # then small (4 tokens, 1 block).
    r = decoding("r", 8, 1, 2)
    big, small = Request("big", 8, 5), Request("small", 4, 5)
    eng = engine(blocks=4, running=(r,), waiting=(big, small))
    assert eng.free_blocks == 2

    # Step 1: r computes token 9 -> 3rd block (free 1). big needs 2 > 1: admission stops, and
    # small (which would fit) is NOT admitted past it. 1 + 0.1 + 0.01*8 = 1.18
    check(step(eng), duration=1.18, decode=["r"], finished_ids=["r"])
    assert ids(eng.waiting) == ["big", "small"]
    assert state(big) == (8, 0, 0, 0) and state(small) == (4, 0, 0, 0)
    # r reached T = 2 and freed its 3 blocks at the step's end.
    assert state(r) == (8, 2, 9, 0) and eng.free_blocks == 4 and not eng.running

    # Step 2: both admitted in order (2 + 1 blocks). 1 + 0.1*12 + 0.001*(36 + 10) = 2.246
    check(step(eng), duration=2.246, prefill={"big": 8, "small": 4},
          first_token_ids=["big", "small"])
    assert ids(eng.running) == ["big", "small"] and eng.free_blocks == 1


def test_preemption_of_the_last_running_request_and_its_recompute():
    # 6 blocks of 4, all held:
    #   a (P=8, O=1, C=8): 2 blocks, T=10      next token 9 -> needs a 3rd block
    #   b (P=4, O=1, C=4): 1 block,  T=2       next token 5 -> needs a 2nd block
    #   c (P=8, O=2, C=9): 3 blocks, T=10      next token 10 fits its 3 blocks
    # waiting w (P=1, T=5).
    a, b, c = decoding("a", 8, 1, 10), decoding("b", 4, 1, 2), decoding("c", 8, 2, 10)
    w = Request("w", 1, 5)
    eng = engine(blocks=6, running=(a, b, c), waiting=(w,))
    assert eng.free_blocks == 0

    # Step 1: a needs 1 block, none free -> preempt the LAST running (c): its 3 blocks freed,
    # C = 0, outputs kept, pushed to the FRONT of waiting. a is then scheduled (free 2), b too
    # (free 1). Nothing is admitted in a step that preempted, though w (1 block) would fit.
    # decodes ctx 8 + 4: 1 + 0.2 + 0.12 = 1.32
    check(step(eng), duration=1.32, decode=["a", "b"], preempted=["c"], finished_ids=["b"])
    assert state(c) == (8, 2, 0, 0)
    assert ids(eng.waiting) == ["c", "w"]
    assert state(a) == (8, 2, 9, 3)
    assert state(b) == (4, 2, 5, 0)       # b reached T = 2: its 2 blocks freed
    assert ids(eng.running) == ["a"]
    assert eng.free_blocks == 3

    # Step 2: a decodes token 10 (3 blocks, no new one). c is re-admitted and recomputes
    # P + O = 10 tokens as prefill (3 blocks, free 0); w (1 block) is blocked behind it.
    # 1 + 0.1*(1 + 10) + 0.01*9 + 0.001*(10*11/2) = 2.245
    # c's prefill completes: it samples its NEXT output (O 2 -> 3), not a second first token.
    check(step(eng), duration=2.245, prefill={"c": 10}, decode=["a"])
    assert state(c) == (8, 3, 10, 3)
    assert c.first_token is None and c.finished is None
    assert state(a) == (8, 3, 10, 3)
    assert ids(eng.running) == ["a", "c"] and ids(eng.waiting) == ["w"]
    assert eng.free_blocks == 0


def test_no_admission_in_a_step_that_preempted_even_when_the_head_would_fit():
    # Admission by first chunk only (scheduler_reserve_full_isl off): with full-sequence
    # admission a victim can never fit in the step that preempted it (the blocks left are fewer
    # than it held), so only this mode shows the rule.
    # 4 blocks of 4, threshold 4. a decodes (P=4, O=1, C=4: 1 block); v is mid-prefill
    # (P=13, C=12: 3 blocks). Nothing free.
    a, v = decoding("a", 4, 1, 10), Request("v", 13, 5, computed=12)
    eng = engine(blocks=4, thr=4, running=(a, v), full=False)
    assert eng.free_blocks == 0

    # Step 1: a's token 5 needs a 2nd block -> v preempted (free 3), a allocates (free 2).
    # v's recompute chunk would be min(13, 4) = 4 tokens = 1 block, which fits, but the step
    # preempted, so nothing is admitted. 1 + 0.1 + 0.01*4 = 1.14
    check(step(eng), duration=1.14, decode=["a"], preempted=["v"])
    assert ids(eng.running) == ["a"] and ids(eng.waiting) == ["v"]
    assert state(v) == (13, 0, 0, 0) and eng.free_blocks == 2

    # Step 2: a's token 6 fits its 2 blocks; v is admitted with a 4-token chunk (1 block).
    # 1 + 0.1*(1 + 4) + 0.01*5 + 0.001*(0 + 10) = 1.56
    check(step(eng), duration=1.56, prefill={"v": 4}, decode=["a"])
    assert ids(eng.running) == ["a", "v"] and state(v) == (13, 0, 4, 1)
    assert eng.free_blocks == 1


def test_preemption_takes_victims_from_the_back_until_the_allocation_fits():
    # 4 blocks of 4, 3 held (1 free):
    #   a (P=16, C=4): 1 block, its remaining 12 tokens need ceil(16/4) - 1 = 3 more
    #   b (P=3, O=1, C=3): 1 block;  c (P=2, O=1, C=2): 1 block
    a, b, c = Request("a", 16, 5, computed=4), decoding("b", 3, 1, 5), decoding("c", 2, 1, 5)
    eng = engine(blocks=4, running=(a, b, c))
    assert eng.free_blocks == 1

    # Preempt c (free 2), still short, preempt b (free 3), then a fits (free 0).
    # Each victim goes to the front, so the queue reads b, c. Only a runs:
    # 1 + 0.1*12 + 0.001*(12*4 + 78) = 2.326
    check(step(eng), duration=2.326, prefill={"a": 12}, preempted=["c", "b"],
          first_token_ids=["a"])
    assert ids(eng.running) == ["a"] and ids(eng.waiting) == ["b", "c"]
    assert state(b) == (3, 1, 0, 0) and state(c) == (2, 1, 0, 0)
    assert state(a) == (16, 1, 16, 4) and eng.free_blocks == 0


def test_a_request_can_preempt_itself_and_nothing_is_admitted():
    # 3 blocks of 4, all held: a (P=3, O=1, C=3): 1 block; b (P=8, O=1, C=8): 2 blocks.
    a, b = decoding("a", 3, 1, 5), decoding("b", 8, 1, 5)
    w = Request("w", 1, 5)
    eng = engine(blocks=3, running=(a, b), waiting=(w,))
    assert eng.free_blocks == 0

    # Step 1: a's token 4 fits its block. b needs a 3rd block, none free: the last running
    # request is b itself -> b is preempted (free 2) and not scheduled; no admission (w stays).
    # 1 + 0.1 + 0.01*3 = 1.13
    check(step(eng), duration=1.13, decode=["a"], preempted=["b"])
    assert state(b) == (8, 1, 0, 0)
    assert ids(eng.running) == ["a"] and ids(eng.waiting) == ["b", "w"]
    assert eng.free_blocks == 2

    # Step 2: a's token 5 takes a 2nd block (free 1). Head b needs ceil(9/4) = 3 > 1: admission
    # stops, and w (1 block, would fit) stays behind it. 1 + 0.1 + 0.04 = 1.14
    check(step(eng), duration=1.14, decode=["a"])
    assert ids(eng.waiting) == ["b", "w"] and eng.free_blocks == 1
    assert state(a) == (3, 3, 5, 2)


def test_recompute_chunked_by_the_budget_and_its_last_token_counts_as_decode():
    # x was preempted with 2 outputs: P=8, O=2, C=0 in waiting (10 tokens to recompute).
    x = Request("x", 8, 5, output=2)
    eng = engine(budget=9, blocks=100, waiting=(x,))
    # Step 1: 9 tokens as prefill at c=0: 1 + 0.9 + 0.001*45 = 1.945; nothing sampled.
    check(step(eng), duration=1.945, prefill={"x": 9})
    assert state(x) == (8, 2, 9, 3)
    # Step 2: O >= 1 and num_tokens - C = 1: decoding, ctx 9: 1 + 0.1 + 0.09 = 1.19.
    # It samples its 3rd output; no first token is stamped.
    check(step(eng), duration=1.19, decode=["x"])
    assert state(x) == (8, 3, 10, 3) and x.first_token is None


# -- batch-time features ------------------------------------------------------------------------

def test_paper4_counts_a_decode_as_one_token_with_its_context_and_a_chunk_with_its_offset():
    # d decodes at c = 30; p is mid-prefill at c = 5 and gets 7 more (budget 8).
    d = decoding("d", 25, 6, 100)          # C = 30
    p = Request("p", 20, 5, computed=5)
    eng = engine(budget=8, blocks=100, running=(d, p))
    # 1 + 0.1*(1 + 7) + 0.01*30 + 0.001*(7*5 + 7*8/2) = 1 + 0.8 + 0.3 + 0.063 = 2.163
    check(step(eng), duration=2.163, prefill={"p": 7}, decode=["d"])


def test_sfs6_uses_prompt_plus_outputs_for_every_scheduled_request():
    # d decodes (P=10, O=2, C=11); p (P=6) arrives; budget 4.
    d, p = decoding("d", 10, 2, 10), Request("p", 6, 10)
    eng = engine(budget=4, blocks=100, running=(d,), waiting=(p,), model=S6)

    # Step 1: d decode (D=1), p chunk of 3 (P=3, Σpre²=9). L: d 12, p 6 (its prompt, not the
    # chunk) -> ΣL = 18, ΣL² = 144 + 36 = 180.
    # 1 + 0.3 + 0.09 + 0.001 + 0.0018 + 0.0018 = 1.3946
    check(step(eng), duration=1.3946, prefill={"p": 3}, decode=["d"])
    # Step 2: d decode (L = 13), p's last 3 (L = 6): ΣL = 19, ΣL² = 169 + 36 = 205.
    # 1 + 0.3 + 0.09 + 0.001 + 0.0019 + 0.00205 = 1.39495
    check(step(eng), duration=1.39495, prefill={"p": 3}, decode=["d"], first_token_ids=["p"])
    # Step 3: two decodes, L = 14 and 7 (outputs so far included): ΣL = 21, ΣL² = 245.
    # 1 + 0.002 + 0.0021 + 0.00245 = 1.00655
    check(step(eng), duration=1.00655, decode=["d", "p"])


def test_step_record_to_dict_has_the_trace_shape():
    a = Request("a", 20, 1)
    eng = engine(budget=8, waiting=(a,))
    eng.time = 10.0
    rec = step(eng)
    d = rec.to_dict()
    assert set(d) == {"end", "duration", "prefill", "decode", "preempted"}
    assert d["end"] == pytest.approx(11.836) and d["duration"] == pytest.approx(1.836)
    assert d["prefill"] == {"a": 8} and d["decode"] == [] and d["preempted"] == []
    assert rec.start == 10.0 and rec.index == 0


# -- vLLM 0.32's admission rules (KVCacheManager, BlockPool, Scheduler) -----------------------------

def test_the_null_block_is_never_allocated():
    # vLLM's BlockPool keeps one block back: num_gpu_blocks 4 of 4 tokens hold 12 tokens.
    cfg = SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=10, max_model_len=10_000,
                          block_size=4, num_gpu_blocks=4)
    assert cfg.usable_blocks == 3 and cfg.kv_capacity_tokens == 12
    eng = ReferenceEngine(cfg, P4)
    assert eng.free_blocks == 3
    a = Request("a", 12, 1)
    eng.add(a)
    # 12 tokens = 3 blocks: admitted whole. 1 + 0.1*12 + 0.001*(12*13/2) = 2.278
    check(step(eng), duration=2.278, prefill={"a": 12}, first_token_ids=["a"], finished_ids=["a"])
    assert eng.free_blocks == 3 and eng.kv.usage == 0.0


def test_a_waiting_request_is_admitted_only_if_its_whole_sequence_fits():
    # 10 blocks of 4, budget 8. a (P=24) takes three 8-token chunks; b (P=20) waits behind it.
    a, b = Request("a", 24, 2), Request("b", 20, 2)
    eng = engine(blocks=10, budget=8, waiting=(a, b))
    # Step 1: a's whole 24 tokens (6 blocks) fit: admitted with a chunk of 8 (2 blocks); the
    # budget is spent. 1 + 0.1*8 + 0.001*(8*9/2) = 1.836
    check(step(eng), duration=1.836, prefill={"a": 8})
    # Steps 2, 3: a's next chunks. 1 + 0.8 + 0.001*(8*8 + 36) = 1.9; then (8*16 + 36): 1.964
    check(step(eng), duration=1.9, prefill={"a": 8})
    check(step(eng), duration=1.964, prefill={"a": 8}, first_token_ids=["a"])
    assert eng.free_blocks == 10 - 6
    # Step 4: a decodes (token 25 needs a 7th block: 3 free). b's first chunk (7 tokens, 2
    # blocks) would fit, but its whole 20 tokens (5 blocks) do not: not admitted.
    # 1 + 0.1 + 0.01*24 = 1.34
    check(step(eng), duration=1.34, decode=["a"], finished_ids=["a"])
    assert ids(eng.waiting) == ["b"] and eng.free_blocks == 10
    # Step 5: a's blocks are back; b is admitted. 1.836 as step 1.
    check(step(eng), duration=1.836, prefill={"b": 8})

    # The same with admission by first chunk only (scheduler_reserve_full_isl off): b comes in
    # at step 4 with the 7 tokens of budget a left. 1 + 0.1*(1 + 7) + 0.01*24 + 0.001*28 = 2.068
    a, b = Request("a", 24, 2), Request("b", 20, 2)
    eng = engine(blocks=10, budget=8, waiting=(a, b), full=False)
    for _ in range(3):
        step(eng)
    check(step(eng), duration=2.068, prefill={"b": 7}, decode=["a"], finished_ids=["a"])


def test_the_watermark_applies_to_admissions_while_others_run():
    # 19 usable blocks of 4 (num_gpu_blocks 20), watermark 0.1: int(0.1 * 20) = 2 blocks spare.
    # a decodes (P=8, O=1, C=8: 2 blocks; its 9th token takes a 3rd): 16 free after a.
    def run(watermark: float, prompt: int) -> StepRecord:
        a, b = decoding("a", 8, 1, 5), Request("b", prompt, 2)
        return step(engine(blocks=19, watermark=watermark, running=(a,), waiting=(b,)))

    assert run(0.1, 56).prefill == {"b": 56}    # 14 blocks + 2 spare = 16: admitted
    assert run(0.1, 60).prefill == {}           # 15 + 2 = 17 > 16: waits
    assert run(0.0, 60).prefill == {"b": 60}    # no watermark: 15 <= 16
    # alone, nobody runs: no watermark; 17 blocks of 17 free
    rec = step(engine(blocks=19, watermark=0.1, running=(), waiting=(Request("b", 68, 2),)))
    assert rec.prefill == {"b": 68}


def test_a_lone_request_ignores_the_long_prefill_threshold():
    # threshold 4: alone, a takes its whole prompt; with company, both get chunks of 4.
    a = Request("a", 10, 1)
    check(step(engine(thr=4, waiting=(a,))), duration=1 + 0.1 * 10 + 0.001 * 55,
          prefill={"a": 10}, first_token_ids=["a"], finished_ids=["a"])
    a, b = Request("a", 10, 1), Request("b", 10, 1)
    assert step(engine(thr=4, waiting=(a, b))).prefill == {"a": 4, "b": 4}
    # a lone running request mid-prefill gets the rest at once
    a = Request("a", 20, 1, computed=4)
    assert step(engine(thr=4, running=(a,))).prefill == {"a": 16}


def test_a_prompt_larger_than_the_cache_blocks_the_queue_for_good():
    # 3 usable blocks of 4 (12 tokens). h (13 tokens, 4 blocks) can never be admitted; c waits
    # behind it for ever, as in vLLM (FCFS: admission stops at the head).
    from duetime.engine import EngineStuck, Snapshot, forecast

    a, h, c = Request("a", 5, 3), Request("h", 13, 2), Request("c", 2, 2)
    eng = engine(blocks=3, waiting=(a, h, c))
    check(step(eng), duration=1 + 0.1 * 5 + 0.001 * 15, prefill={"a": 5}, first_token_ids=["a"])
    step(eng)
    check(step(eng), duration=1 + 0.1 + 0.01 * 6, decode=["a"], finished_ids=["a"])
    assert ids(eng.waiting) == ["h", "c"] and eng.free_blocks == 3
    with pytest.raises(EngineStuck, match=r"'h' can never be admitted: its 13 tokens need 4 KV "
                       r"blocks and the instance has 3; it blocks the queue"):
        eng.step()
    # a forecast behind it: never, with the reason
    snap = Snapshot.from_dict({"config": {"max_num_batched_tokens": 100, "max_num_seqs": 10,
                                          "max_model_len": 10000, "block_size": 4,
                                          "num_gpu_blocks": 4},
                               "batch_time": P4.to_dict(),
                               "waiting": [{"id": "h", "prompt_tokens": 13,
                                            "predicted_output_tokens": 2}]})
    for f in (forecast(snap, 2), forecast(snap, 2, trace=True)):
        assert f.estimate_s == float("inf") and "'h' can never be admitted" in f.reason
        assert f.to_dict()["estimate_s"] is None
