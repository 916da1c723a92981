"""Is the admission queue fair to a light key when a heavy one floods the pool? (issue 36)

One key (``light``) sends critical requests at ``--light-load`` of the pool's capacity; another
(``heavy``) sends ``--ratio`` (10) times as many. Each runs ``--seconds`` of Poisson arrivals,
``--seeds`` times; the light key also runs alone (same arrivals, no heavy key). Printed per
order and mix: each key's requests, the share that queued, the share turned away by a full
queue (or displaced from it), p50 / p90 time in the gateway's queue over all its requests (0
for one that never queued) and p90 over those that queued, and the share that missed the TTFT
target; then the light key's p90 with the heavy key over its p90 alone (the issue's target:
at most 1.5x).

Two orders are compared: ``fair`` — :class:`duetime.sim.admission.SimAdmission`, the shared
:class:`~duetime.policy.admission_order.AdmissionOrder` the gateway's queue runs (bands, least
attained service across keys, EDF within a key; a newcomer to a full queue displaces a more
served key's latest waiter) — and ``round-robin``, the queue before issue 36 (clients in turn,
each in arrival order, a full queue turning newcomers away), rebuilt here.

This is a discrete-event model, not the gateway in-process: a saturated pool at ten times a
key's rate would need hundreds of requests a second through the real gateway and its
emulators for minutes, which two shared cores cannot give reliably, and the queue's order is
the same code either way. The model keeps the gateway's rules: a request whose best forecast
meets its target goes at once; else it waits in the queue (at most ``--max-queued``) until
released or until its target is spent, and then goes to the pool anyway (late); each first
token and each request's end releases one waiter, which is decided again; a served prompt
(at its first token) and output (at its end) feed the key's attained service. The pool is
``--slots`` requests served at a time with a FIFO of those sent beyond them (the instances'
own queues); a request's forecast is the wait for a slot (the earliest running request's end,
plus the FIFO ahead at the mean service time per slot) plus its prefill. Requests draw prompts
and outputs from log-normal lengths; prefill runs at 10,000 tokens/s, decode at 50 tokens/s.

    python benchmarks/admission_fairness.py [--seconds 300] [--seeds 3] [--light-load 0.95]
        [--sweep 0.3,0.5,0.8,0.95] [--ratio 10] [--slots 8] [--target-ms 500]
        [--max-queued 256] [--live] [--live-seconds 45]

``--live`` adds a check on the real gateway, in-process (``duetime serve``'s
:class:`~duetime.service.Service`: the gateway and one embedded emulated instance, Qwen3 0.6B
timing slowed to ``--live-speed`` with ``max_num_seqs`` 8, outputs of median 24 tokens), the
two keys sending critical chat requests at ``--live-light-rate`` (near what the instance serves
on time: the light key alone queues now and then) and ``--ratio`` times that, with a TTFT
target of ``--live-target-ms``; first the light key alone, then both, ``--live-seconds`` each
(the new order only: the round robin is gone from the gateway). Each request's time in the
queue is measured around the gateway's own ``AdmissionQueue.wait`` (0 for one that never
waited). The requests still at the instance when a window ends are cancelled (the heavy key's
backlog would take minutes to drain). On a machine shared with other work its numbers move
from run to run; the model's are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import tempfile
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from duetime.sim.admission import SimAdmission, Waited

if TYPE_CHECKING:
    from duetime.gateway.intake.admission import AdmissionQueue

PREFILL_TPS = 10_000.0
DECODE_TPS = 50.0


@dataclass(slots=True)
class Req:
    i: int
    key: str
    arrival: float
    prompt: int
    output: int
    prefill_s: float
    service_s: float
    waited: bool = False
    gave_up: bool = False      # a wait ended unreleased (target spent, full, displaced)
    turned_away: bool = False
    late: bool = False
    rejected: bool = False     # refused once it gave up (``--expired reject``)


class RoundRobin:
    """The queue before issue 36: clients in turn (each in arrival order); a full queue turns
    a newcomer away. The same calls as :class:`SimAdmission`."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.by_key: OrderedDict[str, deque[int]] = OrderedDict()
        self.since: dict[int, tuple[str, float, float]] = {}  # i -> (key, queued at, give up)
        self.waits: list[Waited] = []

    def __len__(self) -> int:
        return len(self.since)

    def offer(self, i: int, key: str, priority: str, deadline_abs: float, give_up_at: float,
              now: float) -> bool:
        if len(self.since) >= self.max_queued or give_up_at <= now:
            return False
        self.by_key.setdefault(key, deque()).append(i)
        self.since[i] = (key, now, give_up_at)
        return True

    def _end(self, i: int, now: float, how: str) -> None:
        key, since, _ = self.since.pop(i)
        q = self.by_key[key]
        q.remove(i)
        if not q:
            del self.by_key[key]
        self.waits.append(Waited(i, key, now - since, how))

    def release(self, now: float, n: int = 1) -> list[int]:
        out = []
        while len(out) < n and self.by_key:
            key, q = next(iter(self.by_key.items()))
            self.by_key.move_to_end(key)
            out.append(q[0])
            self._end(q[0], now, "released")
        return out

    def served(self, key: str, tokens: float, now: float) -> None:
        pass  # (it counted nothing)


    def expired(self, now: float) -> list[int]:
        out = [i for i, (_, _, give_up) in self.since.items() if give_up <= now]
        for i in out:
            self._end(i, now, "expired")
        return out


