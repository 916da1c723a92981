"""`duetime calibrate`: the probes' features, and recovering a known batch-time model from an
emulated instance over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics

import pytest

from duetime.calibrate import (
    Calibration,
    CalibrationError,
    Sample,
    calibrate,
    decode_row,
    fit,
    prefill_row,
)
from duetime.cli import main
from duetime.emulator import Emulator, create_app
from duetime.engine.batch_time import Paper4, Sfs6
from duetime.engine.config import SchedulerConfig
from duetime.engine.request import Request
from duetime.engine.scheduler import ReferenceEngine
from duetime.web.server import AppServer

CFG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048,
                      block_size=16, num_gpu_blocks=4096, long_prefill_token_threshold=0)
TRUE = Paper4(b0=0.008, b1=6e-5, b2=2e-7, b3=4e-8)


@pytest.mark.parametrize("prompt", [1, 100, 512, 513, 1300])
def test_prefill_row_matches_the_engine(prompt: int) -> None:
    """The lone-prefill features give the reference engine's time to first token."""
    eng = ReferenceEngine(CFG, TRUE)
    req = Request("r", prompt, 4)
    eng.add(req)
    while req.first_token is None:
        eng.step()
    cal = Calibration(TRUE, CFG, 0.0)
    got = cal.fitted(Sample("prefill", prefill_row(prompt, 512), 1.0, ""))
    assert got == pytest.approx(req.first_token, rel=1e-12)


def test_fit_recovers_exact_samples() -> None:
    cal = Calibration(TRUE, CFG, 0.003)
    rows = [prefill_row(p, 512) for p in (16, 128, 512, 800, 1500)]
    rows += [decode_row(n, n * c) for n in (1, 2, 4, 8) for c in (20, 300)]
    samples = [Sample("prefill" if r[8] else "decode", r, 0.0, "") for r in rows]
    samples = [Sample(s.kind, s.x, cal.fitted(s), "") for s in samples]
    got = fit(samples, CFG)
    assert got.model.b0 == pytest.approx(TRUE.b0, rel=1e-3)
    assert got.model.b1 == pytest.approx(TRUE.b1, rel=1e-3)
    assert got.model.b3 == pytest.approx(TRUE.b3, rel=1e-3)
    assert got.request_overhead_s == pytest.approx(0.003, rel=1e-3)


def test_the_same_probes_fit_sfs6() -> None:
    """The samples keep the engine's batch features: the released SFS code's six-term model
    is recovered from the same kind of probes (with prompts of several lengths per batch)."""
    true6 = Sfs6(c0=0.006, cp=5e-5, cpsq=3e-9, cd=2e-4, cs=1e-6, css=2e-10)
    cal = Calibration(true6, CFG, 0.002)
    rows = [prefill_row(p, 512) for p in (16, 128, 300, 512, 800, 1500)]
    rows += [decode_row(n, n * c) for n in (1, 2, 4, 8) for c in (20, 300, 1000)]
    samples = [Sample("prefill" if r[8] else "decode", r, 0.0, "") for r in rows]
    samples = [Sample(s.kind, s.x, cal.fitted(s), "") for s in samples]
    got = fit(samples, CFG, "sfs6")
    assert isinstance(got.model, Sfs6)
    assert max(abs(e) for k in ("prefill", "decode") for e in got.errors(k)) < 1e-6
    assert got.model.cd == pytest.approx(true6.cd, rel=1e-3)
    assert got.request_overhead_s == pytest.approx(0.002, rel=1e-2)
    with pytest.raises(ValueError, match="unknown batch-time model"):
        fit(samples, CFG, "nope")


def test_fit_needs_both_kinds() -> None:
    with pytest.raises(CalibrationError, match="too few samples"):
        fit([Sample("prefill", prefill_row(p, 512), 0.01, "") for p in range(1, 10)], CFG)


