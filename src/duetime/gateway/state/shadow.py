"""The shadow replica: a compiled engine copy of one instance, advanced in real time and
corrected by what the gateway sees (works with any OpenAI-compatible server).

A dispatched request joins the replica's waiting queue with its estimated prompt and its
predicted output length (as the snapshot's ``predicted_output_tokens``; the replica never
finishes a request by itself: past its prediction the forecaster's remaining-length estimate
applies). Its first streamed chunk marks its prefill done (``Engine.observe``); the streamed
token counts correct the replica's outputs (at most every ``sync_interval_s``, vectorised); on
completion, failure or cancellation it leaves the replica (``Engine.abort``).

It is an attempt-lifecycle subscriber (dispatch: :meth:`add`; first token: :meth:`observe_first`;
end: :meth:`leave`); the other gateway replicas' attempts reach it through the same three calls
(:meth:`~duetime.gateway.state.instance.InstanceState.on_peer_dispatch`). Time moves only in
:meth:`ShadowReplica.refresh` (and before each event): reading a snapshot changes nothing.

With prefix caching (the instance's config says ``enable_prefix_caching``) the replica is also
the gateway's *estimated* view of the instance's cache: each request joins with its prompt's
block keys, so the replica caches, shares and evicts blocks as vLLM would for the requests
this gateway sent (and knows nothing of others'), and its forecasts price the hits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import numpy as np

from duetime.engine.engine import Engine
from duetime.engine.scheduler import EngineStuck
from duetime.engine.snapshot import Snapshot
from duetime.engine.spec import InstanceSpec
from duetime.estimate.correction import StepCorrection
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.lifecycle import Attempt, Subscriber

log = logging.getLogger("duetime.gateway")


class ShadowReplica(Subscriber):
    """The replica of one instance (``name``, for logs)."""

    def __init__(self, name: str, spec: InstanceSpec, now: float,
                 sync_interval_s: float, steps: StepCorrection | None = None) -> None:
        """``steps``: the instance's step-time correction, learnt here from the streamed
        token counts and applied to the replica's model (None: the model as calibrated)."""
        self.name = name
        self.model = spec.batch_time
        self.engine = Engine(spec.config, spec.batch_time, time=now, retain_finished=False)
        self.sync_interval_s = sync_interval_s
        self._last_sync = -math.inf
        self.steps = steps
        self._synced: dict[str, int] = {}  # running flights' token counts at the last sync
        if steps is not None and steps.applied != 1.0:
            self.engine.set_model(self.model.scaled(1.0 / steps.applied))

    @property
    def idle(self) -> bool:
        return self.engine.idle

    def _advance(self, now: float) -> None:
        eng = self.engine
        try:
            eng.run_until(now)
        except EngineStuck as e:  # a request the replica cannot hold: drop it from the replica
            log.warning("shadow replica stuck", extra={"fields": {
                "instance": self.name, "error": str(e)}})
            for rid in eng.waiting_ids()[:1]:
                eng.abort(rid)

    def refresh(self, now: float, flights: Iterable[Flight]) -> None:
        """Advance to ``now`` and apply the streamed token counts of ``flights`` (at most every
        ``sync_interval_s``)."""
        self._advance(now)
        if now - self._last_sync < self.sync_interval_s:
            return
        self._last_sync = now
        fl = [f for f in flights if f.tokens >= 1 and f.shadowed]
        if fl:
            if self.steps is not None:
                self._learn_steps(fl)
            outs = np.fromiter((f.tokens for f in fl), dtype=np.int64, count=len(fl))
            self.engine.observe_many([f.id for f in fl], outs)
            if self.steps is not None:
                running = set(self.engine.running_ids())
                self._synced.update((f.id, f.tokens) for f in fl if f.id in running)

    def _learn_steps(self, fl: list[Flight]) -> None:
        """Since the last sync (or its first token) the replica stepped each running request
        on from the count the instance had streamed then: its tokens against the instance's
        teach the step correction, and a factor that moved by more than 5% is applied to the
        replica's model."""
        steps, eng = self.steps, self.engine
        assert steps is not None
        ids = [f.id for f in fl if f.id in self._synced and eng.has(f.id)]
        if ids:
            replica = eng.lookup(ids).output
            base = np.fromiter((self._synced[i] for i in ids), dtype=np.int64, count=len(ids))
            now_obs = {f.id: f.tokens for f in fl}
            observed = np.fromiter((now_obs[i] for i in ids), dtype=np.int64, count=len(ids))
            steps.observe(int((replica - base).sum()), int((observed - base).sum()), len(ids))
        self._apply_steps()

    def _apply_steps(self) -> None:
        assert self.steps is not None
        factor = self.steps.settle()
        if factor is not None:
            self.engine.set_model(self.model.scaled(1.0 / factor))

    def snapshot(self) -> Snapshot:
        """The replica as of its last refresh (built once per state)."""
        return self.engine.snapshot()

    def add(self, flight: Flight, now: float) -> None:
        """A dispatched request joins the waiting queue at ``now``."""
        eng = self.engine
        if flight.prompt_tokens + 1 >= eng.config.max_model_len:
            return
        if eng.idle:
            eng.set_clock(now)
        else:
            self._advance(now)
        eng.add(flight.id, flight.prompt_tokens, eng.config.max_model_len,
                predicted_output_tokens=flight.predicted, arrival=now,
                hashes=(() if flight.hashes is None else flight.hashes) if eng.caching
                else None, lora=flight.lora)
        flight.shadowed = True

    def observe_first(self, flight: Flight, now: float) -> None:
        """The request's first token came at ``now``: its prefill is done."""
        if flight.shadowed:
            self._advance(now)
            self.engine.observe(flight.id, flight.tokens)
            if self.steps is not None:
                self._synced[flight.id] = flight.tokens

    def leave(self, flight: Flight, now: float | None = None) -> None:
        """The request ended (finished, failed or cancelled; at ``now``, where known): it
        leaves the replica — with the step correction, after its last stretch taught it."""
        if not flight.shadowed:
            return
        base = self._synced.pop(flight.id, None)
        if self.steps is not None and base is not None and now is not None \
                and self.engine.has(flight.id):
            self._advance(now)
            replica = int(self.engine.lookup([flight.id]).output[0])
            self.steps.observe(replica - base, flight.tokens - base)
            self._apply_steps()
        self.engine.abort(flight.id)

    # -- as a lifecycle subscriber ----------------------------------------------------------------

    def on_dispatch(self, a: Attempt) -> None:
        self.add(a.flight, a.flight.dispatched)

    def on_first_token(self, a: Attempt) -> None:
        assert a.flight.first_token is not None
        self.observe_first(a.flight, a.flight.first_token)

    def on_end(self, a: Attempt) -> None:
        self.leave(a.flight, a.ended)