@dataclass
class Model:
    """The pool and the queue over simulated time (see the module's docstring)."""

    args: argparse.Namespace
    queue: SimAdmission | RoundRobin
    expired: str  # what a request that gave up waiting gets: "late" (sent) or "reject"
    reqs: list[Req]
    mean_service_s: float
    running: list[tuple[float, int]] = field(default_factory=list)  # (end, i) heap
    fifo: deque[int] = field(default_factory=deque)
    events: list[tuple[float, int, str, int]] = field(default_factory=list)
    seq: int = 0

    def at(self, t: float, kind: str, i: int) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, i))
        self.seq += 1

    def forecast(self, r: Req, now: float) -> float:
        if len(self.running) < self.args.slots and not self.fifo:
            return r.prefill_s
        soonest = max(0.0, self.running[0][0] - now) if self.running else 0.0
        return soonest + len(self.fifo) * self.mean_service_s / self.args.slots + r.prefill_s

    def start(self, r: Req, now: float) -> None:
        heapq.heappush(self.running, (now + r.service_s, r.i))
        self.at(now + r.prefill_s, "first", r.i)
        self.at(now + r.service_s, "end", r.i)

    def send(self, r: Req, now: float, late: bool) -> None:
        r.late = late
        if len(self.running) < self.args.slots and not self.fifo:
            self.start(r, now)
        else:
            self.fifo.append(r.i)

    def decide(self, r: Req, now: float) -> None:
        """The router's pick (the gateway's ``Admission.admit``): at once if the forecast
        meets what is left of the target; else a critical request waits in the queue (once);
        released, it goes (late if it still misses); a wait that ends unreleased (its target
        spent, a full queue, displaced): late, or rejected (``expired``)."""
        left = r.arrival + self.args.target_ms / 1000 - now
        end = r.arrival + self.args.target_ms / 1000
        if self.forecast(r, now) <= left:
            self.send(r, now, late=False)
            return
        if r.waited:  # (released, and still missing: late)
            self.send(r, now, late=True)
            return
        r.waited = True
        if self.queue.offer(r.i, r.key, "critical", end, end, now):
            self.at(end, "give_up", r.i)
            for j in self.queue.expired(now):  # (one it displaced)
                self.reqs[j].turned_away = True
                self.give_up(self.reqs[j], now)
            return
        r.turned_away = True
        self.give_up(r, now)

    def give_up(self, r: Req, now: float) -> None:
        r.gave_up = True
        if self.expired == "reject":
            r.rejected = True
        else:
            self.send(r, now, late=True)

    def poke(self, now: float) -> None:
        for j in self.queue.release(now, 1):
            self.decide(self.reqs[j], now)

    def run(self) -> None:
        for r in self.reqs:
            self.at(r.arrival, "arrive", r.i)
        while self.events:
            now, _, kind, i = heapq.heappop(self.events)
            r = self.reqs[i]
            if kind == "arrive":
                self.decide(r, now)
            elif kind == "give_up":
                for j in self.queue.expired(now):
                    self.give_up(self.reqs[j], now)
            elif kind == "first":
                self.queue.served(r.key, r.prompt, now)
                self.poke(now)
            else:  # end
                self.running.remove((now, i))
                heapq.heapify(self.running)
                if self.fifo:
                    self.start(self.reqs[self.fifo.popleft()], now)
                self.queue.served(r.key, r.output, now)
                self.poke(now)


