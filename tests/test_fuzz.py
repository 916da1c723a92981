"""Fuzzing the gateway from its own /openapi.json with schemathesis: whatever it is sent
(generated from the documented schemas, valid and invalid), it never answers >= 500, and every
error it answers is an OpenAI error body. `duetime serve` over its demo pool, a subprocess on a
loopback port; a bounded number of examples per route."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

EXAMPLES = int(os.environ.get("DUETIME_FUZZ_EXAMPLES", "40"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--port", str(port),
                             "--speed", "20", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 90
        while time.monotonic() < t_end:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("duetime serve did not come up within 90 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_no_answer_is_a_server_error(served: str, tmp_path) -> None:
    """schemathesis's own runner (its coverage, fuzzing and stateful phases) with the
    ``not_a_server_error`` check; a failure prints its cases and how to replay them."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", served + "/openapi.json",
           "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES),
           "--request-timeout", "30", "--seed", "1"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "passed" in out.stdout
