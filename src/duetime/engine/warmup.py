"""Load (or compile) the engine's and the forecaster's kernels once per process.

numba caches compiled code on disk, but loading it still takes a fraction of a second on the
first call; a server calls :func:`warm_up` at start so that its first request does not pay it.
"""

from __future__ import annotations

from duetime.engine.batch_time import Sfs6
from duetime.engine.compiled import Engine
from duetime.engine.config import SchedulerConfig
from duetime.engine.forecasting import forecast

_warm = False


def warm_up() -> None:
    """Run every compiled path once (step, run_until, observe, abort, a forecast)."""
    global _warm
    if _warm:
        return
    eng = Engine(SchedulerConfig(), Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0, css=0.0))
    eng.add("a", 100, 3)
    eng.add("b", 50, 2)
    eng.step(tokens=True)
    eng.observe("b", 1)
    eng.observe_many(["a"], [2])
    eng.run_until(1.0)
    eng.add("c", 10, 2)
    forecast(eng.snapshot(), 64)
    eng.abort("c")
    _warm = True
