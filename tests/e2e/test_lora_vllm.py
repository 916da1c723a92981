"""LoRA adapters on a real vLLM (CPU build): what duetime needs of a multi-LoRA server works on
vLLM 0.32, with tiny random-weight PEFT adapters built offline (``make_tiny_lora.py``).

One server of ``tiny-small`` with ``--enable-lora --max-loras 2`` and three adapters from
``--lora-modules``, started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``: ``/v1/models`` lists
the adapters (root: the path, parent: the base model); completions on each adapter and on the
base model succeed and differ (each adapter is applied); adapters load and unload at run time;
``vllm:lora_requests_info`` names the adapters of running requests; the gateway routes
requests named by adapter. (vLLM 0.32's CPU bug — a base request that shares a step with a
LoRA request may get an adapter, depending on what its last slot holds — is described in
``scripts/vllm_cpu/README.md``, not tested: its outcome depends on the slots' history.)
"""

from __future__ import annotations

import math
import os
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import (
    CALIBRATION_ATTEMPTS,
    MODEL_SEED,
    MODELS,
    REPO,
    SCRIPTS,
    START_TIMEOUT_S,
    _build_models,
    _clean_env,
    _cores,
    _free_port,
    _Proc,
    _tail,
    _wait_healthy,
)

pytestmark = pytest.mark.e2e

MODEL = "tiny-small"
STATIC = ("a1", "a2", "a3")  # registered by --lora-modules
RUNTIME = "a4"  # loaded and unloaded through the API
MAX_LORAS = 2
LORA_RANK = 8
TIMEOUT = 60.0
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG_TOKENS = 1900  # a long stream (the prompt's few tokens + this < --max-model-len 2048)
METRIC_ATTEMPTS = 3


@dataclass(frozen=True)
class LoraServer:
    """The server and the adapters' folders (name -> path as passed to vLLM)."""

    base_url: str
    model_dir: Path
    adapters: dict[str, Path]


def _make_adapters(python: Path, model_dir: Path, out: Path, count: int) -> list[Path]:
    """``count`` adapters for ``model_dir`` under ``out`` (cached there like the models)."""
    proc = subprocess.run(
        [str(python), str(SCRIPTS / "make_tiny_lora.py"), str(model_dir), str(out),
         "--count", str(count), "--rank", str(LORA_RANK), "--seed", str(MODEL_SEED)],
        capture_output=True, text=True, env=_clean_env(), timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"building LoRA adapters failed:\n{(proc.stdout + proc.stderr)[-3000:]}",
                    pytrace=False)
    return [Path(line.split("=", 1)[1]) for line in proc.stdout.splitlines() if "=" in line]


@pytest.fixture(scope="module")
def lora_server(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LoraServer]:
    cache = Path(os.environ.get("DUETIME_VLLM_MODEL_CACHE", REPO / ".cache" / "vllm-models"))
    model_dir = _build_models(vllm_python, cache)[MODEL]
    paths = _make_adapters(vllm_python, model_dir, cache / f"{MODEL}-lora", len(STATIC) + 1)
    adapters = dict(zip((*STATIC, RUNTIME), paths, strict=True))
    flags = ("--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(LORA_RANK),
             "--lora-modules", *(f"{name}={adapters[name]}" for name in STATIC))
    log = tmp_path_factory.mktemp("vllm-lora") / f"{MODEL}-lora.log"
    proc = _Proc(MODEL, MODELS[MODEL], model_dir, _free_port(), _cores()[0], log, flags)
    try:
        with pytest.MonkeyPatch.context() as mp:  # (the server's env is read at its start)
            mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
            proc.start(vllm_python)
        try:
            _wait_healthy([proc], START_TIMEOUT_S)
        except Exception as exc:
            pytest.fail(f"{type(exc).__name__}: {exc}\n\n--- {log} (tail) ---\n{_tail(log)}",
                        pytrace=False)
        yield LoraServer(proc.base_url, model_dir, adapters)
    finally:
        proc.stop()


