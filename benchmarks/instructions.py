"""How many instructions does a forecast cost? Counts, not timings: each case runs under
valgrind's callgrind, which counts the instructions executed (deterministic to a fraction of a
percent, where wall-clock timings on a shared machine move by tens of percent).

Cases (each in its own process, state built and warmed first, then only the measured calls
counted):

* ``first``: the first ``forecast`` of a 200-running / 20-waiting snapshot without caching
  (probe of 1000 tokens; budget 2048), as in ``forecast_speed.py``'s first table;
* ``further``: a later probe of the same snapshots (16 .. 32768 tokens);
* ``live-arrival``: a live engine's own forecaster (``Engine.forecaster()``) after one arrival
  (200 running / 20 waiting, budget 2048);
* ``caching-first``: the first forecast with prefix caching of a snapshot of a caching engine
  (200 running / 20 waiting, 256 seats, ~30,000 cached blocks; the probe shares a system prompt);
* ``gateway-published``: the gateway's decision on an instance that publishes its snapshot
  (one running request) after a dispatch: its forecaster of the published snapshot merged
  with the ledger (``PublishedSnapshots.forecaster``; in a checkout without it, the merged
  snapshot's own forecaster) and one probe — what ``InstanceState.forecaster()`` and the
  estimator pay;
* ``gateway-shadow``: the same decision read from the shadow replica's engine (its own
  forecaster after the dispatch's arrival), the source without a published snapshot;
* ``gateway-shadow-caching``: the same on a shadow replica with prefix caching (the source
  ``auto`` reads for a caching instance: vLLM's default), the probe with its block keys.

How only the measured calls are counted: callgrind starts with counting off and toggles it on
entering and leaving CPython's ``starmap_next`` (``--toggle-collect``), and each measured call
runs as the one element of an ``itertools.starmap`` (nothing else in the process uses it). This
needs a CPython whose symbols are not stripped (pyenv's and python.org's builds keep them);
the script says so when it finds the count empty. The first run in a checkout takes minutes
(numba compiles the kernels again for the CPU valgrind presents, and caches them); later runs
take about 20 s a case.

    python benchmarks/instructions.py [--cases first,further,...] [--repeat N]

Side by side with another checkout (one run each is enough: counts barely move)::

    python benchmarks/ab.py --a ../base --b . --runs 1 -- benchmarks/instructions.py
"""

from __future__ import annotations

import argparse
import collections
import itertools
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CASES = ("first", "further", "live-arrival", "caching-first", "gateway-published",
         "gateway-shadow", "gateway-shadow-caching")
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def counted(call: Callable[[], object]) -> None:
    """Run ``call`` with callgrind's counting on (see the module doc)."""
    collections.deque(itertools.starmap(call, [()]), maxlen=0)


def _model():
    from duetime.engine import load_profile
    return load_profile("qwen3-8b").batch_time


def case_first(n: int, further: bool = False) -> int:
    """``n`` snapshots: each one's first forecast (or, with ``further``, five later probes of
    each; counted: that many calls)."""
    import forecast_speed as fs  # (this folder's: same snapshots as its first table)
    from duetime.engine import SchedulerConfig, Snapshot, forecast
    from duetime.engine.synthetic import paper_like_snapshot
    model = _model()
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=131072,
                          block_size=16, num_gpu_blocks=100_000)
    snaps = []
    for seed in range(n + 1):
        d = paper_like_snapshot(random.Random(seed), model, n_running=200, n_waiting=20,
                                config=cfg).to_dict()
        snaps.append(Snapshot.from_dict(d))
    forecast(snaps[0], 1000)  # warm: the compiled kernel loaded, buffers made
    forecast(snaps[0], 512)
    calls = 0
    for snap in snaps[1:]:
        if not further:
            counted(lambda snap=snap: forecast(snap, 1000))
            calls += 1
            continue
        forecast(snap, 1000)
        for p in fs.FURTHER:
            counted(lambda snap=snap, p=p: forecast(snap, p))
            calls += 1
    return calls


def case_live_arrival(n: int) -> int:
    """A live engine: ``n`` times one arrival, then its forecaster's first probe (counted)."""
    import forecast_speed as fs
    eng, add = fs.live_engine(_model(), 2048, seed=0)
    eng.forecaster().ttft(1000)
    add()
    eng.forecaster().ttft(1000)
    for _ in range(n):
        add()
        counted(lambda: eng.forecaster().ttft(1000))
    return n


def case_caching_first(n: int) -> int:
    """``n`` caching engines (as ``forecast_speed.py``'s third table, 256 seats): a snapshot
    after one step, its first forecast with a probe that shares a system prompt (counted)."""
    import numpy as np

    import forecast_speed as fs
    from duetime.engine import forecast
    model = _model()
    for seed in range(n):
        eng, systems, add = fs.caching_engine(model, 2048, 30_000, seed, seats=256)
        rng = random.Random(~seed)

        def probe(rng: random.Random = rng, systems: list = systems) -> np.ndarray:
            return np.array((rng.choice(systems) + [rng.getrandbits(62) for _ in range(62)])[:62],
                            dtype=np.int64)

        # (the engine's first forecast grows its arenas; the compiled code for probes with
        # keys is loaded at the first such call)
        forecast(eng.snapshot(), 1000, prompt_hashes=probe())
        eng.step()
        while eng.num_waiting < 20:
            add()
        snap = eng.snapshot()
        keys = probe()
        counted(lambda snap=snap, keys=keys: forecast(snap, 1000, prompt_hashes=keys))
    return n


