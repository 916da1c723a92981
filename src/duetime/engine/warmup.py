"""Load (or compile) the engine's and the forecaster's kernels once per process.

numba caches compiled code on disk, but loading it still takes a fraction of a second on the
first call; a server calls :func:`warm_up` at start so that its first request does not pay it.
"""

from __future__ import annotations

import numpy as np

from duetime.engine.batch_time import Sfs6
from duetime.engine.config import SchedulerConfig
from duetime.engine.engine import Engine
from duetime.engine.forecasting import forecast, forecaster
from duetime.engine.wait_estimate import LoadBoard

_warm = False


def warm_up() -> None:
    """Run every compiled path once (step, run_until, observe, abort, a forecast, the wait
    estimates, step noise), without
    and with prefix caching (its block pool, the forecast that borrows it, and what a KV-event
    mirror tells the engine). A path left cold compiles inside the first request that needs
    it: seconds with a fresh cache, during which a server's event loop stands still (the
    gateway's pooled upstream connections then outlive the servers' keep-alive)."""
    global _warm
    if _warm:
        return
    model = Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0, css=0.0)
    eng = Engine(SchedulerConfig(), model, noise=0.01)
    board = LoadBoard(1)
    board.attach(eng, 0)
    eng.add("a", 100, 3)
    eng.add("b", 50, 2)
    eng.step(tokens=True)
    eng.observe("b", 1)
    eng.observe_many(["a"], [2])
    eng.run_until(1.0)
    eng.add("c", 10, 2)
    forecast(eng.snapshot(), 64)
    forecaster(eng.snapshot()).finish(64, [1, 8])  # (the finish from the record, fast-forward)
    eng.first_token_floor(64)
    board.estimates(np.zeros(1, dtype=np.int64), 64, 0.0)
    eng.abort("c")
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=64, enable_prefix_caching=True)
    ce = Engine(cfg, model, retain_finished=False)
    ce.add("p", 40, 3, hashes=[11, 12])
    ce.add("q", 40, 2, hashes=[11, 13])
    ce.step(tokens=True)
    ce.observe("q", 1)
    ce.observe_many(["p"], [2])
    ce.run_until(1.0)
    ce.add("r", 40, 2, hashes=[11, 12])
    snap = ce.snapshot()
    forecast(snap, 40, prompt_hashes=[11, 12])
    forecast(snap, 40, prompt_hashes=[11, 12])  # (the kept lease's extension)
    ce.cached_prefix([11, 12])
    ce.cache_store([21, 22])
    ce.cache_drop([21])
    ce.abort("r")
    ce.cache_clear()
    _warm = True
