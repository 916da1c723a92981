"""How much latency does a gateway add? Direct to an instance, through duetime, through LiteLLM.

Starts, as subprocesses on loopback, one emulated instance (``duetime emulate``, Qwen3-0.6B
timing sped up ``--speed`` times, so that engine time is small beside HTTP), a duetime gateway
(``duetime serve``) whose pool is that one instance and, when ``--litellm`` names its command
(``scripts/litellm_env.sh`` builds one), LiteLLM's proxy in front of the same instance. Then,
from this process, at each concurrency (1, 16, 64 clients in closed loop), streams the same
requests (a short chat prompt, ``max_tokens`` 8 with ``ignore_eos``) on every path in
alternating rounds, and prints p50 / p99 of time to first token and of the whole response, what
each proxy adds over the direct path, and each proxy's CPU per request. The ``floor`` path
is ``benchmarks/bare_proxy.py``: a pass-through proxy on duetime's HTTP stack (uvicorn with
httptools, aiohttp to the upstream) doing nothing else — what the stack costs before duetime
does anything (``--no-floor`` leaves it out).

duetime runs its full hot path: prompt estimate, the policy (``--policy``, default ``sfs``: an
engine-replay forecast per candidate on the published snapshot it polls every 50 ms), upstream
stream with retries armed, pass-through, metrics and logs at warning level. LiteLLM runs its
proxy with a master key (it refuses to start without one), its default router, and uvicorn's
access log off (``--log_config``), as a deployment would. On a small machine the processes share
the cores: the numbers include that contention and move by tens of percent from run to run, so
compare columns within one run.

    python benchmarks/gateway_overhead.py [--requests N] [--speed X] [--policy NAME]
                                          [--litellm PATH/TO/litellm] [--also NAME=PYTHON]

``--tokenizer DIR`` (a model folder: tokenizer.json, tokenizer_config.json, its chat template;
default the e2e suite's ``.cache/vllm-models/tiny-small`` when built) first measures, in this
process, what the gateway's exact prompt tokens cost per request (the chat template rendered
with jinja2, the text encoded, the block keys chained) against the estimate, for a short chat
and a long conversation.

``--redis`` adds a duetime gateway sharing its state through a real Redis (``--store``; a
``redis-server`` on a free loopback port, and a second replica on the same store that gets no
traffic, so that the measured one has a peer): the cost of the shared store on the hot path.

``--also before=../base/.venv/bin/python`` adds another duetime gateway, run by that
interpreter (another checkout's virtual environment), as one more path of the same run: the
way to compare two versions of duetime side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

CONCURRENCY = (1, 16, 64)
MODEL = "qwen3-0.6b"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 8, "ignore_eos": True, "stream": True}).encode()
LITELLM_KEY = "sk-duetime-benchmark-0123456789abcdef"
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Path_:
    name: str
    url: str
    pid: int | None  # the proxy process (None: the direct path)
    headers: dict[str, str] = field(default_factory=dict)


def _wait_line(proc: subprocess.Popen[str], marker: str, what: str, limit_s: float) -> str:
    assert proc.stdout is not None
    t_end = time.monotonic() + limit_s
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line:
            break
        if marker in line:
            return line
    proc.kill()
    raise SystemExit(f"gateway_overhead: could not start {what}")


def _start_duetime(args: list[str],
                   python: str = sys.executable) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([python, "-m", "duetime", *args, "--port", "0",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = _wait_line(proc, "listening on ", f"duetime {' '.join(args)}", 120)
    return proc, line.split("listening on ", 1)[1].split()[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[str], limit_s: float = 60.0) -> None:
    import socket

    t_end = time.monotonic() + limit_s
    while time.monotonic() < t_end and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("gateway_overhead: the floor proxy (benchmarks/bare_proxy.py) did not "
                     "come up")


def _start_litellm(cmd: str, backend: str, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    cfg = tmp / "litellm.yaml"
    cfg.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
                   f"      model: hosted_vllm/{MODEL}\n      api_base: {backend}/v1\n"
                   f"      api_key: none\n")
    # uvicorn's access log off, LiteLLM's own logger at warning (as duetime runs here)
    logcfg = tmp / "litellm-logging.json"
    logcfg.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "handlers": {"err": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"}},
        "loggers": {"uvicorn": {"handlers": ["err"], "level": "WARNING"},
                    "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False}},
    }))
    port = _free_port()
    env = {**os.environ, "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOG": "WARNING",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([cmd, "--config", str(cfg), "--host", "127.0.0.1", "--port",
                             str(port), "--log_config", str(logcfg)], cwd=tmp, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 180
    import urllib.request

    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise SystemExit(f"gateway_overhead: LiteLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health/liveliness", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("gateway_overhead: LiteLLM did not come up within 180 s")


async def _one(session: aiohttp.ClientSession, path: Path_) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    async with session.post(path.url + "/v1/chat/completions", data=BODY,
                            headers={"content-type": "application/json", **path.headers}) as r:
        if r.status != 200:
            raise RuntimeError(f"{path.name}: HTTP {r.status}: {(await r.read())[:200]!r}")
        while True:
            chunk = await r.content.readany()
            if not chunk:
                break
            if first is None:
                first = time.perf_counter() - t0
    return first or 0.0, time.perf_counter() - t0


async def _round(session: aiohttp.ClientSession, path: Path_, conc: int, n: int,
                 out: list[tuple[float, float]]) -> None:
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            out.append(await _one(session, path))

    await asyncio.gather(*(worker() for _ in range(conc)))


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc; else 0)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def _measure(paths: list[Path_], n: int, rounds: int,
                   concurrency: tuple[int, ...]) -> list[list[str]]:
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        for p in paths:  # warm up every path and its connections
            await _round(session, p, 16, 64, [])
        for conc in concurrency:
            res: dict[str, list[tuple[float, float]]] = {p.name: [] for p in paths}
            cpu = {p.name: 0.0 for p in paths}
            per = max(conc, n // rounds)
            for _ in range(rounds):
                for p in paths:
                    before = _cpu_s(p.pid)
                    await _round(session, p, conc, per, res[p.name])
                    cpu[p.name] += _cpu_s(p.pid) - before
            d = res["direct"]
            dt, de = [x[0] for x in d], [x[1] for x in d]
            for p in paths:
                r = res[p.name]
                t, e = [x[0] for x in r], [x[1] for x in r]
                row = [str(conc), p.name, str(len(r)),
                       f"{_pct(t, .5):.2f}", f"{_pct(t, .99):.2f}",
                       f"{_pct(e, .5):.2f}", f"{_pct(e, .99):.2f}"]
                if p.name == "direct":
                    row += ["", "", "", "", ""]
                else:
                    row += [f"{_pct(t, .5) - _pct(dt, .5):+.2f}",
                            f"{_pct(t, .99) - _pct(dt, .99):+.2f}",
                            f"{statistics.median(e) * 1000 - statistics.median(de) * 1000:+.2f}",
                            f"{_pct(e, .99) - _pct(de, .99):+.2f}",
                            f"{cpu[p.name] / len(r) * 1000:.2f}"]
                rows.append(row)
        for p in paths:  # the gateways' own routing time (arrival to dispatch), whole run
            if p.pid is None or p.name in ("litellm", "floor"):
                continue
            async with session.get(p.url + "/metrics") as r:
                text = (await r.text()) if r.status == 200 else ""
            vals = {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                    if ln.startswith("duetime_routing_seconds_")}
            n_ = vals.get("duetime_routing_seconds_count", 0.0)
            if n_:
                ROUTING[p.name] = (vals["duetime_routing_seconds_sum"] / n_ * 1000,
                                   _median_ms(text, n_))
    return rows


ROUTING: dict[str, tuple[float, float]] = {}  # path -> routing time (ms) mean, median


def _median_ms(text: str, count: float) -> float:
    """The histogram's median, interpolated linearly inside its bucket (as PromQL's
    histogram_quantile does): the buckets are coarse, so this is an estimate."""
    edges = []
    for ln in text.splitlines():
        if ln.startswith("duetime_routing_seconds_bucket{"):
            le = ln.split('le="', 1)[1].split('"', 1)[0]
            edges.append((float(le), float(ln.rsplit(" ", 1)[1])))
    lo, below = 0.0, 0.0
    for le, cum in sorted(edges):
        if cum >= count / 2:
            if le == float("inf"):
                return lo * 1000
            return (lo + (le - lo) * (count / 2 - below) / max(cum - below, 1.0)) * 1000
        lo, below = le, cum
    return float("nan")


def _default_litellm() -> str | None:
    for cand in (os.environ.get("DUETIME_LITELLM"), str(REPO / ".venv-litellm/bin/litellm")):
        if cand and Path(cand).is_file():
            return cand
    return None


def tokenizer_cost(folder: str, reps: int = 2000) -> None:
    """µs per request of the gateway's prompt counting and block keys, with the pool's
    tokenizer and without (the estimate), for a short chat and an 8-turn conversation: seen
    for the first time (each repetition a new conversation), and its eighth turn after its
    first seven (a conversation that comes back: the tokenizer keeps rendered prefixes)."""
    from duetime.web.prefix_keys import prompt_block_keys
    from duetime.web.prompt_tokens import PromptTokenizer
    from duetime.web.requests import parse_completion

    tok = PromptTokenizer(folder)
    text = ("the quick brown fox jumps over the lazy dog while seven tall ships sail past "
            "quiet harbours")
    words = text.split(" ")

    def conversation(k: int, turns: int = 8) -> dict:
        """Conversation ``k`` (its own system prompt) up to its ``turns``-th message."""
        msgs = [{"role": "system", "content": f"conversation {k}: " + " ".join(words * 20)}]
        for t in range(turns):
            msgs.append({"role": "user" if t % 2 == 0 else "assistant",
                         "content": " ".join(words[t:] * 6)})
        return {"model": MODEL, "messages": msgs}

    def time_one(raw: bytes, mode: str) -> tuple[float, int]:
        t = time.perf_counter()
        req = parse_completion(raw, chat=True)
        if mode == "tokenizer":
            req.token_ids = tok.ids(req)
            req.prompt_tokens = len(req.token_ids)
        prompt_block_keys(req, 16)
        return time.perf_counter() - t, req.prompt_tokens

    rows = {"short chat": lambda k: [json.dumps(json.loads(BODY)).encode()],
            "8-turn chat": lambda k: [json.dumps(conversation(k)).encode()],
            "8th turn": lambda k: [json.dumps(conversation(k, t)).encode()
                                   for t in range(1, 9)]}
    print(f"prompt tokens per request, µs (median of {reps}; tokenizer {folder}; 8-turn chat: "
          "a new conversation each time; 8th turn: after the same conversation's first 7)")
    print(f"{'request':>12}  {'tokens':>6}  {'estimate':>8}  {'tokenizer':>9}  {'ratio':>5}")
    for r, (name, bodies) in enumerate(rows.items()):
        times = {}
        n = 0
        for mode in ("estimate", "tokenizer"):
            xs = []
            for k in range(reps):
                *earlier, last = bodies(r * reps + k + (0 if mode == "estimate" else 10**6))
                for raw in earlier:  # (the conversation's earlier turns, untimed)
                    time_one(raw, mode)
                dt, n = time_one(last, mode)
                xs.append(dt)
            times[mode] = statistics.median(xs) * 1e6
        print(f"{name:>12}  {n:>6}  {times['estimate']:>8.1f}  {times['tokenizer']:>9.1f}  "
              f"{times['tokenizer'] / times['estimate']:>5.1f}")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600, help="requests per path and "
                    "concurrency (default 600)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations between the paths")
    ap.add_argument("--speed", type=float, default=20.0, help="emulator speed-up (default 20)")
    ap.add_argument("--policy", default="sfs", help="duetime's policy (default sfs)")
    ap.add_argument("--litellm", default=_default_litellm(), metavar="CMD",
                    help="LiteLLM's `litellm` command (default: $DUETIME_LITELLM or "
                    ".venv-litellm/bin/litellm if present; scripts/litellm_env.sh builds it)")
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM path")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the floor path (benchmarks/bare_proxy.py: a pass-through proxy "
                    "on the same HTTP stack, doing nothing else)")
    ap.add_argument("--also", action="append", default=[], metavar="NAME=PYTHON",
                    help="one more duetime gateway, run by PYTHON (another checkout's venv), "
                    "as path NAME (repeatable)")
    ap.add_argument("--with-policy", action="append", default=[], metavar="NAME=POLICY",
                    help="one more duetime gateway, this checkout's, routing with POLICY, as "
                    "path NAME (repeatable): e.g. rr=round-robin prices the decision apart "
                    "from the rest of the hot path")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    metavar="N[,N...]", help="client concurrencies to run (default 1,16,64)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="a model folder whose tokenizer and chat template to time first "
                    "(default: .cache/vllm-models/tiny-small if built)")
    ap.add_argument("--tokenizer-only", action="store_true",
                    help="only the tokenizer's cost (no servers)")
    ap.add_argument("--redis", action="store_true",
                    help="add a duetime gateway that shares its state through a real Redis "
                    "(redis-server on PATH)")
    args = ap.parse_args()
    folder = args.tokenizer
    if folder is None and (REPO / ".cache/vllm-models/tiny-small/tokenizer.json").is_file():
        folder = str(REPO / ".cache/vllm-models/tiny-small")
    if folder is not None:
        tokenizer_cost(folder)
    if args.tokenizer_only:
        return
    also = []
    for item in args.also:
        name, sep, python = item.partition("=")
        if not sep or not name or not Path(python).is_file():
            raise SystemExit(f"gateway_overhead: --also {item!r}: want NAME=PATH/TO/python")
        also.append((name, python))
    with_policy = []
    for item in args.with_policy:
        name, sep, policy = item.partition("=")
        if not sep or not name or not policy:
            raise SystemExit(f"gateway_overhead: --with-policy {item!r}: want NAME=POLICY")
        with_policy.append((name, policy))
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise SystemExit(f"gateway_overhead: --concurrency {args.concurrency!r}: want "
                         "integers separated by commas") from None
    if not concurrency or min(concurrency) < 1:
        raise SystemExit("gateway_overhead: --concurrency: want positive integers")
    litellm = None if args.no_litellm else args.litellm
    if litellm is None and not args.no_litellm:
        print("gateway_overhead: no LiteLLM (run scripts/litellm_env.sh, or pass --litellm); "
              "measuring duetime only", file=sys.stderr)

    emu, direct = _start_duetime(["emulate", "--profile", MODEL, "--speed", str(args.speed)])
    procs: list[subprocess.Popen[str]] = [emu]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            def pool(policy: str) -> Path:
                cfg = Path(tmp) / f"pool-{policy}.yaml"
                cfg.write_text(f"policy: {policy}\ninstances:\n  - name: emu\n"
                               f"    model: {MODEL}\n    url: {direct}\n"
                               f"    profile: {MODEL}\n    speed: {args.speed}\n")
                return cfg

            cfg = pool(args.policy)
            gw, gateway = _start_duetime(["serve", "--config", str(cfg)])
            procs.append(gw)
            paths = [Path_("direct", direct, None), Path_("duetime", gateway, gw.pid)]
            if args.redis:
                exe = shutil.which("redis-server")
                if exe is None:
                    raise SystemExit("gateway_overhead: --redis: no redis-server "
                                     "(bash scripts/system_deps.sh)")
                rport = _free_port()
                procs.append(subprocess.Popen(  # type: ignore[arg-type]
                    [exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL))
                time.sleep(0.5)
                store = ["--store", f"redis://127.0.0.1:{rport}/0"]
                shared, surl = _start_duetime(["serve", "--config", str(cfg), *store])
                peer, _ = _start_duetime(["serve", "--config", str(cfg), *store])
                procs += [shared, peer]
                paths.append(Path_("duetime+redis", surl, shared.pid))
            if not args.no_floor:
                fport = _free_port()
                procs.append(subprocess.Popen(  # type: ignore[arg-type]
                    [sys.executable, str(REPO / "benchmarks/bare_proxy.py"), "--upstream",
                     direct, "--port", str(fport)], stdout=subprocess.DEVNULL))
                _wait_port(fport, procs[-1])
                paths.append(Path_("floor", f"http://127.0.0.1:{fport}", procs[-1].pid))
            for name, policy in with_policy:
                other, url = _start_duetime(["serve", "--config", str(pool(policy))])
                procs.append(other)
                paths.append(Path_(name, url, other.pid))
            for name, python in also:
                other, url = _start_duetime(["serve", "--config", str(cfg)], python)
                procs.append(other)
                paths.append(Path_(name, url, other.pid))
            if litellm is not None:
                lp, lurl = _start_litellm(litellm, direct, Path(tmp))
                procs.append(lp)
                paths.append(Path_("litellm", lurl, lp.pid,
                                   {"authorization": f"Bearer {LITELLM_KEY}"}))
            rows = asyncio.run(_measure(paths, args.requests, args.rounds, concurrency))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    header = ["conc", "path", "n", "ttft p50", "ttft p99", "total p50", "total p99",
              "+ttft p50", "+ttft p99", "+total p50", "+total p99", "proxy cpu/req"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"gateway overhead, ms (emulator {MODEL} x{args.speed:g}; duetime policy "
          f"{args.policy}; streamed chat, 8 output tokens)")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    if ROUTING:
        print("routing time, arrival to dispatch (the gateway's duetime_routing_seconds, ms, "
              "mean / median interpolated in its buckets): "
              + ", ".join(f"{k} {m:.3f} / {q:.3f}" for k, (m, q) in ROUTING.items()))
    print("+x: added over the direct path in the same run; proxy cpu/req: the proxy process's "
          "CPU per request through it (background scrapes and probes included).")


if __name__ == "__main__":
    main()
