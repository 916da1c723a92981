"""The gateway's own load in the forecasts.

Every forecast also counts the gateway's own CPU, the wait of a CPU as busy as measured, capped
by the requests it has sent and not yet seen a first token for at its measured CPU seconds per
request. Under a burst the gateway saturates and the forecasts grow with its backlog, so the
burst's requests miss their targets and are admitted by priority (shed, queued, or sent to the
best forecast: :mod:`duetime.gateway.intake.admission`); at a light load it adds almost nothing
(counting the whole backlog there made live forecasts through the gateway two to three times
worse than none). The gateway's CPU is the same whichever instance a request goes to: it
decides admission, not the split (``benchmarks/burst.py``).

It learns from the attempt lifecycle (dispatch: one more awaiting; first token, or an end
without one: one fewer; end: one ended); the instances read :meth:`GatewayLoad.delay_s`.
"""

from __future__ import annotations

import time

from duetime.gateway.state.lifecycle import Attempt, Subscriber


class GatewayLoad(Subscriber):
    """What the gateway process itself adds to a request's time to first token.

    The process is one CPU that every request visits about twice before its first token
    (accept, route and send; receive and relay the first token). Measured on windows of
    ``window_s`` that start at the first request (startup's tokenizer load and compilations
    are not requests' work) and close on time, whatever completes: ``utilization`` rho, the
    process CPU time over the window's wall time, and ``cpu_per_request_s`` c, that CPU time
    over the attempts that ended in the window (kept from an earlier window when none
    ended). Each window replaces the last: a slow average kept a window of compilation
    for many seconds and forecast seconds of gateway delay where there were milliseconds.
    A burst is routed faster than a window closes, so the window under way counts too, as
    the load offered so far: the requests sent in it times c, over ``window_s`` (or its
    length once longer); rho is the larger of the two.

    The delay is the Pollaczek-Khinchine mean wait of those two visits at a CPU busy rho of
    the time, rho c / (1 - rho), capped by the backlog itself, c times the requests sent and
    not yet answered: an idle or lightly loaded gateway adds almost nothing; a saturated one
    (a burst of 500) adds its whole backlog."""

    def __init__(self, window_s: float = 0.25, *, cpu=time.process_time,
                 clock=time.monotonic) -> None:
        self.window_s = window_s
        self.awaiting = 0  # sent upstream, no first token yet (all instances)
        self.cpu_per_request_s = 0.0
        self.utilization = 0.0
        self._cpu, self._clock = cpu, clock
        self._ended = 0
        self._sent = 0
        # (time, CPU, ended, sent) where the window under way began: set by the first
        # request
        self._mark: tuple[float, float, int, int] | None = None

    def delay_s(self) -> float:
        """Seconds the gateway's own CPU adds to a request sent now."""
        t = self._roll()
        c = self.cpu_per_request_s
        if c == 0.0 or self.awaiting == 0:
            return 0.0
        t0, _, _, sent0 = self._mark  # type: ignore[misc]
        offered = (self._sent - sent0) * c / max(t - t0, self.window_s)
        rho = min(max(self.utilization, offered), 0.999)
        return min(c * self.awaiting, rho * c / (1.0 - rho))

    def on_dispatch(self, a: Attempt) -> None:
        self.sent()

    def on_first_token(self, a: Attempt) -> None:
        self.answered()

    def on_end(self, a: Attempt) -> None:
        if a.flight.first_token is None:
            self.answered()
        self.ended()

    def sent(self) -> None:
        self.awaiting += 1
        if self._mark is None:
            self._mark = (self._clock(), self._cpu(), self._ended, self._sent)
        else:
            self._roll()
        self._sent += 1

    def answered(self) -> None:
        """A first token came back (or the attempt ended without one)."""
        self.awaiting = max(0, self.awaiting - 1)

    def ended(self) -> None:
        """An attempt ended."""
        self._ended += 1
        self._roll()

    def _roll(self) -> float:
        """Close the window once ``window_s`` has passed: its measures replace the last.
        Returns the time now."""
        t = self._clock()
        if self._mark is None:
            return t
        t0, cpu0, n0, _ = self._mark
        if t - t0 < self.window_s:
            return t
        cpu = self._cpu()
        self.utilization = min(1.0, (cpu - cpu0) / (t - t0))
        if self._ended > n0:
            self.cpu_per_request_s = (cpu - cpu0) / (self._ended - n0)
        self._mark = (t, cpu, self._ended, self._sent)
        return t