@pytest.fixture
def client(lora_server: LoraServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_server.base_url, timeout=TIMEOUT) as c:
        yield c


def _complete(client: httpx.Client, model: str, max_tokens: int = 4) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": model, "prompt": "hello world the answer is", "max_tokens": max_tokens,
        "logprobs": 3, **GREEDY})


def test_models_lists_the_adapters_with_root_and_parent(lora_server: LoraServer,
                                                        client: httpx.Client) -> None:
    cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, *STATIC}, cards
    assert cards[MODEL]["parent"] is None
    for name in STATIC:
        assert cards[name]["root"] == str(lora_server.adapters[name]), cards[name]
        assert cards[name]["parent"] == MODEL, cards[name]


def test_completions_on_each_adapter_and_the_base_model(client: httpx.Client) -> None:
    """Each completes; the first token's distribution differs between any two of them (each
    adapter's own random weights are applied, none is the base model)."""
    first: dict[str, dict[str, float]] = {}
    for model in (MODEL, *STATIC):
        r = _complete(client, model)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == model
        assert body["usage"]["completion_tokens"] == 4
        first[model] = body["choices"][0]["logprobs"]["top_logprobs"][0]
    models = list(first)
    for i, a in enumerate(models):
        for b in models[i + 1:]:
            assert first[a] != first[b], (a, b, first)


