"""The serving frontend as a queue (engine/frontend.py): FIFO work per API server, chunks
merged while a stream's last one waits, the trace replay through frontend and engine, and
the forecasts' closed form."""

from __future__ import annotations

import math

import pytest

from duetime.engine import Engine, SchedulerConfig
from duetime.engine.batch_time import Paper4
from duetime.engine.frontend import Frontend, FrontendModel, serve_trace


def test_requests_queue_on_one_server_and_spread_over_two():
    one = Frontend(FrontendModel(request_s=0.002), start=0.0)
    assert [one.admit(f"r{i}", 0.0) for i in range(3)] == pytest.approx([0.002, 0.004, 0.006])
    assert one.wait_s(0.001) == pytest.approx(0.005)
    two = Frontend(FrontendModel(request_s=0.002, servers=2), start=0.0)
    assert [two.admit(f"r{i}", 0.0) for i in range(4)] == pytest.approx(
        [0.002, 0.002, 0.004, 0.004])


def test_a_step_s_chunks_go_out_in_order_and_a_waiting_chunk_takes_the_next_token():
    fe = Frontend(FrontendModel(request_s=0.0, chunk_s=0.001), start=0.0)
    for rid in ("a", "b", "c"):
        fe.admit(rid, 0.0)
    assert fe.emit(1.0, ["a", "b", "c"]) == pytest.approx([1.001, 1.002, 1.003])
    # the next step's outputs come while c's chunk still waits to start (it starts at 1.002)
    assert fe.emit(1.0015, ["a", "b", "c"]) == pytest.approx([1.004, 1.005, 1.003])
    assert fe.chunk_end("c") == pytest.approx(1.003)
    fe.finish("c")
    assert math.isnan(fe.chunk_end("c"))


def test_an_idle_frontend_sends_each_token_at_its_cost():
    fe = Frontend(FrontendModel(chunk_s=0.001))
    fe.admit("a", 0.0)
    assert fe.emit(5.0, ["a"]) == [pytest.approx(5.001)]
    assert fe.emit(6.0, ["a"]) == [pytest.approx(6.001)]


def _engine() -> Engine:
    return Engine(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024,
                                  block_size=16, num_gpu_blocks=400),
                  Paper4(b0=0.003, b1=1e-5, b2=0.0, b3=0.0), time=0.0)


def test_a_free_frontend_leaves_the_engine_s_times():
    sends = [(f"r{i}", 0.01 * i, 50 + i, 5 + i % 3) for i in range(12)]
    got = serve_trace(_engine(), Frontend(FrontendModel()), sends)
    ref = _engine()
    for rid, sent, prompt, out in sends:
        ref.run_until(sent)
        ref.add(rid, prompt, out, arrival=sent)
    ref.drain()
    cols = ref.lookup([s[0] for s in sends])
    assert [got[s[0]].first for s in sends] == pytest.approx(cols.first_token.tolist())
    assert [got[s[0]].last for s in sends] == pytest.approx(cols.finish_time.tolist())


def test_a_slow_frontend_delays_first_tokens_and_merges_chunks():
    sends = [(f"r{i}", 0.0, 20, 40) for i in range(8)]
    free = serve_trace(_engine(), Frontend(FrontendModel()), sends)
    slow_fe = Frontend(FrontendModel(request_s=0.004, chunk_s=0.002))
    slow = serve_trace(_engine(), slow_fe, sends)
    # the eighth request reaches the engine after 8 hand-offs, so its first token is later
    assert slow["r7"].first > free["r7"].first + 7 * 0.004
    # 8 streams x 2 ms per chunk outrun 3 ms steps: merged chunks keep the lag bounded, the
    # last tokens go out within a round of chunks of the engine's finish
    for rid in free:
        assert slow[rid].last >= free[rid].last
        assert slow[rid].last - free[rid].last < 8 * 0.002 + 8 * 0.004 + 0.01


def test_the_forecast_s_closed_form_and_the_config_form():
    fm = FrontendModel(request_s=0.002, chunk_s=0.0005, servers=2)
    assert fm.own_s == pytest.approx(0.0025)
    assert fm.delay_s(0.01, 8) == pytest.approx(0.01 + 0.0005 * 4)
    assert fm.delay_s(-1.0, 0) == 0.0
    assert FrontendModel.from_dict(fm.to_dict()) == fm
    with pytest.raises(ValueError, match="unknown key"):
        FrontendModel.from_dict({"request_ms": 1, "chunks": 2})
    with pytest.raises(ValueError, match="servers"):
        FrontendModel.from_dict({"servers": 0})
