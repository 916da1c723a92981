"""One router's view of one instance: a shadow engine fed only with what that router knows.

A gateway replica does not read an instance's true state; it replays the engine forward from
the requests it knows about and corrects the replay with what the instance reports back
(:mod:`duetime.gateway.state.shadow`). :class:`RouterView` is that replica in the simulator: a
:class:`~duetime.sim.instance.SimInstance` (so every policy reads it as it reads a true
instance) whose engine is changed only by :class:`Known` events, each applied at the simulated
time the router learns it:

* ``ADD``: a dispatch joins the waiting tail with its predicted output length; like the
  gateway's replica it never finishes by itself (``stop`` = ``max_model_len``) but leaves at
  ``DONE``;
* ``FIRST``: the request's first token: its prefill is done (``Engine.observe``), unless the
  replay already got there;
* ``DONE``: the request ended with so many tokens (``Engine.end``: as the instance ends it,
  when the replay stands where the instance stood; else at once).

Token counts streamed back to the sending router correct its own requests at each of its
decisions (:meth:`RouterView.correct`). With a step correction
(:class:`~duetime.estimate.correction.StepCorrection`, as the gateway's ``state.step_correction``)
they also teach the view its instance's pace: between two corrections (and up to the request's
end) the tokens the replay made for the router's own requests against those the instance made,
and a factor that moved is applied to the view's batch-time model -- the simulator's instances
may step slower or faster than their calibration (``ClusterSim(step_scale=...)``).

Why a separate engine rather than the true engine minus the requests the router does not
know: the replica's errors are the ones a real replica makes -- its own requests prefill faster
in a replay that lacks the others', and with shared state the others' requests join, get
their first token and leave ``staleness`` seconds late (still decoding, still holding KV in the
meantime). Filtering the true engine would show the known requests at their true progress and
drop finished ones at once: it would hide all of that. Fed with every request at once (shared, staleness 0), the replica replays exactly what
the true engine does (same rules, same batch-time model, no noise), so its decisions equal a
single router's on the true state (tested).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from duetime.engine.scheduler import EngineStuck
from duetime.engine.spec import InstanceSpec
from duetime.estimate.correction import StepCorrection
from duetime.sim.instance import SimInstance

ADD, FIRST, DONE = 0, 1, 2
# streamed token counts within this many tokens of the replay's are left alone: the instance
# (stepped past the decision's time) and the replay may stand on either side of one step
TOLERANCE = 1


@dataclass(frozen=True, slots=True)
class Known:
    """What a router learns about one request: ``kind`` (ADD, FIRST, DONE); for ADD the
    prompt, the predicted output and the dispatch time (the ledger's ``dispatched``); for DONE
    the tokens it made."""

    kind: int
    rid: str
    prompt: int = 0
    predicted: int = 0
    dispatched: float = 0.0
    tokens: int = 0


class RouterView(SimInstance):
    """A router's shadow of one instance (no step noise: the router's model of the engine)."""

    def __init__(self, name: str, spec: InstanceSpec, steps: StepCorrection | None = None
                 ) -> None:
        """``steps``: learn the instance's step time from the router's own token counts
        (None: step with the calibration)."""
        if spec.config.enable_prefix_caching:
            raise ValueError(f"{name}: router views of prefix-caching instances are not "
                             "modelled (their caches would need the known hashes too)")
        super().__init__(name, spec, seed=0)
        self._pending: list[tuple[float, int, Known]] = []
        self._seq = 0
        self.steps = steps
        # the router's own running requests: (replay's, instance's) tokens at the last correction
        self._synced: dict[str, tuple[int, int]] = {}
        if steps is not None and steps.applied != 1.0:
            self.engine.set_model(spec.batch_time.scaled(1.0 / steps.applied))

    def learn(self, t: float, event: Known) -> None:
        """The router will know ``event`` from time ``t`` on. (Asynchronous scheduling: a
        first token stamped at ``t`` is applied by the step that starts at ``t``, after a
        request that ended at ``t`` has left: that step does not schedule it.)"""
        if event.kind == FIRST and self.engine.config.async_scheduling:
            t = float(np.nextafter(t, np.inf))
        heapq.heappush(self._pending, (t, self._seq, event))
        self._seq += 1

    def _advance(self, t: float) -> None:
        eng = self.engine
        if eng.idle:
            eng.set_clock(t)
            return
        try:
            eng.run_until(t)
        except EngineStuck:  # (as the gateway's replica: drop what it cannot hold)
            for rid in eng.waiting_ids()[:1]:
                eng.abort(rid)

    def catch_up(self, t: float) -> None:
        """Apply every event known by ``t`` at its own time, then replay to ``t``."""
        pending, eng = self._pending, self.engine
        while pending and pending[0][0] <= t:
            te, _, ev = heapq.heappop(pending)
            self._advance(te)
            if ev.kind == ADD:
                if ev.prompt + 1 < eng.config.max_model_len:
                    eng.add(ev.rid, ev.prompt, eng.config.max_model_len,
                            predicted_output_tokens=ev.predicted, arrival=ev.dispatched)
            elif not eng.has(ev.rid):
                self._synced.pop(ev.rid, None)
                continue
            elif ev.kind == FIRST:
                if int(eng.lookup([ev.rid]).output[0]) == 0:
                    eng.observe(ev.rid, 1)
            else:
                self._learn_end(ev.rid, ev.tokens)
                eng.end(ev.rid, ev.tokens)
        self._advance(t)
        self.now = t

    def correct(self, rids: list[str], outputs: np.ndarray) -> int:
        """The streamed token counts of the router's own requests (first token seen): where
        the replay differs, it takes the instance's word. Returns how many changed."""
        eng = self.engine
        keep = [k for k, rid in enumerate(rids) if eng.has(rid)]
        if not keep:
            return 0
        ids = [rids[k] for k in keep]
        outs = np.asarray(outputs)[keep]
        replay = eng.lookup(ids).output
        if self.steps is not None:
            self._learn(ids, replay, outs)
        differ = np.flatnonzero(np.abs(replay - outs) > TOLERANCE).tolist()
        changed = sum(eng.observe(ids[k], int(outs[k])) for k in differ)
        if self.steps is not None:
            after = eng.lookup(ids).output.tolist()
            self._synced.update(zip(ids, zip(after, outs.tolist(), strict=True), strict=True))
        return changed

    def _learn(self, ids: list[str], replay: np.ndarray, outs: np.ndarray) -> None:
        """Since the last correction the replay made ``replay`` - its count then for each of
        the router's requests it had already corrected, the instance ``outs`` - its count."""
        synced = self._synced
        made = seen = streams = 0
        for rid, r, o in zip(ids, replay.tolist(), outs.tolist(), strict=True):
            base = synced.get(rid)
            if base is not None:
                made += r - base[0]
                seen += o - base[1]
                streams += 1
        if seen:
            self._observe_steps(made, seen, streams)

    def _learn_end(self, rid: str, tokens: int) -> None:
        """The request ended with ``tokens``: its last stretch teaches the step correction."""
        base = self._synced.pop(rid, None)
        if base is not None and self.steps is not None:
            self._observe_steps(int(self.engine.lookup([rid]).output[0]) - base[0],
                                tokens - base[1])

    def _observe_steps(self, made: int, seen: int, streams: int = 1) -> None:
        steps = self.steps
        assert steps is not None
        steps.observe(made, seen, streams)
        factor = steps.settle()
        if factor is not None:
            self.engine.set_model(self.spec.batch_time.scaled(1.0 / factor))