def test_runtime_load_and_unload(lora_server: LoraServer, client: httpx.Client) -> None:
    path = str(lora_server.adapters[RUNTIME])
    r = client.post("/v1/load_lora_adapter", json={"lora_name": RUNTIME, "lora_path": path})
    assert r.status_code == 200, r.text
    try:
        card = {m["id"]: m for m in client.get("/v1/models").json()["data"]}[RUNTIME]
        assert (card["root"], card["parent"]) == (path, MODEL)
        r = _complete(client, RUNTIME)
        assert r.status_code == 200, r.text
        # a second load of the same name is refused (vLLM: load_inplace=true to replace it)
        again = client.post("/v1/load_lora_adapter",
                            json={"lora_name": RUNTIME, "lora_path": path})
        assert again.status_code == 400, again.text
    finally:
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": RUNTIME})
    assert r.status_code == 200, r.text
    assert RUNTIME not in {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert _complete(client, RUNTIME).status_code == 404
    assert client.post("/v1/unload_lora_adapter",
                       json={"lora_name": RUNTIME}).status_code == 404


_SERIES = re.compile(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def lora_series(metrics: str) -> list[tuple[dict[str, str], float]]:
    """``vllm:lora_requests_info``'s series: (labels, value). Its value is the time (Unix s)
    the engine last reported that label set; a set no longer current is never removed, so the
    current state is the newest series."""
    return [(dict(_LABEL.findall(labels)), float(value))
            for labels, value in _SERIES.findall(metrics)]


def newest(metrics: str) -> dict[str, str]:
    return max(lora_series(metrics), key=lambda s: s[1])[0]


def adapters_of(labels: dict[str, str], key: str) -> set[str]:
    return {a for a in labels[key].split(",") if a}


_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)


@dataclass
class Seen:
    """What the scrapes during :func:`_streams_until_seen` showed."""

    both: dict[str, str] | None  # a series set since the streams began naming them all
    named: set[str]  # the adapters some series set since then names
    overlapped: bool  # a scrape saw as many requests running as streams
    series: list[str]  # every set of series seen (for the failure message)


def _streams_until_seen(client: httpx.Client, models: tuple[str, ...]) -> Seen:
    """Long streams on ``models`` at once; ``/metrics`` scraped until a series set since the
    streams began names them all as running (vLLM never removes a label set, and values it
    with the Unix time it last set it: such a series says the engine reported them together,
    whenever the scrape came). Under load the requests may not overlap in the engine (one
    ends before the other is scheduled): ``overlapped`` says whether a scrape saw them all
    running. The streams are closed (aborted) once seen."""
    stop = threading.Event()
    started = threading.Barrier(len(models) + 1)
    errors: list[str] = []

    def stream(model: str) -> None:
        try:
            with httpx.Client(base_url=client.base_url, timeout=TIMEOUT) as c, c.stream(
                    "POST", "/v1/completions", json={
                        "model": model, "prompt": "hello", "max_tokens": LONG_TOKENS,
                        "stream": True, **GREEDY}) as r:
                if r.status_code != 200:
                    errors.append(f"{model}: {r.status_code} {r.read()!r}")
                lines = r.iter_lines()
                next(lines, None)  # its first token: from here on it is running
                started.wait(TIMEOUT)
                for _ in lines:
                    if stop.is_set():
                        break
        except Exception as exc:  # (reported by the caller)
            errors.append(f"{model}: {exc!r}")
            started.abort()

    seen = Seen(None, set(), False, [])

    def look(text: str) -> None:
        series = lora_series(text)
        for labels, value in series:
            if value >= t0:
                names = adapters_of(labels, "running_lora_adapters")
                seen.named |= names & set(models)
                if names == set(models):
                    seen.both = labels
        running = _RUNNING.search(text)
        if running is not None and float(running.group(1)) >= len(models):
            seen.overlapped = True
        listed = str(sorted(str(x) for x in series))
        if not seen.series or seen.series[-1] != listed:
            seen.series.append(listed)

    threads = [threading.Thread(target=stream, args=(m,), daemon=True) for m in models]
    t0 = time.time()
    for t in threads:
        t.start()
    try:
        started.wait(TIMEOUT)
        while any(t.is_alive() for t in threads) and seen.both is None:
            look(client.get("/metrics").text)
            time.sleep(0.05)
    except threading.BrokenBarrierError:
        pass
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
    look(client.get("/metrics").text)  # (a series set while they ran stays listed)
    assert not errors, errors
    return seen


def test_lora_requests_info_names_running_adapters(client: httpx.Client) -> None:
    """While requests on a1 and a2 run, ``vllm:lora_requests_info`` gets series naming them
    (valued with a Unix time since they began), one naming both (comma-separated) with
    max_lora 2 whenever they ran together; once they are gone the newest series names none,
    and the earlier label sets stay listed."""
    models = ("a1", "a2")
    for _ in range(METRIC_ATTEMPTS):  # (again if they did not run together: load)
        seen = _streams_until_seen(client, models)
        if seen.both is not None:
            break
    assert seen.named == set(models), seen.series
    if seen.both is None:  # (under load one may have ended before the other began)
        assert not seen.overlapped, f"both ran at once but no series named both: {seen.series}"
    else:
        assert seen.both["max_lora"] == str(MAX_LORAS)
        # vLLM 0.32 lists every adapter with a request in flight in both labels
        assert adapters_of(seen.both, "waiting_lora_adapters") <= set(models)
    found = seen.both

    # after the streams were aborted: the newest series names no adapter (polled: the
    # engine reports once it has dropped them)
    deadline = time.monotonic() + TIMEOUT
    while True:
        text = client.get("/metrics").text
        idle = newest(text)
        if idle["running_lora_adapters"] == "" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle == {"max_lora": str(MAX_LORAS), "running_lora_adapters": "",
                    "waiting_lora_adapters": ""}, lora_series(text)
    if found is not None:  # (the label set of both stays listed)
        assert any(labels == found for labels, _ in lora_series(text)), lora_series(text)


def test_the_gateway_routes_requests_named_by_adapter(lora_server: LoraServer) -> None:
    """``duetime serve`` in front of the LoRA server (its ``adapters:`` and ``max_loras``): a
    request naming an adapter is sent upstream under that name and answered on it (its
    logprobs are the adapter's, as asked directly); one naming the model runs on the base
    model; the gateway lists the adapters; an adapter the instance does not list is a 404,
    until it is loaded at run time: the gateway reads vLLM's ``/v1/models`` and routes it."""
    import asyncio

    from duetime.gateway import pool_from_dict
    from duetime.service import Service

    pool = pool_from_dict({
        "policy": "sfs", "quality": {"workload": None, "tasks": {"chat": {"tiny": 0.5}}},
        "instances": [{"name": "lora", "model": "tiny", "served_model": MODEL,
                       "url": lora_server.base_url, "profile": "qwen3-0.6b",
                       "config": {"max_model_len": 2048, "max_loras": MAX_LORAS},
                       "adapters": list(STATIC),
                       "price_usd_per_mtok": {"prompt": 0.1, "output": 0.1}}],
        "health": {"interval_s": 0.2},
        "timeouts": {"connect_s": 5.0, "first_token_s": TIMEOUT, "read_s": TIMEOUT}}, "test")
    body = {"prompt": "hello world the answer is", "max_tokens": 4, "logprobs": 3, **GREEDY}

    async def runtime(c: httpx.AsyncClient) -> int:
        """Load the runtime adapter on the server; once the gateway lists it, a request for
        it through the gateway (its status); unloaded again."""
        async with httpx.AsyncClient(base_url=lora_server.base_url, timeout=TIMEOUT) as d:
            r = await d.post("/v1/load_lora_adapter", json={
                "lora_name": RUNTIME, "lora_path": str(lora_server.adapters[RUNTIME])})
            assert r.status_code == 200, r.text
            try:
                for _ in range(200):
                    ids = {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
                    if RUNTIME in ids:
                        break
                    await asyncio.sleep(0.05)
                r = await c.post("/v1/completions", json={"model": RUNTIME, **body})
                assert r.status_code != 200 or r.json()["model"] == RUNTIME, r.text
                return r.status_code
            finally:
                await d.post("/v1/unload_lora_adapter", json={"lora_name": RUNTIME})

    async def go() -> tuple[dict[str, Any], dict[str, dict[str, Any]], int, int]:
        svc = await Service(pool, drain_timeout_s=3.0).start()
        try:
            async with httpx.AsyncClient(base_url=svc.url, timeout=TIMEOUT) as c:
                models = (await c.get("/v1/models")).json()
                out = {}
                for model in ("a1", "a2", "tiny"):
                    r = await c.post("/v1/completions", json={"model": model, **body})
                    assert r.status_code == 200, r.text
                    assert r.headers["x-duetime-instance"] == "lora"
                    out[model] = r.json()
                missing = (await c.post("/v1/completions",
                                        json={"model": RUNTIME, **body})).status_code
                loaded = await runtime(c)
            return models, out, missing, loaded
        finally:
            await svc.stop()

    with httpx.Client(base_url=lora_server.base_url, timeout=TIMEOUT) as direct:
        want = {m: _complete(direct, m if m != "tiny" else MODEL).json()
                for m in ("a1", "a2", "tiny")}
    models, got, missing, loaded = asyncio.run(go())
    listed = {m["id"]: m for m in models["data"]}
    assert {"a1", "a2", "a3"} <= set(listed) and listed["a1"]["parent"] == "tiny"
    for model in ("a1", "a2", "tiny"):
        served = got[model]["model"]
        assert served == (model if model != "tiny" else MODEL)
        assert got[model]["choices"][0]["text"] == want[model]["choices"][0]["text"]
        assert got[model]["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want[model]["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    # (the adapters answer differently from each other: each ran on its own)
    assert got["a1"]["choices"][0]["logprobs"]["token_logprobs"] != pytest.approx(
        got["a2"]["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert missing == 404
    assert loaded == 200


def test_calibrate_and_validate_with_adapters(lora_server: LoraServer, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``duetime calibrate --lora`` fits the LoRA terms of a real vLLM with adapters (its steps
    with LoRA are slower: ``scripts/vllm_cpu/README.md``), and ``duetime validate --lora``
    drives it with half the requests on adapters and reports their error apart. (How small the
    error is, is measured on tiny-large by ``benchmarks/lora_fidelity_vllm.py``: on this
    2-core machine tiny-small's client-side timings are the processes sharing a core, see
    ``test_fidelity.py``.)"""
    import yaml

    from duetime.cli import main

    profile = tmp_path / "profile.yaml"

    def calibrate() -> dict[str, Any]:
        """The profile ``duetime calibrate --lora`` writes (retried on a failed probe: seen in
        CI, no decode sample at all — tiny-small's API server, on a busy machine, packs a
        stream's tokens into one or two chunks — a busy moment, not the fit: the suite's own
        calibration tries again too, conftest.CALIBRATION_ATTEMPTS)."""
        for attempt in range(1, CALIBRATION_ATTEMPTS + 1):
            rc = main(["calibrate", lora_server.base_url, "--model", MODEL,
                       "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
                       "--max-model-len", "2048", "--reps", "2", "--lora", STATIC[0],
                       "--max-loras", str(MAX_LORAS), "--out", str(profile)])
            if rc == 0:
                break
            print(f"calibrate --lora: attempt {attempt}: {capsys.readouterr().err.strip()}")
        assert rc == 0
        text = profile.read_text()
        assert "lora prefill" in text and "lora decode" in text  # (the fit's comment)
        return yaml.safe_load(text)

    def lone_extra_per_token() -> float:
        """What a decode step costs more on the adapter now, per token: lone 48-token greedy
        decodes on the adapter against the base model, interleaved."""
        lone: dict[str, list[float]] = {MODEL: [], STATIC[0]: []}
        with httpx.Client(base_url=lora_server.base_url, timeout=TIMEOUT) as direct:
            for _ in range(5):
                for m, times in lone.items():
                    t0 = time.perf_counter()
                    assert _complete(direct, m, 48).status_code == 200
                    times.append(time.perf_counter() - t0)
        return (statistics.median(lone[STATIC[0]]) - statistics.median(lone[MODEL])) / 47

    # A decode step costs more on an adapter (measured on an idle machine: 2.6 -> 4.1-4.3 ms),
    # a premise measured here again as the server is now. Where it holds, the fit must price
    # it; a fit that did not (seen in CI twice: lora_step = lora_decode = 0 while the lone
    # decodes measured ~80% slower on the adapter — the probes' busy moments, the fit's
    # residuals left to the prefill term) is calibrated again, CALIBRATION_ATTEMPTS in all.
    for attempt in range(1, CALIBRATION_ATTEMPTS + 1):
        entry = calibrate()
        c = entry["batch_time"]["coefficients"]
        assert entry["config"]["max_loras"] == MAX_LORAS
        base_step = c["b0"] + c["b1"]
        priced = c.get("lora_step", 0) + c.get("lora_decode", 0)
        extra = lone_extra_per_token()
        slower = extra > 0.3 * base_step  # (clearly slower on the adapter now)
        if not slower or priced > 0.1 * base_step:
            break
        print(f"calibrate --lora: attempt {attempt}: LoRA decode unpriced ({c}) while the "
              f"adapter measures {extra * 1e3:.2f} ms/token slower")
    if slower:  # (the fit must see it)
        assert priced > 0.1 * base_step, (c, extra)
    else:  # (no clear difference now: the fit must not make one up)
        assert priced < 0.3 * base_step + max(extra, 0.0) * 2, (c, extra)
    out = tmp_path / "val"
    assert main(["validate", lora_server.base_url, "--model", MODEL, "--profile", str(profile),
                 "--out", str(out), "--loads", "0.5", "--requests", "24", "--max-prompt",
                 "512", "--max-output", "32", "--pause", "0.2", "--lora", ",".join(STATIC),
                 "--quiet"]) == 0
    assert "on adapters" in capsys.readouterr().out
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 0
    by = summary["by_adapter"]
    assert by["lora"]["n"] > 0 and by["base"]["n"] > 0
    assert all(math.isfinite(by[k]["median_abs"]) for k in ("lora", "base"))
