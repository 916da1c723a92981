"""The gateway's pool config over the real-vLLM pool of ``conftest.vllm_pool``.

:func:`pool_config` is the one place that describes the two tiny vLLM servers to the gateway:
their batch-time models and request overheads (calibrated by the fixture with ``duetime
calibrate``'s code), their scheduler config (what the servers resolved), their KV-event
publishers, the models' shared tokenizer folder, equal prices and a quality table that prefers ``tiny-large``. Tests change what they
need with ``**overrides``.
"""

from __future__ import annotations

import contextlib
import copy
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

# served model name -> a batch-time model by hand (seconds per engine step), from the measured
# TTFT / ITL of the CPU servers (tiny-small: ~4 ms per step; tiny-large: ~18 ms per decode step,
# ~1.2 s for a 1000-token prefill). Only used for a server the fixture did not calibrate.
BATCH_TIME: dict[str, dict[str, Any]] = {
    "tiny-small": {"model": "paper4",
                   "coefficients": {"b0": 0.004, "b1": 2e-5, "b2": 0.0, "b3": 0.0}},
    "tiny-large": {"model": "paper4",
                   "coefficients": {"b0": 0.015, "b1": 8e-4, "b2": 0.0, "b3": 1e-7}},
}
# instance name in the gateway -> served model name
INSTANCE_NAMES = {"tiny-small": "small", "tiny-large": "large"}
QUALITY = {"tiny-small": 0.5, "tiny-large": 0.8}
PRICE = {"prompt": 0.1, "output": 0.1}  # equal: the quality table alone decides the utility


def instance_config(server: Any, name: str | None = None, **overrides: Any) -> dict[str, Any]:
    """One pool instance for a ``VllmServer`` (its engine settings as the server resolved them)."""
    inst: dict[str, Any] = {
        "name": name or INSTANCE_NAMES.get(server.name, server.name),
        "model": server.name,
        "url": server.base_url,
        "batch_time": copy.deepcopy(server.calibration.get("batch_time")
                                    or BATCH_TIME[server.name]),
        "request_overhead_ms": server.calibration.get("request_overhead_ms", 0.0),
        **({"frontend": dict(server.calibration["frontend"])}
           if server.calibration.get("frontend") else {}),
        "config": {
            "max_num_batched_tokens": server.max_num_batched_tokens,
            "max_num_seqs": server.max_num_seqs,
            "max_model_len": server.max_model_len,
            "block_size": server.block_size,
            "num_gpu_blocks": server.num_gpu_blocks,
            "enable_prefix_caching": server.enable_prefix_caching,
            "long_prefill_token_threshold": 0,
        },
        "price_usd_per_mtok": dict(PRICE),
        # its KV events: the gateway's precise view of its prefix cache
        "kv_events": {"endpoint": server.kv_events, "replay": server.kv_events_replay},
    }
    inst.update(overrides)
    return inst


def pool_config(vllm_pool: Iterable[Any], **overrides: Any) -> dict[str, Any]:
    """The gateway's pool config (the YAML's content) over the vLLM servers: one instance per
    server (``small``, ``large``), policy ``sfs``, quality ``tiny-large`` 0.8 > ``tiny-small``
    0.5 on task ``default``. ``overrides`` replace top-level keys (``instances`` included)."""
    servers = list(vllm_pool)
    cfg: dict[str, Any] = {
        "policy": "sfs",
        # the tiny models share their tokenizer and chat template (same recipe and seed): the
        # prompts' token ids as vLLM makes them
        "tokenizer": str(servers[0].model_dir),
        "retries": 2,
        "quality": {"workload": None, "tasks": {"default": dict(QUALITY)},
                    "default_task": "default"},
        "instances": [instance_config(s) for s in servers],
        "health": {"interval_s": 0.5, "eject_after": 3, "timeout_s": 1.0},
        "timeouts": {"connect_s": 2.0, "first_token_s": 30.0, "read_s": 30.0},
    }
    cfg.update(overrides)
    return cfg


@contextlib.contextmanager
def serve(cfg: dict[str, Any], folder: Path, start_timeout_s: float = 120.0
          ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``duetime serve`` over the pool ``cfg`` in a process of its own (its YAML written in
    ``folder``): yields the process and its URL; stopped with SIGTERM on the way out."""
    path = folder / "pool.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--config", str(path),
                             "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    found: list[str] = []
    seen: list[str] = []

    def read() -> None:  # (reads all its output, so that it never blocks on a full pipe)
        assert proc.stdout is not None
        for line in proc.stdout:
            if not found:
                seen.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    found.append(m.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        t_end = time.monotonic() + start_timeout_s
        while not found and proc.poll() is None and time.monotonic() < t_end:
            time.sleep(0.05)
        if not found:
            raise RuntimeError(f"duetime serve did not start: {''.join(seen)[-2000:]}")
        yield proc, found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