def test_calibrate_an_emulated_instance() -> None:
    """Over HTTP against an emulator that runs a known model: the fit is close to it."""

    async def go() -> Calibration:
        emu = Emulator(TRUE, CFG, model_name="m")
        srv = await AppServer(create_app(emu)).start()
        try:
            return await calibrate(srv.url, "m", CFG, reps=2)
        finally:
            await srv.stop()
            await emu.close()

    cal = asyncio.run(go())
    assert cal.model.b0 == pytest.approx(TRUE.b0, rel=0.3)
    assert cal.model.b1 == pytest.approx(TRUE.b1, rel=0.3)
    assert cal.model.b3 == pytest.approx(TRUE.b3, rel=0.5)
    # decode probes at a realistic context (1,024 tokens here) identify the context term
    assert cal.model.b2 == pytest.approx(TRUE.b2, rel=0.5)
    assert 0.0 <= cal.request_overhead_s < 0.02
    for kind in ("prefill", "decode"):
        assert statistics.median(abs(e) for e in cal.errors(kind)) < 0.1
    entry = cal.instance_entry()
    assert entry["batch_time"]["model"] == "paper4" and entry["config"]["max_num_seqs"] == 8


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "m", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
            "--max-model-len", "2048"]
    assert main(["calibrate", "ftp://x", *args]) == 2
    assert "must be an http(s) URL" in capsys.readouterr().err
    assert main(["calibrate", "http://127.0.0.1:9", *args, "--block-size", "16",
                 "--num-gpu-blocks", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duetime: error: http://127.0.0.1:9") and err.count("\n") == 1


def test_cli_writes_an_instance_entry_a_pool_accepts(tmp_path, capsys) -> None:
    """`duetime calibrate` against `duetime emulate` (a subprocess): its YAML, pasted into an
    instance entry, is a valid pool config that keeps the fitted values."""
    import os
    import subprocess
    import sys

    import yaml

    from duetime.gateway import pool_from_dict

    proc = subprocess.Popen([sys.executable, "-m", "duetime", "emulate", "--profile", "qwen3-8b",
                             "--port", "0", "--log-level", "warning"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on " in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        out = tmp_path / "entry.yaml"
        assert main(["calibrate", url, "--model", "qwen3-8b", "--max-num-batched-tokens", "512",
                     "--max-num-seqs", "4", "--max-model-len", "4096", "--block-size", "16",
                     "--num-gpu-blocks", "1000", "--reps", "1", "--out", str(out)]) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = out.read_text()
    assert text.startswith(f"# duetime calibrate {url} --model qwen3-8b")
    assert "# fit: prefill " in text
    entry = yaml.safe_load(text)
    assert set(entry) == {"batch_time", "config", "request_overhead_ms"}
    pool = pool_from_dict({"instances": [{"name": "i", "model": "qwen3-8b", "url": url,
                                          **entry}]})
    inst = pool.instances[0]
    assert inst.config.max_num_seqs == 4 and inst.config.num_gpu_blocks == 1000
    assert inst.batch_time.to_dict() == entry["batch_time"]
    assert inst.request_overhead_s == pytest.approx(entry["request_overhead_ms"] / 1000)
    assert "wrote" in capsys.readouterr().err


def test_frontend_costs_separate_request_and_chunk_work(monkeypatch):
    """The API server's CPU counter over the two probes gives back its per-request and
    per-chunk costs; a server without the counter gets no frontend."""
    import asyncio

    from duetime.calibrate import endpoint
    from duetime.engine.config import SchedulerConfig

    class Server:  # the counter as vLLM's API server would move it
        cpu = 10.0

    class Prober:
        def prompt(self, n):
            return [1] * n

        async def stream(self, prompt, max_tokens):
            Server.cpu += 0.002 + 0.0001 * (max_tokens + 1)
            return 0.0, [(0.0, k + 1) for k in range(max_tokens)], len(prompt)

    async def cpu(p):
        return round(Server.cpu, 2) if Server.cpu is not None else None  # (10 ms ticks)

    monkeypatch.setattr(endpoint, "_api_cpu_s", cpu)
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=2048)
    got = asyncio.run(endpoint.frontend_costs(Prober(), cfg, requests=400, stream_tokens=1000))
    assert got is not None and got.servers == 1
    assert got.request_s == pytest.approx(0.002, rel=0.1)
    assert got.chunk_s == pytest.approx(0.0001, rel=0.1)
    Server.cpu = None
    assert asyncio.run(endpoint.frontend_costs(Prober(), cfg)) is None


def test_calibrate_fits_the_lora_terms_of_an_emulated_instance() -> None:
    """An emulator serving adapter A on a model that prices LoRA steps: ``lora="A"`` repeats
    the probes on it and the LoRA terms come out close to the truth, the base model's as
    without it."""
    from duetime.emulator.core import LoraModule

    true = TRUE.with_lora(4e-3, 6e-5, 4e-4)
    cfg = dataclasses.replace(CFG, max_loras=1)

    async def go() -> Calibration:
        emu = Emulator(true, cfg, model_name="m", max_loras=1,
                       lora_modules=(LoraModule("A", "/adapters/a"),))
        srv = await AppServer(create_app(emu)).start()
        try:
            return await calibrate(srv.url, "m", cfg, reps=2, lora="A",
                                   measure_frontend=False)
        finally:
            await srv.stop()
            await emu.close()

    cal = asyncio.run(go())
    assert cal.model.b0 == pytest.approx(TRUE.b0, rel=0.3)
    assert cal.model.lora_step == pytest.approx(true.lora_step, rel=0.5)
    assert cal.model.lora_prefill == pytest.approx(true.lora_prefill, rel=0.3)
    assert cal.model.lora_decode == pytest.approx(true.lora_decode, rel=0.5)
    for kind in ("prefill", "decode", "lora prefill", "lora decode"):
        assert statistics.median(abs(e) for e in cal.errors(kind)) < 0.1, kind
    entry = cal.instance_entry()
    assert entry["config"]["max_loras"] == 1
    assert entry["batch_time"]["coefficients"]["lora_decode"] > 0