def case_gateway_published(n: int) -> int:
    """An instance's published snapshot (one running request) and its ledger: ``n`` times a
    dispatch, then the merged snapshot's forecaster and one probe (counted), then the end."""
    from duetime.engine import load_profile
    from duetime.engine.forecasting import forecaster
    from duetime.engine.snapshot import RequestTable, Snapshot
    from duetime.gateway.backends.memory import MemoryStore
    from duetime.gateway.state.flight import Flight
    from duetime.gateway.state.ledger import Ledger
    from duetime.gateway.state.lifecycle import Attempt
    from duetime.gateway.state.published import PublishedSnapshots
    spec = load_profile("qwen3-8b")
    run = RequestTable(["r0"], [30], [34], [5], [8])
    pub = PublishedSnapshots(True)
    now = time.monotonic()
    pub.set(Snapshot(spec.config, spec.batch_time, time=0.0, running=run), 0.0, now, now)
    ledger = Ledger("a", MemoryStore())

    def decide() -> None:
        now = time.monotonic()
        if hasattr(pub, "forecaster"):  # (the gateway's path since it has one)
            pub.forecaster(now, ledger).ttft(30)
        else:  # (before: a merged snapshot and its forecaster per ledger change)
            forecaster(pub.merged(now, ledger)).ttft(30)

    for i in range(n + 2):
        f = Flight(f"x{i}", 30, 8, time.monotonic(), None)
        a = Attempt.__new__(Attempt)  # (the ledger reads only its flight and end)
        a.flight = f
        ledger.on_dispatch(a)
        if i < 2:
            decide()
        else:
            counted(decide)
        a.ended, a.output_tokens = time.monotonic(), 8
        ledger.on_end(a)
    return n


def case_gateway_shadow(n: int) -> int:
    """The same decision on the instance's shadow replica instead (a live engine holding the
    one running request): ``n`` times a dispatch (an arrival), then the engine's own
    forecaster's probe (counted), then the end (an abort)."""
    from duetime.engine import Engine, load_profile
    spec = load_profile("qwen3-8b")
    eng = Engine(spec.config, spec.batch_time, retain_finished=False)
    eng.add("r0", 30, 10_000, predicted_output_tokens=8)
    eng.step()
    for i in range(n + 2):
        eng.add(f"x{i}", 30, 8, predicted_output_tokens=8)
        if i < 2:
            eng.forecaster().ttft(30)
        else:
            counted(lambda: eng.forecaster().ttft(30))
        eng.abort(f"x{i}")
    return n


def case_gateway_shadow_caching(n: int) -> int:
    """The gateway's decision where the instance caches prefixes (vLLM's default, and
    ``gateway_overhead.py``'s instance): the shadow replica's caching engine, one running
    request of a shared system prompt; ``n`` times a dispatch with its block keys (an arrival),
    then the engine's own forecaster's probe with keys (counted), then the end (an abort)."""
    import dataclasses

    import numpy as np

    from duetime.engine import Engine, load_profile
    spec = load_profile("qwen3-8b")
    cfg = dataclasses.replace(spec.config, enable_prefix_caching=True)
    eng = Engine(cfg, spec.batch_time, retain_finished=False)
    system = [random.Random(0).getrandbits(62) for _ in range(4)]
    eng.add("r0", 80, 10_000, predicted_output_tokens=8, hashes=system)
    eng.step()
    probe = np.array(system, dtype=np.int64)
    for i in range(n + 2):
        eng.add(f"x{i}", 80, 8, predicted_output_tokens=8, hashes=system)
        if i < 2:
            eng.forecaster().ttft(80, probe)
        else:
            counted(lambda: eng.forecaster().ttft(80, probe))
        eng.abort(f"x{i}")
    return n


RUNS: dict[str, tuple[Callable[[int], int], int]] = {
    "first": (case_first, 20),
    "further": (lambda n: case_first(n, further=True), 10),
    "live-arrival": (case_live_arrival, 40),
    "caching-first": (case_caching_first, 3),
    "gateway-published": (case_gateway_published, 200),
    "gateway-shadow": (case_gateway_shadow, 200),
    "gateway-shadow-caching": (case_gateway_shadow_caching, 200),
}


def _child(case: str, repeat: int) -> None:
    run, n = RUNS[case]
    print(f"calls {run(n * repeat)}")


def _count(case: str, repeat: int) -> tuple[int, int]:
    """(instructions, calls) of one case, run under callgrind."""
    here = Path(__file__).resolve()
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no",
         "--toggle-collect=starmap_next", "--callgrind-out-file=/dev/null",
         sys.executable, str(here), "--child", case, "--repeat", str(repeat)],
        capture_output=True, text=True, check=False,
        env={"PYTHONHASHSEED": "0", "PATH": "/usr/bin:/bin"})
    if out.returncode != 0:
        raise SystemExit(f"instructions: case {case} failed:\n{out.stdout}\n{out.stderr}")
    m = COLLECTED.search(out.stderr)
    calls = re.search(r"calls (\d+)", out.stdout)
    if m is None or calls is None:
        raise SystemExit(f"instructions: no count from callgrind for {case}:\n{out.stderr}")
    if int(m.group(1)) == 0:
        raise SystemExit("instructions: callgrind counted nothing: this CPython's symbols are "
                         "stripped (no starmap_next); use a build that keeps them (pyenv)")
    return int(m.group(1)), int(calls.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=1,
                    help="multiply each case's number of counted calls")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.repeat)
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in RUNS]
    if bad or not cases:
        raise SystemExit(f"instructions: unknown case(s) {bad}; choose from {', '.join(CASES)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("instructions: needs valgrind (apt-get install valgrind)")
    print(f"{'case':<20} {'calls':>6} {'instructions/call':>18}")
    for case in cases:
        total, calls = _count(case, args.repeat)
        print(f"{case:<20} {calls:>6} {total / calls:>18.0f}", flush=True)


if __name__ == "__main__":
    main()
