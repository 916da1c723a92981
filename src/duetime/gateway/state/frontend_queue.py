"""The instance's API server as the gateway sees it: the hand-offs it has queued.

A calibrated instance has a ``frontend`` (:mod:`duetime.engine.frontend`: vLLM's API server's
seconds per request and per chunk). Every request the gateway sends it is one more hand-off in
that server's FIFO, so the gateway can follow the request part of its queue exactly (from the
dispatch times; the server is assumed to serve only this gateway): a burst sent to one
instance makes the k-th request wait k hand-offs before its engine sees it, and the forecasts
add that wait (``frontend_wait_s``, read by :func:`duetime.estimate.sfs.frontend_delay`). The
chunk part is priced by the forecast from the streams in the first token's step. Requests sent
by other gateway replicas are not counted.
"""

from __future__ import annotations

from duetime.engine.frontend import Frontend, FrontendModel
from duetime.gateway.state.lifecycle import Attempt, Subscriber


class FrontendQueue(Subscriber):
    """One instance's API-server hand-offs, from the attempts dispatched to it."""

    def __init__(self, model: FrontendModel, now: float) -> None:
        self.queue = Frontend(model, now)

    def wait_s(self, now: float) -> float:
        """The wait a request sent ``now`` has before its server starts on it."""
        return self.queue.wait_s(now)

    def on_dispatch(self, a: Attempt) -> None:
        self.queue.admit(a.flight.id, a.flight.dispatched)

    def on_end(self, a: Attempt) -> None:
        self.queue.finish(a.flight.id)