def workload(rates: dict[str, float], seconds: float, rng: np.random.Generator,
             ) -> list[Req]:
    """Poisson arrivals per key, merged in time; log-normal prompt and output lengths."""
    rows = []
    for key, rate in rates.items():
        n = rng.poisson(rate * seconds)
        rows += [(t, key) for t in rng.uniform(0.0, seconds, n)]
    rows.sort()
    out = []
    for i, (t, key) in enumerate(rows):
        prompt = int(rng.lognormal(np.log(800), 0.6))
        output = max(1, int(rng.lognormal(np.log(60), 0.6)))
        prefill = prompt / PREFILL_TPS
        out.append(Req(i, key, float(t), prompt, output, prefill, prefill + output / DECODE_TPS))
    return out


MEAN_SERVICE_S = float(np.exp(np.log(800) + 0.18) / PREFILL_TPS
                       + np.exp(np.log(60) + 0.18) / DECODE_TPS)  # (log-normal means)


def simulate(order: str, keys: dict[str, float], args: argparse.Namespace, seed: int,
             ) -> dict[str, dict[str, list[float]]]:
    """One run of ``order`` (``fair`` or ``round-robin``, then ``/late`` or ``/reject``): per
    key, each request's time in queue (summed over its waits), and whether it queued, was
    turned away (or displaced), was late (served after its target) and was rejected."""
    order, expired = order.split("/")
    capacity = args.slots / MEAN_SERVICE_S  # requests/s
    rates = {k: share * capacity for k, share in keys.items()}
    rng = np.random.default_rng(seed)
    reqs = workload(rates, args.seconds, rng)
    queue: SimAdmission | RoundRobin = (SimAdmission(args.max_queued, args.half_life_s)
                                        if order == "fair" else RoundRobin(args.max_queued))
    model = Model(args, queue, expired, reqs, MEAN_SERVICE_S)
    model.run()
    waited: dict[int, float] = {}
    for w in queue.waits:
        waited[w.i] = waited.get(w.i, 0.0) + w.seconds
    warm = args.seconds * 0.1  # (the first tenth: the queue and the service counts fill)
    out: dict[str, dict[str, list[float]]] = {}
    for r in reqs:
        if r.arrival < warm:
            continue
        d = out.setdefault(r.key, {"wait": [], "queued": [], "away": [], "late": [],
                                   "rejected": []})
        d["wait"].append(waited.get(r.i, 0.0))
        d["queued"].append(float(r.i in waited))
        d["away"].append(float(r.turned_away))
        d["late"].append(float(r.late))
        d["rejected"].append(float(r.rejected))
    return out


