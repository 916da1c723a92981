"""The desired-replica signal closing the loop: `duetime serve` over emulated instances that
an actuator starts and stops from the signal, under a rate that steps up and back down.

One model (`--profile`, emulated, each replica its own `duetime emulate` process). The pool
config is a file the gateway watches (pool membership while serving); the actuator polls
`GET /duetime/replicas` every second and, when the signal asks for more replicas than the
config holds, starts emulators that listen only after `--delay` seconds (a replica loading
its model: the gateway sees it joining, probing until it answers) and adds them to the
config; when it asks for fewer, it removes the newest from the config (the gateway drains
it) and stops its process once the gateway let it go. Three runs on the same stream:

- `static`: the replicas one replica's capacity says the peak rate needs, fixed;
- `duetime`: the gateway's own autoscaler (pool config `autoscale`, the capacity below);
- `queue-threshold`: the vLLM production stack's KEDA rule (5 waiting per replica), through
  the same signal and actuator.

One replica's capacity (requests/s at 95% on time) is measured first by the simulator on the
stream's own requests (the emulator runs the same engine model). Times are compressed: a
tick every `--interval` s, a `--delay` s scale-up, duetime's `hold_s` and the HPA's
scale-down window a quarter of their defaults (30 s, 75 s); duetime reads the rate over the
same 60 s as by default (`window` = 60 s / interval). The rate rises and falls over `--ramp`
s (0: steps). Prints, per run: on time (and
in the high phase), instance-seconds, and the lags from each rate step to the signal's
change and to the replica count's change; for `duetime`, whether the signal rose before the
on-time rate a monitor sees of the requests since the rise began (their first tokens over
the trailing 20 s) fell below 95%.

    python benchmarks/autoscale_live.py [--low 0.6] [--high 6] [--phase 60,120,90]
        [--ramp 60] [--profile qwen3-8b] [--speed 1] [--delay 15] [--interval 5] [--seed 0]

One run each on a shared 2-core machine: the gateway, up to a handful of emulators and the
client share the cores (the client's CPU time is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from duetime.experiments.capacity import on_time_alone
from duetime.workload import RequestSet, load_workload, sample_requests
from plan_vs_serve import VOCAB, free_port, one_output_per_request

ROOT = Path(__file__).resolve().parent.parent
FLOOR = 0.95
WINDOW_S = 20.0  # the on-time rate a monitor sees: first tokens over the trailing 20 s
WINDOW_RATE_S = 60.0  # duetime's autoscaler reads the rate over 60 s (the default 4 x 15 s)


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen
    started: float
    stopped: float | None = None
    removed: float | None = None


@dataclass
class Trace:
    """What a run saw each second: the signal and the replicas by phase."""

    t: list[float] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    serving: list[int] = field(default_factory=list)


def rate_at(args, t: np.ndarray) -> np.ndarray:
    """The rate (q/s) at ``t``: ``--low`` for the first phase, up to ``--high`` over
    ``--ramp`` s, ``--high`` for the second phase, down over ``--ramp`` s, then ``--low`` for
    the third (``--ramp 0``: steps)."""
    rise, fall = edges(args)
    ramp = max(args.ramp, 1e-9)
    up = np.clip((t - rise) / ramp, 0, 1)
    down = np.clip((t - fall) / ramp, 0, 1)
    return args.low + (args.high - args.low) * (up - down)


def edges(args) -> tuple[float, float]:
    """When the rate starts to rise, and to fall."""
    return args.phase[0], args.phase[0] + args.ramp + args.phase[1]


def stream(args, profile) -> RequestSet:
    """The requests (one model's outputs) at :func:`rate_at`, Poisson (by thinning)."""
    rng = np.random.default_rng([args.seed, 5])
    end = sum(args.phase) + 2 * args.ramp
    t = np.cumsum(rng.exponential(1 / args.high, int(args.high * end * 1.2) + 50))
    t = t[t < end]
    t = t[rng.random(t.size) < rate_at(args, t) / args.high]
    reqs = sample_requests(profile, t, rng)
    return one_output_per_request(reqs, profile.model_names.index(args.profile))


def capacity(profile, model: str, reqs: RequestSet, speed: float, seed: int) -> float:
    """One replica's requests/s at 95% on time on ``reqs``' requests (bisected in the
    simulator at speed 1, then times ``speed``)."""
    lo, hi = 0.05, 20.0
    for _ in range(9):
        mid = (lo * hi) ** 0.5
        if on_time_alone(profile, model, reqs, mid, 4000, seed) >= FLOOR:
            lo = mid
        else:
            hi = mid
    return lo * speed


def pool_config(args, replicas: list[Replica], autoscale: dict) -> dict:
    return {
        "policy": "sfs",
        "quality": {"workload": "paper"},
        "health": {"interval_s": 0.5, "timeout_s": 0.5},
        "discovery": {"watch_s": 0.25},
        "instances": [{"name": r.name, "model": args.profile, "profile": args.profile,
                       "speed": args.speed, "url": f"http://127.0.0.1:{r.port}"}
                      for r in replicas if r.removed is None],
        "autoscale": {"interval_s": args.interval, "scale_up_delay_s": args.delay,
                      "max_replicas": args.max_replicas, **autoscale},
    }


class Actuator:
    """Starts and stops emulators from the signal, through the watched pool config."""

    def __init__(self, args, path: Path, autoscale: dict, gateway: str) -> None:
        self.args, self.path, self.autoscale, self.url = args, path, autoscale, gateway
        self.replicas: list[Replica] = []
        self.trace = Trace()
        self._k = 0

    def start_replica(self, delay: float) -> None:
        port, name = free_port(), f"{self.args.profile}.{self._k}"
        cmd = (f"sleep {delay} && exec {sys.executable} -m duetime emulate --profile "
               f"{self.args.profile} --port {port} --speed {self.args.speed} --seed {self._k} "
               f"--log-level error")
        proc = subprocess.Popen(["sh", "-c", cmd], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.replicas.append(Replica(name, port, proc, time.monotonic()))
        self._k += 1

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(pool_config(self.args, self.replicas, self.autoscale)))
        tmp.replace(self.path)

    @property
    def provisioned(self) -> list[Replica]:
        return [r for r in self.replicas if r.removed is None]

    async def loop(self, c: aiohttp.ClientSession, t0: float, follow: bool) -> None:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with c.get(f"{self.url}/duetime/replicas") as r:
                    last = (await r.json())["last"]
                async with c.get(f"{self.url}/duetime/instances") as r:
                    phases = (await r.json())["membership"]["phases"]
                want = len(self.provisioned) if last is None else int(
                    last["desired"][self.args.profile])
                self.trace.t.append(time.monotonic() - t0)
                self.trace.desired.append(want)
                self.trace.serving.append(len(phases.get("serving", [])))
                members = {n for p in phases.values() for n in p}
                for r in self.replicas:  # drained and let go: stop its process
                    if r.removed is not None and r.stopped is None and r.name not in members:
                        self.stop(r)
                if not follow:
                    continue
                have = self.provisioned
                if want > len(have):
                    for _ in range(want - len(have)):
                        self.start_replica(self.args.delay)
                    self.write()
                elif want < len(have):
                    for r in have[::-1][:len(have) - want]:
                        r.removed = time.monotonic()
                    self.write()

    def stop(self, r: Replica) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(10)
        r.stopped = time.monotonic()

    def instance_seconds(self, end: float) -> float:
        return sum((r.stopped or end) - r.started for r in self.replicas)


async def send(c: aiohttp.ClientSession, url: str, prompt: list[int], out: int,
               target_ms: float) -> float:
    body = {"model": "auto", "prompt": prompt, "max_tokens": int(out), "ignore_eos": True,
            "stream": True}
    t0 = time.monotonic()
    first = math.inf
    with contextlib.suppress(aiohttp.ClientError):
        async with c.post(f"{url}/v1/completions", json=body,
                          headers={"x-duetime-ttft-ms": f"{target_ms:.3f}"}) as r:
            if r.status != 200:
                return math.inf
            async for line in r.content:
                if first == math.inf and line.startswith(b"data: {"):
                    first = time.monotonic() - t0
    return first


async def one_run(args, name: str, reqs: RequestSet, start: int, autoscale: dict
                  ) -> dict:
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pool.yaml"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        act = Actuator(args, path, autoscale, url)
        for _ in range(start):
            act.start_replica(0)
        act.write()
        gw = subprocess.Popen([sys.executable, "-m", "duetime", "serve", "--config", str(path),
                               "--port", str(port), "--log-level", "error"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=600)) as c:
                await _healthy(c, url, start)
                t0 = time.monotonic()
                looping = asyncio.create_task(act.loop(c, t0, follow=name != "static"))
                jobs = []
                for i in range(len(reqs.arrival)):
                    delay = reqs.arrival[i] - (time.monotonic() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    prompt = rng.integers(1, VOCAB, int(reqs.prompt[i])).tolist()
                    jobs.append(asyncio.create_task(send(
                        c, url, prompt, int(reqs.output[i, 0]), float(reqs.target[i]) * 1000)))
                ttft = np.array(await asyncio.gather(*jobs))
                await asyncio.sleep(max(0.0, args.tail))  # (the scale-down after the load)
                looping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await looping
                end = time.monotonic()
        finally:
            gw.terminate()
            gw.wait(30)
            for r in act.replicas:
                if r.stopped is None:
                    act.stop(r)
        return {"name": name, "ttft": ttft, "trace": act.trace,
                "instance_s": act.instance_seconds(end), "wall_s": end - t0}


async def _healthy(c: aiohttp.ClientSession, url: str, n: int) -> None:
    for _ in range(1200):
        with contextlib.suppress(aiohttp.ClientError):
            async with c.get(f"{url}/duetime/instances") as r:
                if r.status == 200:
                    serving = (await r.json())["membership"]["phases"].get("serving", [])
                    if len(serving) >= n:
                        return
        await asyncio.sleep(0.1)
    raise SystemExit("the gateway or its emulators did not come up")


def lag(trace: Trace, at: float, rising: bool, what: str) -> float | None:
    """Seconds from ``at`` to the first second the trace's ``what`` moved that way."""
    xs = getattr(trace, what)
    before = next((x for t, x in zip(trace.t, xs, strict=True) if t >= at), None)
    if before is None:
        return None
    for t, x in zip(trace.t, xs, strict=True):
        if t > at and ((x > before) if rising else (x < before)):
            return t - at
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--low", type=float, default=0.6)
    ap.add_argument("--high", type=float, default=6.0)
    ap.add_argument("--phase", default="60,120,90",
                    help="seconds at the low, high and low rates")
    ap.add_argument("--ramp", type=float, default=60.0,
                    help="seconds the rate takes to rise and to fall (0: steps)")
    ap.add_argument("--profile", default="qwen3-8b")
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--delay", type=float, default=15.0)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--max-replicas", type=int, default=8)
    ap.add_argument("--tail", type=float, default=20.0,
                    help="seconds the loop runs after the last request")
    ap.add_argument("--runs", default="static,duetime,queue-threshold")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.phase = [float(x) for x in args.phase.split(",")]
    paper = load_workload("paper")
    reqs = stream(args, paper)
    cap = capacity(paper, args.profile, reqs, args.speed, args.seed)
    peak = max(1, math.ceil(args.high / (cap * 0.85)))
    low = max(1, math.ceil(args.low / (cap * 0.85)))
    print(f"{len(reqs.arrival)} requests: {args.low:g} q/s for {args.phase[0]:g} s, "
          f"{args.high:g} for {args.phase[1]:g} s, {args.low:g} for {args.phase[2]:g} s, "
          f"{args.ramp:g} s ramps; "
          f"one {args.profile} replica (speed {args.speed:g}): {cap:.2f} q/s at 95% on time "
          f"(simulated); static pool {peak}; {os.cpu_count()} CPUs", file=sys.stderr)
    settings = {
        "static": (peak, {"autoscaler": "static"}),
        "duetime": (low, {"autoscaler": "duetime", "capacity": {args.profile: cap},
                          "params": {"hold_s": 30,
                                     "window": max(1, round(WINDOW_RATE_S / args.interval))}}),
        "queue-threshold": (low, {"autoscaler": "queue-threshold",
                                  "params": {"scale_down_stabilization_s": 75}}),
    }
    up, down = edges(args)
    high = (reqs.arrival >= up + args.ramp) & (reqs.arrival < down)
    rows, out = [], {}
    for name in args.runs.split(","):
        cpu0 = time.process_time()
        got = asyncio.run(one_run(args, name, reqs, *settings[name]))
        hit = got["ttft"] <= reqs.target
        tr = got["trace"]
        row = {"run": name, "on_time": float(hit.mean()), "on_time_high": float(hit[high].mean()),
               "instance_s": got["instance_s"], "most": max(tr.serving, default=0),
               "signal_up_s": lag(tr, up, True, "desired"),
               "serving_up_s": lag(tr, up, True, "serving"),
               "signal_down_s": lag(tr, down, False, "desired"),
               "serving_down_s": lag(tr, down, False, "serving"),
               "client_cpu_s": time.process_time() - cpu0}
        if name == "duetime":
            row["signal_before_late"] = _before_late(reqs, got["ttft"], tr, up)
        rows.append(row)
        out[name] = row
        print(f"{name}: {json.dumps({k: _r(v) for k, v in row.items()})}", file=sys.stderr)
    print("\n| run | on time | on time, high phase | instance-s | most serving | signal up (s) "
          "| serving up (s) | signal down (s) | serving down (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['on_time']:.3f} | {r['on_time_high']:.3f} | "
              f"{r['instance_s']:.0f} | {r['most']} | {_f(r['signal_up_s'])} | "
              f"{_f(r['serving_up_s'])} | {_f(r['signal_down_s'])} | "
              f"{_f(r['serving_down_s'])} |")
    if "static" in out and "duetime" in out:
        s, d = out["static"], out["duetime"]
        summary = {"duetime_on_time_minus_static_points": 100 * (d["on_time"] - s["on_time"]),
                   "duetime_instance_seconds_vs_static": d["instance_s"] / s["instance_s"],
                   "signal_before_late": d.get("signal_before_late")}
        if "queue-threshold" in out:
            q = out["queue-threshold"]
            summary["queue_threshold_on_time_minus_static_points"] = 100 * (
                q["on_time"] - s["on_time"])
            summary["queue_threshold_instance_seconds_vs_static"] = q["instance_s"] / s[
                "instance_s"]
        print(json.dumps({k: _r(v) for k, v in summary.items()}))


def _before_late(reqs: RequestSet, ttft: np.ndarray, tr: Trace, up: float) -> dict:
    """When the signal first rose after the rate began to rise, and when the on-time rate a
    monitor sees of the requests that came since (their first tokens in the trailing
    ``WINDOW_S``, at least 5) first fell below the floor (None: never)."""
    rose = lag(tr, up, True, "desired")
    seen = reqs.arrival + np.where(np.isfinite(ttft), ttft, reqs.target)  # (late: at target)
    hit = ttft <= reqs.target
    since = reqs.arrival >= up
    late = None
    for t in np.arange(up, seen.max(), 1.0):
        sel = since & (seen > t - WINDOW_S) & (seen <= t)
        if sel.sum() >= 5 and hit[sel].mean() < FLOOR:
            late = float(t - up)
            break
    return {"signal_rose_s": rose, "on_time_fell_s": late,
            "before": rose is not None and (late is None or rose <= late)}


def _r(v):
    return round(v, 4) if isinstance(v, float) else v


def _f(v) -> str:
    return "—" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    main()
