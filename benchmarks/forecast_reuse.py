"""What a forecast could reuse from the last one of its instance: counted over simulated runs.

An engine's forecaster reads its base afresh after every change of the engine
(``duetime.engine.live_forecast``). This counts, over ``sfs`` runs of the paper's workload
(3 instances at 8.6 q/s, 90 at 258 q/s), what a base kept across changes could have saved:

* ``same state``: forecasts of an instance that had not changed since its last forecast (its
  base is reused as it is);
* ``steps only``: it changed only by steps in which nothing finished or was preempted and no
  running request was at or past its predicted length (a base from before could have been
  shifted: the replay takes the same steps);
* ``other``: anything else changed it (an arrival, a finish, a request past its prediction);
* ``steps between``: the instance's steps since its last forecast (median);
* ``drained at 0``: forecasts whose queue ahead was drained in the base's first step, and
  ``recorded``: the base steps recorded (median): how much of a replay there is to reuse.

It wraps the engine's and the forecaster's methods to look (a measurement, not a mode of the
simulator).

    python benchmarks/forecast_reuse.py [--requests N]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from duetime.engine import engine as engine_module
from duetime.engine import forecasting
from duetime.engine import scheduler_kernel as kn
from duetime.estimate import sfs
from duetime.experiments import Point, Runner
from duetime.workload import load_workload


class Counts:
    def __init__(self) -> None:
        self.same = self.steps_only = self.other = 0
        self.between: list[int] = []
        self.drained: list[bool] = []
        self.recorded: list[int] = []


CURRENT = Counts()  # (the run being counted)


def instrument() -> None:
    """Wrap, once, what is counted (into ``CURRENT``)."""
    Engine = engine_module.Engine
    step, add = Engine.step, Engine.add

    def counted_step(self, **kw):  # type: ignore[no-untyped-def]
        ev = step(self, **kw)
        if ev is not None:
            self._steps_since = getattr(self, "_steps_since", 0) + 1
            rows = self._run[:int(self._st[kn.NRUN])]
            past = bool(np.any(self._req[rows, kn.OUTPUT] >= self._pred[rows]))
            if ev.finished_ids or ev.preempted or past:
                self._dirty = True
        return ev

    def counted_add(self, *a, **kw):  # type: ignore[no-untyped-def]
        self._dirty = True
        return add(self, *a, **kw)

    Engine.step, Engine.add = counted_step, counted_add
    ttft = sfs.SfsEstimator.ttft

    def counted_ttft(self, view, prompt_tokens, now, **kw):  # type: ignore[no-untyped-def]
        counts = CURRENT
        eng = view.engine
        view.sync()
        rev = eng.revision
        if getattr(eng, "_last_rev", None) == rev:
            counts.same += 1
        elif getattr(eng, "_dirty", True):
            counts.other += 1
        else:
            counts.steps_only += 1
        counts.between.append(getattr(eng, "_steps_since", 0))
        eng._dirty, eng._steps_since, eng._last_rev = False, 0, rev
        return ttft(self, view, prompt_tokens, now, **kw)

    sfs.SfsEstimator.ttft = counted_ttft
    probe = forecasting.Forecaster._ttft

    def counted_probe(self, p, hashes):  # type: ignore[no-untyped-def]
        got = probe(self, p, hashes)
        counts = CURRENT
        counts.drained.append(bool(self._room[1]) and int(self._room[2]) == 0)
        counts.recorded.append(self._n)
        return got

    forecasting.Forecaster._ttft = counted_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6000)
    args = ap.parse_args()
    print(f"sfs, the paper's workload, {args.requests} requests; shares of the forecasts")
    print(f"{'instances':>9} {'q/s':>6} {'forecasts':>9} {'same state':>10} {'steps only':>10} "
          f"{'other':>6} {'steps between':>13} {'drained at 0':>12} {'recorded':>8}")
    global CURRENT
    instrument()
    for replicas, rate in ((1, 8.6), (30, 258.0)):
        counts = CURRENT = Counts()
        Runner(load_workload("paper").with_replicas(replicas), seed=0).run(
            Point("sfs", rate, args.requests))
        n = counts.same + counts.steps_only + counts.other
        print(f"{3 * replicas:>9} {rate:>6.1f} {n:>9} {counts.same / n:>10.3f} "
              f"{counts.steps_only / n:>10.3f} {counts.other / n:>6.3f} "
              f"{statistics.median(counts.between):>13.0f} "
              f"{np.mean(counts.drained):>12.3f} {statistics.median(counts.recorded):>8.0f}")


if __name__ == "__main__":
    main()