def merge(runs: list[dict[str, dict[str, list[float]]]]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for key, d in run.items():
            for name, xs in d.items():
                out.setdefault(key, {}).setdefault(name, []).extend(xs)
    return out


def p(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def light_p90s(res: dict[str, dict[str, list[float]]]) -> tuple[float, float]:
    """The light key's p90 time in queue over all its requests, and over those that queued."""
    d = res["light"]
    queued = [w for w, q in zip(d["wait"], d["queued"], strict=True) if q]
    return p(d["wait"], 90), p(queued, 90)


def ratio(mixed: float, alone: float) -> str:
    if not alone > 0:
        return "   n/a"
    r = mixed / alone
    return f"{r:5.2f}x" + ("" if r <= 1.5 else "!")


def detail(args: argparse.Namespace) -> None:
    """Each key's row, per order and mix, at ``--light-load``."""
    print(f"{'order':<16} {'mix':<11} {'key':<6} {'requests':>8} {'queued':>7} {'away':>6} "
          f"{'p50 ms':>7} {'p90 ms':>7} {'p90 of queued':>13} {'late':>6} {'refused':>7}")
    for order in ORDERS:
        for mix, keys in mixes(args.light_load, args.ratio):
            res = merge([simulate(order, keys, args, seed) for seed in range(args.seeds)])
            for key, d in sorted(res.items(), reverse=True):
                queued = [w for w, q in zip(d["wait"], d["queued"], strict=True) if q]
                print(f"{order:<16} {mix:<11} {key:<6} {len(d['wait']):>8} "
                      f"{np.mean(d['queued']):>7.1%} {np.mean(d['away']):>6.1%} "
                      f"{p(d['wait'], 50) * 1e3:>7.0f} {p(d['wait'], 90) * 1e3:>7.0f} "
                      f"{p(queued, 90) * 1e3:>13.0f} {np.mean(d['late']):>6.1%} "
                      f"{np.mean(d['rejected']):>7.1%}")


def sweep(args: argparse.Namespace, loads: list[float]) -> None:
    """The light key's p90 with the heavy key over alone, per order, at several loads."""
    print(f"\nthe light key's p90 time in queue (ms), with the heavy key at {args.ratio:g}x "
          f"its rate vs alone; ratio target <= 1.5x ('!': missed; n/a: alone it never "
          f"queued, p90 0)")
    print(f"{'light load':>10} {'order':<16} {'alone':>6} {'w/heavy':>7} {'ratio':>6}   "
          f"{'of queued: alone':>16} {'w/heavy':>7} {'ratio':>6}")
    for load in loads:
        for order in ORDERS:
            (a_all, a_q), (m_all, m_q) = (
                light_p90s(merge([simulate(order, keys, args, seed)
                                  for seed in range(args.seeds)]))
                for _, keys in mixes(load, args.ratio))
            print(f"{load:>10.2f} {order:<16} {a_all * 1e3:>6.0f} {m_all * 1e3:>7.0f} "
                  f"{ratio(m_all, a_all):>6}   {a_q * 1e3:>16.0f} {m_q * 1e3:>7.0f} "
                  f"{ratio(m_q, a_q):>6}")


LIVE_BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
             "max_tokens": 96}


def timed_waits(queue: AdmissionQueue) -> dict[str, list[float]]:
    """Each wait in the gateway's queue, per client, measured around its ``wait``."""
    waits: dict[str, list[float]] = {}
    wait = queue.wait

    async def timed(client: str, timeout_s: float, **kw: object) -> bool:
        t = time.monotonic()
        try:
            return await wait(client, timeout_s, **kw)  # type: ignore[arg-type]
        finally:
            waits.setdefault(client, []).append(time.monotonic() - t)

    queue.wait = timed  # type: ignore[method-assign]
    return waits


async def live_run(args: argparse.Namespace, rates: dict[str, float],
                   ) -> dict[str, tuple[int, list[float]]]:
    """One window of the real gateway: per key, the requests sent and each wait's seconds."""
    import httpx
    import yaml

    from duetime.gateway import pool_from_dict
    from duetime.gateway.keys import key_digest, new_key
    from duetime.service import Service

    keys = {k: new_key() for k in rates}
    with tempfile.TemporaryDirectory() as d:
        keys_file = Path(d) / "keys.yaml"
        keys_file.write_text(yaml.safe_dump([{"name": k, "sha256": key_digest(v)}
                                             for k, v in keys.items()]))
        pool = pool_from_dict({
            "policy": "sfs", "auth": {"keys_file": str(keys_file)},
            "instances": [{"name": "a", "model": "m", "profile": "qwen3-0.6b",
                           "config": {"max_num_seqs": 8},
                           "emulate": {"speed": args.live_speed, "output_median": 24},
                           "price_usd_per_mtok": {"prompt": 0.1, "output": 0.3}}],
            "quality": {"workload": None, "tasks": {"chat": {"m": 0.9}}},
            "admission": {"max_queued": args.max_queued,
                          "fairness_half_life_s": args.half_life_s},
            "autoscale": {"interval_s": 3600},
            "timeouts": {"first_token_s": 600, "read_s": 600}}, "live")
    svc = await Service(pool, drain_timeout_s=1.0).start()
    assert svc.gateway is not None
    waits = timed_waits(svc.gateway.queue)
    sent = dict.fromkeys(rates, 0)
    try:
        async with httpx.AsyncClient(base_url=svc.url, timeout=600,
                                     limits=httpx.Limits(max_connections=5000)) as c:
            async def one(k: str) -> None:
                await c.post("/v1/chat/completions", json=LIVE_BODY, headers={
                    "authorization": f"Bearer {keys[k]}", "x-duetime-priority": "critical",
                    "x-duetime-ttft-ms": str(args.live_target_ms)})

            async def send(k: str, rate: float, rng: np.random.Generator) -> None:
                tasks, t0, t = [], time.monotonic(), 0.0
                while (t := t + rng.exponential(1 / rate)) < args.live_seconds:
                    await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
                    sent[k] += 1
                    tasks.append(asyncio.create_task(one(k)))
                await asyncio.sleep(args.live_target_ms / 1000 + 0.5)  # (the last waits end)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            await asyncio.gather(*(send(k, r, np.random.default_rng(n))
                                   for n, (k, r) in enumerate(rates.items())))
    finally:
        await svc.stop()
    return {k: (sent[k], waits.get(f"key:{k}", [])) for k in rates}


