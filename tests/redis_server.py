"""A real ``redis-server`` for the tests: started on a free loopback port in a temporary
folder, nothing saved to disk; stopped, paused or restarted (same port) by the tests that check
how the gateway degrades. ``scripts/system_deps.sh`` (the README's test command runs it)
installs the server where it is missing."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process; ``url`` stays the same across :meth:`stop` and :meth:`start`."""

    def __init__(self, folder: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:  # (a failure, not a skip: the suite must run against a real Redis)
            pytest.fail("redis-server is not installed: run `bash scripts/system_deps.sh`")
        self.exe = exe
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder), "--protected-mode", "yes",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited at start ({self.proc.returncode})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        pytest.fail("redis-server did not answer within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """Freeze the server (it holds its connections and answers nothing): Redis slow."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def flush(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), 2.0) as s:
            s.sendall(b"FLUSHALL\r\n")
            assert s.recv(16).startswith(b"+OK")

