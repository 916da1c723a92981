"""Many engines stepped to one time in one compiled call: what a big simulated pool pays at
each arrival.

The simulator steps every engine with a step due before an arrival up to it, so that the
router reads each instance as it is then. At the paper's load per instance a step is longer
than the gap between arrivals once the pool has tens of instances, so each arrival finds ~18
engines of 90 with one step due, and stepping them one by one costs a Python call and a
dispatch each (~4 µs) for ~1-2 µs of compiled work: the simulator's cost per request grew with
the pool (``benchmarks/simulate_speed.py``'s pool table). :class:`BatchStepper` keeps each
engine's arrays in one typed list and steps the due ones in one call, each exactly as its
:meth:`~duetime.engine.engine.Engine.run_until` would (the same kernel, the same step noise,
the clock of an engine that went idle brought to the time, its load summary published).

Engines with prefix caching (their cache is lent to forecasts between steps) or LoRA adapters
(their kernel is compiled with the adapter rule, from arrays of other types) are not batched:
the caller steps those itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numba import typed

from duetime.engine import scheduler_kernel as kn
from duetime.engine._jit import njit
from duetime.engine.engine import Engine
from duetime.engine.wait_estimate import ROW_SIZE, summarize


@njit(cache=True, nogil=True)
def advance_due(slots, noise, publish, due, t, busy):  # pragma: no cover - jit
    """Step the engines ``due`` (indices into ``slots``) while their clock is before ``t``, as
    :meth:`Engine.run_until <duetime.engine.engine.Engine.run_until>` does, and set ``busy[k]``
    to the clock of engine ``k`` while it has work (else inf). Returns the position in ``due``
    of an engine that is stuck (left as it was for its own ``run_until`` to report), else
    -1."""
    for j in range(due.shape[0]):
        k = due[j]
        req, stamps, run, wq, st, clock, cfg, w, work, out, pred, row = slots[k]
        code, _ = kn.run_until(req, stamps, run, wq, st, clock, cfg, w, work, out, None, None,
                               None, None, None, None, t, False, noise[k])
        if code < 0:
            return j
        if code == kn.IDLE and t != math.inf and t > clock[0]:  # Engine.set_clock(t)
            clock[0] = t
            st[kn.LONE] = -1
        if publish[k]:
            summarize(req, pred, run, wq, st, clock, cfg, w, row)
        busy[k] = math.inf if st[kn.NRUN] == 0 and st[kn.WC] == 0 else clock[0]
    return -1


_warm = False


def warm_up_stepper() -> None:
    """Compile (or load) what a :class:`BatchStepper` runs, once per process: its kernel and
    its typed list's operations (numba compiles those afresh in every process: ~0.25 s for
    replacing an entry), so that a simulation's clock does not count them."""
    global _warm
    if _warm:
        return
    from duetime.engine.batch_time import Sfs6
    from duetime.engine.config import SchedulerConfig

    eng = Engine(SchedulerConfig(), Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0, css=0.0),
                 noise=0.01)
    eng.add("a", 10, 2)
    stepper = BatchStepper([eng, None])
    eng.set_model(eng.model)  # (a new layout: the entry is replaced)
    stepper.advance(np.arange(2, dtype=np.int64), 1.0, np.zeros(2))
    _warm = True


def _batchable(engine: Engine | None) -> bool:
    return engine is not None and not engine.caching and not engine.config.max_loras


class BatchStepper:
    """Steps a pool's engines to a time in one compiled call (see the module doc).
    ``engines[k]`` is ``None`` for an instance the caller steps itself."""

    def __init__(self, engines: Sequence[Engine | None]) -> None:
        self._engines = list(engines)
        self.batched = np.array([_batchable(e) for e in self._engines], dtype=bool)
        usable = [e for e, b in zip(self._engines, self.batched, strict=True) if b]
        self._slots = typed.List()
        self._noise = np.array([e.noise if e is not None else 0.0 for e in self._engines])
        self._publish = np.zeros(len(self._engines), dtype=np.bool_)
        self._stale: set[int] = set()
        if not usable:
            return
        filler = usable[0]
        for k, e in enumerate(self._engines):
            if self.batched[k]:
                assert e is not None
                self._slots.append(self._slot(k, e))
                e.watch_layout(lambda k=k: self._stale.add(k))
            else:  # (a placeholder of the same type: never stepped)
                self._slots.append(self._slot(-1, filler))

    def _slot(self, k: int, engine: Engine) -> tuple:
        arrays = engine.kernel_arrays()
        row = arrays[-1]
        if k >= 0:
            self._publish[k] = row is not None
        return (*arrays[:-1], np.zeros(ROW_SIZE) if row is None else row)

    def advance(self, due: np.ndarray, t: float, busy: np.ndarray) -> np.ndarray:
        """Step the batched engines among ``due`` to ``t`` and update their ``busy``
        entries; returns the rest of ``due`` (the caller steps those)."""
        if self._stale:
            for k in self._stale:
                engine = self._engines[k]
                assert engine is not None
                self._slots[k] = self._slot(k, engine)
            self._stale.clear()
        mine = self.batched[due]
        batch = due[mine]
        if batch.shape[0]:
            j = advance_due(self._slots, self._noise, self._publish, batch, t, busy)
            if j >= 0:  # the engine raises its own EngineStuck
                k = int(batch[j])
                engine = self._engines[k]
                assert engine is not None
                engine.run_until(t)
                raise AssertionError(f"engine {k} was stuck in a batch but not alone")
        return due[~mine]