def live(args: argparse.Namespace) -> None:
    """The real gateway: the light key alone, then with the heavy key."""
    light = args.live_light_rate
    print(f"\nlive: the gateway in-process over one emulated instance (speed "
          f"{args.live_speed:g}); light key {light:g} req/s, heavy {light * args.ratio:g} req/s; "
          f"TTFT target {args.live_target_ms:g} ms; {args.live_seconds:g} s each")
    print(f"{'mix':<11} {'key':<6} {'requests':>8} {'queued':>7} {'p50 ms':>7} {'p90 ms':>7} "
          f"{'p90 of queued':>13}")
    p90: dict[str, float] = {}
    for mix, rates in (("alone", {"light": light}),
                       ("with heavy", {"light": light, "heavy": light * args.ratio})):
        for key, (n, ws) in asyncio.run(live_run(args, rates)).items():
            every = ws + [0.0] * max(0, n - len(ws))
            p90[f"{mix} {key}"] = p(every, 90)
            print(f"{mix:<11} {key:<6} {n:>8} {len(ws) / max(n, 1):>7.1%} "
                  f"{p(every, 50) * 1e3:>7.0f} {p(every, 90) * 1e3:>7.0f} "
                  f"{p(ws, 90) * 1e3:>13.0f}")
    alone, mixed = p90["alone light"], p90["with heavy light"]
    print(f"light key's p90, with the heavy key / alone: {mixed * 1e3:.0f} / "
          f"{alone * 1e3:.0f} ms = {ratio(mixed, alone).strip()}")


ORDERS = ("fair/late", "fair/reject", "round-robin/late")


def mixes(light_load: float, r: float) -> list[tuple[str, dict[str, float]]]:
    return [("alone", {"light": light_load}),
            ("with heavy", {"light": light_load, "heavy": light_load * r})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--light-load", type=float, default=0.95,
                    help="the light key's rate as a share of the pool's capacity")
    ap.add_argument("--sweep", default="0.3,0.5,0.8,0.95",
                    help="light loads for the summary (empty: none)")
    ap.add_argument("--ratio", type=float, default=10.0, help="heavy rate / light rate")
    ap.add_argument("--slots", type=int, default=8, help="requests the pool serves at once")
    ap.add_argument("--target-ms", type=float, default=500.0, help="every request's TTFT target")
    ap.add_argument("--max-queued", type=int, default=256)
    ap.add_argument("--half-life-s", type=float, default=60.0)
    ap.add_argument("--live", action="store_true", help="also run the real gateway")
    ap.add_argument("--live-seconds", type=float, default=45.0)
    ap.add_argument("--live-speed", type=float, default=0.025)
    ap.add_argument("--live-light-rate", type=float, default=2.25, help="requests/s")
    ap.add_argument("--live-target-ms", type=float, default=1000.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"pool: {args.slots} slots, mean service {MEAN_SERVICE_S:.2f} s (capacity "
          f"{args.slots / MEAN_SERVICE_S:.2f} req/s); light key at {args.light_load:.2f} of "
          f"it, heavy at {args.ratio:g}x that; TTFT target {args.target_ms:g} ms; max_queued "
          f"{args.max_queued}; {args.seconds:g} s x {args.seeds} seeds (first tenth dropped)")
    detail(args)
    if args.sweep:
        sweep(args, [float(x) for x in args.sweep.split(",")])
    if args.live:
        live(args)
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
