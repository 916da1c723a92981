"""Hand-worked forecasts through the public API (``duetime.Snapshot`` + ``duetime.forecast``).

Expected values were worked out by hand from the vLLM V1 rules
(``docs/scheduling-rules.md``) and the batch-time formulas (``docs/engine.md``, "Batch-time
models").
The batch-time models have simple coefficients:

* paper4: ``1 + 0.1·Σ(pre+dec) + 0.01·Σ c·dec + 0.001·Σ(pre·c + pre(pre+1)/2)``
* sfs6:   ``1 + 0.1·P + 0.01·Σpre² + 0.001·D + 0.0001·ΣL + 0.00001·ΣL²``

Every snapshot is taken at ``time = 100``; ``estimate_s`` is measured from it, trace ``end``s
are absolute. Each case is checked on every path: the forecaster (``forecast`` without trace),
the traced reference loop, and ``replay`` (fast and reference).
"""

from __future__ import annotations

import pytest

import duetime
from duetime.engine import replay

PAPER4 = {"model": "paper4", "coefficients": {"b0": 1.0, "b1": 0.1, "b2": 0.01, "b3": 0.001}}
SFS6 = {"model": "sfs6", "coefficients": {"c0": 1.0, "cp": 0.1, "cpsq": 0.01, "cd": 0.001,
                                          "cs": 0.0001, "css": 0.00001}}
T0 = 100.0


def snapshot(running=(), waiting=(), *, budget: int = 8, block_size: int = 4,
             blocks: int = 100, batch_time=PAPER4) -> duetime.Snapshot:
    """``blocks``: the usable KV blocks (num_gpu_blocks is one more: vLLM's null block)."""
    return duetime.Snapshot.from_dict({
        "version": 1,
        "time": T0,
        "config": {"max_num_batched_tokens": budget, "max_num_seqs": 16,
                   "max_model_len": 4096, "block_size": block_size,
                   "num_gpu_blocks": blocks + 1, "long_prefill_token_threshold": 0},
        "batch_time": batch_time,
        "running": list(running),
        "waiting": list(waiting),
    })


def req(id: str, prompt: int, predicted: int, *, output: int = 0, computed: int = 0) -> dict:
    return {"id": id, "prompt_tokens": prompt, "computed_tokens": computed,
            "output_tokens": output, "predicted_output_tokens": predicted, "arrival": 99.0}


def step(duration: float, end: float, prefill=None, decode=None, preempted=None) -> dict:
    return {"end": end, "duration": duration, "prefill": prefill or {}, "decode": decode or [],
            "preempted": preempted or []}


def check(snap: duetime.Snapshot, prompt: int, *, until: str, estimate: float,
          trace: list[dict], predicted: int | None = None) -> None:
    """The forecast on every path, and the traced steps entry by entry."""
    results = [
        duetime.forecast(snap, prompt, predicted, until=until),
        replay(snap, prompt, predicted, until=until),
        replay(snap, prompt, predicted, until=until, reference=True),
    ]
    traced = duetime.forecast(snap, prompt, predicted, until=until, trace=True)
    for f in [*results, traced]:
        assert f.estimate_s == pytest.approx(estimate, rel=1e-12)
        assert f.steps == len(trace)
    assert traced.trace is not None and len(traced.trace) == len(trace)
    for got, want in zip(traced.trace, trace, strict=True):
        assert set(got) == {"end", "duration", "prefill", "decode", "preempted"}
        assert got["end"] == pytest.approx(want["end"], rel=1e-12)
        assert got["duration"] == pytest.approx(want["duration"], rel=1e-12)
        assert got["prefill"] == want["prefill"]
        assert got["decode"] == want["decode"]
        assert got["preempted"] == want["preempted"]
    assert traced.to_dict()["trace"] == traced.trace
    assert set(results[0].to_dict()) == {"estimate_s", "steps"}


def test_idle_instance_probe_alone_is_chunked_by_the_budget():
    snap = snapshot()
    # 20-token probe, budget 8: chunks 8, 8, 4 at contexts 0, 8, 16.
    #   1 + 0.8 + 0.001*(0 + 36)   = 1.836
    #   1 + 0.8 + 0.001*(64 + 36)  = 1.9
    #   1 + 0.4 + 0.001*(64 + 10)  = 1.474     -> first token at 5.21
    ttft = [step(1.836, 101.836, {"probe": 8}), step(1.9, 103.736, {"probe": 8}),
            step(1.474, 105.21, {"probe": 4})]
    check(snap, 20, until="first_token", estimate=5.21, trace=ttft)
    # Until finish with 3 outputs: two more decodes at ctx 20 and 21:
    #   1 + 0.1 + 0.2 = 1.3,  1 + 0.1 + 0.21 = 1.31  -> 7.82
    e2e = [*ttft, step(1.3, 106.51, decode=["probe"]), step(1.31, 107.82, decode=["probe"])]
    check(snap, 20, until="finish", predicted=3, estimate=7.82, trace=e2e)


def test_idle_instance_with_sfs6():
    snap = snapshot(batch_time=SFS6)
    # chunks 8, 8, 4 of a 20-token prompt; L = 20 each step (ΣL = 20, ΣL² = 400):
    #   1 + 0.8 + 0.01*64 + 0.002 + 0.004 = 2.446 (twice)
    #   1 + 0.4 + 0.01*16 + 0.002 + 0.004 = 1.566      -> 6.458
    ttft = [step(2.446, 102.446, {"probe": 8}), step(2.446, 104.892, {"probe": 8}),
            step(1.566, 106.458, {"probe": 4})]
    check(snap, 20, until="first_token", estimate=6.458, trace=ttft)
    # One more output: decode with L = 21: 1 + 0.001 + 0.0021 + 0.00441 = 1.00751
    check(snap, 20, until="finish", predicted=2, estimate=6.458 + 1.00751,
          trace=[*ttft, step(1.00751, 107.46551, decode=["probe"])])


