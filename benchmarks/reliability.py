"""Does the gateway lose anything? Real processes on loopback: three `duetime emulate`
instances (with injected faults where the scenario says), `duetime serve --config` over them,
and clients here; per scenario, how many requests succeeded and how many were lost.

    python benchmarks/reliability.py [--quick] [--scenarios open,closed,kill,churn,burst,soak,sigterm]
        [--requests 1000] [--rate 100] [--clients 16] [--fail-rate 0.2] [--soak-s 30]

Scenarios: ``open`` (Poisson arrivals at --rate, 20% faults: 5xx, timeouts, disconnects and
streams broken after three tokens, on every instance), ``closed`` (--clients clients back to
back, the same faults), ``kill`` (no faults, 64-token answers; one instance killed a third of
the way and restarted on its port two seconds later), ``churn`` (--clients clients asking for
qwen3-8b, 64-token answers, no faults, while the pool config file changes every --churn-s seconds, eight times:
instances added and removed among five emulators, one killed and restarted; as many requests
as that takes; a line after the table
says how soon each instance that became ready served, and how many requests sent after an
instance's drain it still served), ``burst`` (500 streams at once), ``soak`` (--rate for --soak-s seconds; the gateway's memory
before and after), ``sigterm`` (streams open when the gateway gets SIGTERM: each must finish
within the drain timeout or end with an error event).

Half the requests stream. Prints one row per scenario: requests, succeeded, lost (retryable
failures that reached the client: a 5xx or 429, or a stream that ended with an error event
before any of its answer), streams that broke mid-answer and ended with an error event (the
gateway continues a broken stream on another instance of the model, or on the same one: these
are the ones it could not), streams the gateway continued mid-answer on another instance (its
``duetime_stream_breaks_total{outcome="continued"}``), streams cut (no ``[DONE]`` and no error
event), other failures, the gateway's RSS before and after (MB), and the gateway's exit code
where the scenario stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KINDS = "5xx,timeout,disconnect,break"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mb(x: float) -> str:
    """A table cell for an RSS: "–" where the process had exited."""
    return "–" if math.isnan(x) else f"{x:.0f}"


def rss_mb(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def wait_up(url: str, timeout_s: float = 60.0) -> None:
    t_end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as c:
        while time.monotonic() < t_end:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout_s} s")


PROFILES = ("qwen3-0.6b", "qwen3-8b", "qwen3-8b", "qwen3-8b", "qwen3-8b")


@dataclass
class Cluster:
    """Emulators (``size``; the pool config lists the first three) and a gateway, each its
    own process."""

    fail_rate: float = 0.0
    speed: float = 20.0
    drain_timeout_s: float = 5.0
    size: int = 3
    ports: list[int] = field(default_factory=list)
    gateway_port: int = field(default_factory=free_port)
    emulators: list[subprocess.Popen | None] = field(default_factory=list)
    gateway: subprocess.Popen | None = None
    tmp: tempfile.TemporaryDirectory | None = None

    def __post_init__(self) -> None:
        self.ports = self.ports or [free_port() for _ in range(self.size)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def config(self) -> Path:
        assert self.tmp is not None
        return Path(self.tmp.name) / "pool.yaml"

    def pool(self, members: list[int]) -> dict:
        """The pool config listing the emulators ``members``."""
        return {
            "policy": "sfs",
            "instances": [{"name": f"i{k}", "model": PROFILES[k], "profile": PROFILES[k],
                           "speed": self.speed, "url": f"http://127.0.0.1:{self.ports[k]}"}
                          for k in members],
            # an injected timeout never answers: retried after 1.5 s without a first token
            "timeouts": {"connect_s": 1.0, "first_token_s": 1.5, "read_s": 10.0},
            # with 20% independent faults, 6 attempts (the default 5 retries) all fail for
            # one request in 0.2^6 = 1 in 15,600: a 150-request run lost one about 1% of the
            # time; 9 attempts make it 1 in 2 million
            "retries": 8,
            "health": {"interval_s": 0.25},
            "discovery": {"watch_s": 0.2},
        }

    def write_pool(self, members: list[int]) -> None:
        """Replace the pool config (whole: the gateway never reads half a file)."""
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.pool(members)))
        os.replace(tmp, self.config)

    def _emulator(self, k: int) -> subprocess.Popen:
        profile = PROFILES[k]
        cmd = [sys.executable, "-m", "duetime", "emulate", "--profile", profile,
               "--port", str(self.ports[k]), "--speed", str(self.speed), "--seed", str(k),
               "--model-name", profile, "--log-level", "error"]
        if self.fail_rate > 0:
            cmd += ["--fail-rate", str(self.fail_rate), "--fail-kinds", KINDS]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    async def start(self) -> Cluster:
        self.tmp = tempfile.TemporaryDirectory()
        cfg = self.config
        self.write_pool([0, 1, 2])
        self.emulators = [self._emulator(k) for k in range(self.size)]
        for p in self.ports:
            await wait_up(f"http://127.0.0.1:{p}")
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "duetime", "serve", "--config", str(cfg), "--port",
             str(self.gateway_port), "--drain-timeout", str(self.drain_timeout_s),
             "--log-level", "error"], cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        await wait_up(self.url)
        return self

    def kill(self, k: int) -> None:
        p = self.emulators[k]
        if p is not None:
            p.kill()
            p.wait()
        self.emulators[k] = None

    async def restart(self, k: int) -> None:
        self.emulators[k] = self._emulator(k)
        await wait_up(f"http://127.0.0.1:{self.ports[k]}")

    async def stop(self) -> int | None:
        code = None
        if self.gateway is not None:
            if self.gateway.poll() is None:
                self.gateway.send_signal(signal.SIGTERM)
            try:
                code = self.gateway.wait(self.drain_timeout_s + 20)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                code = self.gateway.wait()
        for k in range(len(self.emulators)):
            self.kill(k)
        if self.tmp is not None:
            self.tmp.cleanup()
        return code


@dataclass
class Tally:
    requests: int = 0
    succeeded: int = 0
    lost: int = 0          # retryable failures that reached the client
    broken: int = 0        # streams that broke mid-answer and ended with an error event
    cut: int = 0           # streams without [DONE] and without an error event
    other: int = 0         # anything else (4xx, transport errors)
    continued: float = math.nan  # streams the gateway continued on another instance
    notes: list[str] = field(default_factory=list)
    # per answer: (wall time sent, wall time its headers came, the instance that served it)
    served: list[tuple[float, float, str]] = field(default_factory=list)
    churn: dict = field(default_factory=dict)  # the churn scenario's findings

    def row(self, name: str, rss: tuple[float, float], code: int | None) -> str:
        cont = "–" if math.isnan(self.continued) else f"{self.continued:.0f}"
        return (f"| {name} | {self.requests} | {self.succeeded} | {self.lost} | "
                f"{self.broken} | {cont} | {self.cut} | "
                f"{self.other} | {mb(rss[0])} → {mb(rss[1])} | "
                f"{'' if code is None else code} |")


def body(k: int, max_tokens: int = 16, model: str = "auto") -> tuple[dict, bool]:
    stream = k % 2 == 1
    return ({"model": model, "max_tokens": max_tokens, "stream": stream,
             "messages": [{"role": "user", "content": f"question {k}: " + "word " * (k % 50)}]},
            stream)


async def one(c: httpx.AsyncClient, k: int, tally: Tally, max_tokens: int = 16,
              model: str = "auto") -> None:
    """One request; its fate counted."""
    payload, stream = body(k, max_tokens, model)
    tally.requests += 1
    sent = time.time()
    try:
        if not stream:
            r = await c.post("/v1/chat/completions", json=payload)
            if r.status_code == 200:
                tally.served.append((sent, time.time(), r.headers["x-duetime-instance"]))
            if r.status_code == 200 and r.json()["choices"][0]["message"] is not None:
                tally.succeeded += 1
            elif r.status_code >= 500 or r.status_code == 429:
                tally.lost += 1
                tally.notes.append(f"{r.status_code} {r.text[:120]}")
            else:
                tally.other += 1
                tally.notes.append(f"{r.status_code} {r.text[:120]}")
            return
        async with c.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code == 200:
                tally.served.append((sent, time.time(), r.headers["x-duetime-instance"]))
            if r.status_code != 200:
                await r.aread()
                if r.status_code >= 500 or r.status_code == 429:
                    tally.lost += 1
                else:
                    tally.other += 1
                tally.notes.append(f"{r.status_code} {r.text[:120]}")
                return
            last = ""
            content = False  # (a chunk before the last: the client had part of an answer)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    content = content or bool(last)
                    last = line[6:]
            if last == "[DONE]":
                tally.succeeded += 1
            elif '"error"' in last:
                if content:  # broke mid-answer: nothing to retry, the client was told
                    tally.broken += 1
                else:
                    tally.lost += 1
                tally.notes.append(f"stream error event: {last[:120]}")
            else:
                tally.cut += 1
                tally.notes.append(f"stream cut after: {last[:80]}")
    except httpx.HTTPError as e:
        tally.other += 1
        tally.notes.append(f"{type(e).__name__}: {e}")


def client(url: str, connections: int = 600) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0),
                             limits=httpx.Limits(max_connections=connections,
                                                 max_keepalive_connections=connections))


async def open_loop(url: str, n: int, rate: float, tally: Tally, seed: int = 0,
                    during=None) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    async with client(url) as c:
        tasks = []
        for k in range(n):
            tasks.append(asyncio.create_task(one(c, k, tally)))
            if during is not None and k == n // 3:
                tasks.append(asyncio.create_task(during()))
            await asyncio.sleep(float(gaps[k]))
        await asyncio.gather(*tasks)


async def closed_loop(url: str, n: int, clients: int, tally: Tally, during=None,
                      max_tokens: int = 16, until: asyncio.Event | None = None,
                      model: str = "auto") -> None:
    """``n`` requests from ``clients`` clients back to back (``until``: or until it is set,
    however many that is), for ``model``."""
    counter = iter(range(n) if until is None else itertools.count())
    side: list[asyncio.Task] = []

    async def worker(c: httpx.AsyncClient) -> None:
        for k in counter:
            if until is not None and until.is_set():
                return
            if during is not None and k == n // 3:
                side.append(asyncio.create_task(during()))
            await one(c, k, tally, max_tokens, model)

    async with client(url, clients * 2) as c:
        await asyncio.gather(*(worker(c) for _ in range(clients)))
    await asyncio.gather(*side)


async def continued_streams(url: str) -> float:
    """How many broken streams the gateway continued elsewhere (its Prometheus counter)."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as c:
        text = (await c.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith('duetime_stream_breaks_total{outcome="continued"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# the churn scenario's pools, in turn (i0 serves qwen3-0.6b throughout; the others qwen3-8b)
CHURN = ([0, 1, 2, 3], [0, 2, 3], [0, 2, 3, 4], [0, 3, 4], [0, 1, 3, 4], [0, 1, 4],
         [0, 1, 2, 4], [0, 1, 2])


async def churn(cl: Cluster, done: asyncio.Event, every_s: float,
                changes: dict[tuple[float, str, str], None]) -> None:
    """Change the pool config every ``every_s`` (each pool of :data:`CHURN` in turn), kill
    i3 after the third change and restart it 2 s later; then wait ``every_s`` more (the last
    changes settle) and set ``done``. ``changes``: the gateway's membership changes seen
    (polled from /duetime/instances)."""
    async def watch() -> None:
        async with httpx.AsyncClient(base_url=cl.url, timeout=10.0) as c:
            while True:
                body = (await c.get("/duetime/instances")).json()
                for x in body["membership"]["recent"]:
                    changes[(x["t"], x["change"], x["instance"])] = None
                if done.is_set():
                    return
                await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    for step, members in enumerate(CHURN, 1):
        await asyncio.sleep(every_s)
        cl.write_pool(members)
        if step == 3:  # (i3 serves the clients' model then: its streams break mid-answer)
            cl.kill(3)
            await asyncio.sleep(2.0)
            await cl.restart(3)
    await asyncio.sleep(every_s)
    done.set()
    await watcher


def churn_report(tally: Tally, changes: dict[tuple[float, str, str], None]) -> str:
    """How soon each instance that became ready got an answer to send (an upper bound on its
    first request: the answer's headers come after its first token), and how many requests
    sent after an instance's drain it answered while out of the pool (must be none)."""
    events = sorted(changes)
    firsts, late = [], 0
    for t, change, name in events:
        if change == "ready":
            after = [h for sent, h, i in tally.served if i == name and h >= t]
            firsts.append(min(after) - t if after else math.inf)
            tally.notes.append(f"    {name} ready at {t:.2f}: first answer after "
                               f"{firsts[-1]:.2f} s")
        elif change == "drain":
            # (until it is back: a request sent just before its return may be routed to it
            # once it is ready again, so answers from then on are not counted)
            back = [u for u, c, n in events if n == name and c == "ready" and u > t]
            until = min(back, default=math.inf)
            bad = [(sent, h) for sent, h, i in tally.served
                   if i == name and t < sent < until and h < until]
            late += len(bad)
            for sent, h in bad[:3]:
                tally.notes.append(f"    {name} drained at {t:.3f}: a request sent at "
                                   f"{sent:.3f} was answered by it at {h:.3f}")
    counts = {c: sum(1 for _, x, _ in events if x == c) for c in
              ("join", "ready", "drain", "leave")}
    tally.churn = {"changes": counts, "first_answer_s": firsts, "served_after_drain": late}
    f = np.array(firsts)
    return (f"churn: {counts['join']} joins, {counts['ready']} ready, {counts['drain']} drains, "
            f"{counts['leave']} leaves; first answer from a ready instance after "
            f"{np.median(f):.2f} s median, {f.max():.2f} s max; requests sent after a drain "
            f"and served by the drained instance: {late}" if len(f) else
            f"churn: no instance became ready ({counts})")


async def scenario(name: str, args: argparse.Namespace) -> tuple[str, Tally]:
    faults = args.fail_rate if name in ("open", "closed") else 0.0
    speed = 2.0 if name == "sigterm" else 20.0
    cl = await Cluster(fail_rate=faults, speed=speed, drain_timeout_s=args.drain_timeout,
                       size=5 if name == "churn" else 3).start()
    tally = Tally()
    code = None
    try:
        pid = cl.gateway.pid
        before = rss_mb(pid)
        if name == "open":
            await open_loop(cl.url, args.requests, args.rate, tally)
        elif name == "closed":
            await closed_loop(cl.url, args.requests, args.clients, tally)
        elif name == "kill":
            async def kill_and_restart() -> None:
                cl.kill(1)
                await asyncio.sleep(2.0)
                await cl.restart(1)
            # (64-token answers: streams are mid-answer on the instance when it dies)
            await closed_loop(cl.url, args.requests, args.clients, tally,
                              during=kill_and_restart, max_tokens=64)
        elif name == "churn":
            done = asyncio.Event()
            changes: dict[tuple[float, str, str], None] = {}
            changing = asyncio.create_task(churn(cl, done, args.churn_s, changes))
            try:
                # (for the model whose instances come and go: with ``auto`` sfs sends most
                # requests to i0, and a new qwen3-8b instance waits for overflow)
                await closed_loop(cl.url, args.requests, args.clients, tally, max_tokens=64,
                                  until=done, model="qwen3-8b")
            finally:
                done.set()
                await changing
            tally.notes.insert(0, churn_report(tally, changes))
        elif name == "burst":
            async with client(cl.url, 600) as c:
                await asyncio.gather(*(one(c, 2 * k + 1, tally) for k in range(args.burst)))
        elif name == "soak":
            await open_loop(cl.url, int(args.rate * args.soak_s), args.rate, tally)
        elif name == "sigterm":
            async with client(cl.url) as c:
                streams = [asyncio.create_task(one(c, 2 * k + 1, tally, max_tokens=400))
                           for k in range(args.clients)]
                await asyncio.sleep(1.0)  # (all of them streaming)
                cl.gateway.send_signal(signal.SIGTERM)
                await asyncio.gather(*streams)
                code = cl.gateway.wait(args.drain_timeout + 20)
        after = rss_mb(pid) if cl.gateway.poll() is None else float("nan")
        if cl.gateway.poll() is None:
            tally.continued = await continued_streams(cl.url)
    finally:
        stopped = await cl.stop()
        code = code if code is not None else (stopped if name == "sigterm" else None)
    return tally.row(name, (before, after), code), tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default="open,closed,kill,churn,burst,soak,sigterm")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--fail-rate", type=float, default=0.2)
    ap.add_argument("--soak-s", type=float, default=30.0)
    ap.add_argument("--drain-timeout", type=float, default=5.0)
    ap.add_argument("--churn-s", type=float, default=2.0,
                    help="churn: the pool config changes this often (default 2 s)")
    ap.add_argument("--quick", action="store_true",
                    help="200 requests, a burst of 100, a 5 s soak")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.burst, args.soak_s = 200, 100, 5.0
    print("| scenario | requests | succeeded | lost | broke mid-stream (error event) | "
          "continued mid-stream | streams cut | other | gateway RSS (MB) | exit code |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.scenarios.split(","):
        row, tally = asyncio.run(scenario(name, args))
        print(row, flush=True)
        for note in tally.notes[:10]:
            print(f"    {note}", file=sys.stderr if not note.startswith("churn:") else
                  sys.stdout)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
