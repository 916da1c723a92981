"""A real DNS server for the tests: Debian's ``dnsmasq`` on a free loopback UDP port, answering
only from a hosts file the test writes (no upstream, no /etc/hosts; the ``.test`` zone is its
own, so a missing record is an empty answer, as a cluster DNS gives); :meth:`DnsServer.set`
rewrites the file and sends SIGHUP (dnsmasq re-reads it). ``scripts/system_deps.sh`` (the
README's test command runs it) installs ``dnsmasq-base`` where it is missing."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_udp_port() -> int:
    """A loopback port free for UDP and for TCP both (dnsmasq listens on both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


def _query(port: int) -> bytes:
    """A DNS query for ``ready.test`` A (the header, one question)."""
    name = b"".join(bytes([len(p)]) + p for p in (b"ready", b"test")) + b"\0"
    return b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + name + b"\x00\x01\x00\x01"


class DnsServer:
    """One dnsmasq; ``address``: ``127.0.0.1:PORT`` (for ``discovery.dns_servers``)."""

    def __init__(self, folder: Path) -> None:
        exe = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.access(
            "/usr/sbin/dnsmasq", os.X_OK) else None)
        if exe is None:  # (a failure, not a skip: the suite runs against a real DNS server)
            pytest.fail("dnsmasq is not installed: run `bash scripts/system_deps.sh`")
        self.exe = exe
        self.hosts = folder / "hosts"
        self.hosts.write_text("")
        self.pid_file = folder / "dnsmasq.pid"
        self.log = folder / "dnsmasq.log"
        self.port = free_udp_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = False  # (once: its address is out)

    def start(self, tries: int = 3) -> None:
        """Start it and wait for an answer. At its first start a port taken meanwhile by
        another process (the suite's servers bind ports all the time) means another free
        port, ``tries`` times; a restart keeps its address (what the gateway was given)."""
        tries = tries if not self.started else 1
        for attempt in range(1, tries + 1):
            if self._start(last=attempt == tries):
                self.started = True
                return
            self.port = free_udp_port()
            self.address = f"127.0.0.1:{self.port}"

    def _start(self, last: bool) -> bool:
        self.proc = subprocess.Popen(
            [self.exe, "--keep-in-foreground", f"--port={self.port}",
             "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
             "--local=/test/",  # (the zone is its own: no record is NODATA, not REFUSED)
             f"--addn-hosts={self.hosts}", f"--pid-file={self.pid_file}",
             f"--user={getpass.getuser()}", "--local-ttl=0", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        deadline = time.monotonic() + 10.0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    err = self.log.read_text(errors="replace")
                    if "Address already in use" in err and not last:
                        return False
                    pytest.fail(f"dnsmasq exited at start ({self.proc.returncode}): {err}")
                try:
                    s.sendto(_query(self.port), ("127.0.0.1", self.port))
                    s.recv(512)
                    return True
                except OSError:
                    time.sleep(0.05)
        pytest.fail("dnsmasq did not answer within 10 s")

    def set(self, name: str, addresses: list[str]) -> None:
        """``name`` resolves to ``addresses`` from now on."""
        self.hosts.write_text("".join(f"{a} {name}\n" for a in addresses))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self.proc = None