def test_probe_behind_a_long_queue_waits_for_every_earlier_prompt():
    # Three 10-token prompts queued (they keep decoding: predicted 50), budget 8, probe P=4.
    snap = snapshot(waiting=[req("w1", 10, 50), req("w2", 10, 50), req("w3", 10, 50)])
    trace = [
        # w1 chunk 8: 1 + 0.8 + 0.036 = 1.836
        step(1.836, 101.836, {"w1": 8}),
        # w1 last 2 at c=8 (16 + 3 = 19), w2 first 6 (21): 1 + 0.8 + 0.04 = 1.84
        step(1.84, 103.676, {"w1": 2, "w2": 6}),
        # w1 decodes (c=10), w2 last 4 at c=6 (24 + 10), w3 first 3 (6):
        # 1 + 0.1*8 + 0.01*10 + 0.001*40 = 1.94
        step(1.94, 105.616, {"w2": 4, "w3": 3}, ["w1"]),
        # w1, w2 decode (c = 11, 10), w3 gets 6 at c=3 (18 + 21); the probe gets no budget:
        # 1 + 0.8 + 0.21 + 0.039 = 2.049
        step(2.049, 107.665, {"w3": 6}, ["w1", "w2"]),
        # w1, w2 decode (c = 12, 11), w3 last 1 at c=9 (9 + 1), probe 4 (10):
        # 1 + 0.1*7 + 0.01*23 + 0.001*20 = 1.95
        step(1.95, 109.615, {"w3": 1, "probe": 4}, ["w1", "w2"]),
    ]
    check(snap, 4, until="first_token", estimate=9.615, trace=trace)


def test_probe_behind_decoders_only_gets_the_budget_they_leave():
    # Two decoders (1 token each per step), budget 8, block 16; probe P=10.
    snap = snapshot(running=[req("d1", 100, 50, output=5, computed=104),
                             req("d2", 40, 50, output=1, computed=40)],
                    block_size=16, blocks=1000)
    ttft = [
        # decodes c = 104, 40; probe 6: 1 + 0.1*8 + 0.01*144 + 0.001*21 = 3.261
        step(3.261, 103.261, {"probe": 6}, ["d1", "d2"]),
        # decodes c = 105, 41; probe 4 at c=6 (24 + 10): 1 + 0.6 + 1.46 + 0.034 = 3.094
        step(3.094, 106.355, {"probe": 4}, ["d1", "d2"]),
    ]
    check(snap, 10, until="first_token", estimate=6.355, trace=ttft)
    # Second output: three decodes, c = 106 + 42 + 10 = 158: 1 + 0.3 + 1.58 = 2.88
    e2e = [*ttft, step(2.88, 109.235, decode=["d1", "d2", "probe"])]
    check(snap, 10, until="finish", predicted=2, estimate=9.235, trace=e2e)


def test_probe_is_preempted_by_a_growing_decoder_and_recomputes():
    # 4 blocks of 4, budget 16. d decodes (P=7, O=1, C=7: 2 blocks, predicted 3); probe P=8.
    snap = snapshot(running=[req("d", 7, 3, output=1, computed=7)], budget=16, blocks=4)
    # Step 1: d's token 8 fits its 2 blocks; probe admitted with the 2 free blocks.
    #   1 + 0.1*9 + 0.01*7 + 0.001*36 = 2.006 -> first token
    s1 = step(2.006, 102.006, {"probe": 8}, ["d"])
    check(snap, 8, until="first_token", estimate=2.006, trace=[s1])
    # Step 2: d's token 9 needs a 3rd block, none free: the probe (last) is preempted and goes
    #   back to waiting; d decodes (1 + 0.1 + 0.08 = 1.18) and reaches 3 outputs, freeing 3.
    # Step 3: the probe recomputes P + O = 9 tokens: 1 + 0.9 + 0.045 = 1.945 (2nd output).
    # Step 4: the probe decodes at c=9: 1 + 0.1 + 0.09 = 1.19 (3rd output: finish).
    e2e = [s1, step(1.18, 103.186, decode=["d"], preempted=["probe"]),
           step(1.945, 105.131, {"probe": 9}), step(1.19, 106.321, decode=["probe"])]
    check(snap, 8, until="finish", predicted=3, estimate=6.321, trace=e2e)


def test_running_request_past_its_prediction_keeps_running():
    # d has made 5 outputs against a prediction of 3: it must not stop after its next token.
    # Budget 8, probe P=12: step 1 d decode + probe 7, step 2 d decode again + probe 5.
    snap = snapshot(running=[req("d", 4, 3, output=5, computed=8)])
    # 1 + 0.1*8 + 0.01*8 + 0.001*28 = 1.908;  1 + 0.1*6 + 0.01*9 + 0.001*(35 + 15) = 1.74
    trace = [step(1.908, 101.908, {"probe": 7}, ["d"]),
             step(1.74, 103.648, {"probe": 5}, ["d"])]
    check(snap, 12, until="first_token", estimate=3.648, trace=trace)


def test_estimate_is_measured_from_the_snapshot_time():
    base = snapshot().to_dict()
    later = duetime.Snapshot.from_dict({**base, "time": 5000.0})
    f = duetime.forecast(later, 20, trace=True)
    assert f.estimate_s == pytest.approx(5.21)
    assert f.trace is not None and f.trace[-1]["end"] == pytest.approx(5005.21)
