"""The gateway's own load in the forecasts: the process as one server in front of every
instance.

Every request passes twice through the gateway's one event loop before its client sees a first
token: its intake (read, parse, route, send upstream) and the relay of its first token. Under
a burst the loop is the bottleneck, and it serves roughly in turn: a request sent now has its
first token relayed once the intakes waiting at the server are done and the first tokens of
the requests ahead of it are relayed. So the loop needs

    pending x intake_s + (pending + awaiting) x relay_s

for the work ahead of a request sent now (:meth:`GatewayLoad.delay_s`), and its first token
reaches the client no sooner (the forecasts take the later of this and the instance's own
forecast: :func:`duetime.estimate.base.with_gateway`). ``pending``: the requests the gateway's
HTTP server holds and has not sent upstream yet, the one being decided aside (read but not yet
routed, and one on each new connection that has not sent its request yet: a burst announces
itself by its connections before the loop has read them;
:meth:`~duetime.web.server.AppServer.requests_in_progress` less the attempts in flight);
``awaiting``: sent, no first token yet. Both are counts the gateway has. The two costs are
what the loop spends per intake and per relay *under load*, measured online:

- ``intake_s``: the mean gap between two dispatches while intakes were waiting throughout
  (the loop busy with them, the relays and the embedded instances' work interleaved), over the
  whole stretch under way once it has ``min_gaps``, else over the last stretch that had;
  before any, lone requests' own intake time (arrival to dispatch), which is a quarter of a
  loaded one on the demo pool. The mean over the stretch, not the median nor the last few
  gaps: the loop dispatches in clumps, a few within microseconds, then works elsewhere for up
  to 100 ms, and the mean of the last 64 gaps swung between 0.8 and 5.6 ms within one burst
  whose dispatches came 2.1 ms apart overall;
- ``relay_s``: on windows of ``window_s`` in which the process was busy (its CPU time at
  least ``busy`` of the wall time), the CPU time less ``intake_s`` per dispatch, over the first
  tokens relayed in the window (at least ``min_relays``); the median of the last ``samples``.
  Until such a window has been seen, ``RELAY_SHARE`` x ``intake_s``. Windows of a lightly
  loaded process do not teach it: its background work (health probes, metrics polls, an
  embedded emulator's idle loop) is most of their CPU time (23-25 ms in 0.3 s windows whether
  they relayed one request or five: ``benchmarks/burst.py``'s warm-up).

An idle gateway adds nothing, a lightly loaded one the relays of the few streams ahead; a
burst its whole queue. The same delay is under every instance's forecast: it decides whether a
target can be met (admission, :mod:`duetime.gateway.intake.admission`), not which instance
meets it best. It learns from the attempt lifecycle (dispatch, first token, end).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from duetime.gateway.state.lifecycle import Attempt, Subscriber

# relay_s / intake_s before the loop has been seen busy relaying: on the embedded demo pool,
# 500 streamed chats at once were relayed at 0.74-0.95 ms each after intakes of 0.88-2.3 ms
# each (benchmarks/burst.py, five runs: the ratio 0.45-0.85): a relay reads and writes one
# message where an intake parses, routes and sends one and opens the upstream exchange
RELAY_SHARE = 0.6


class GatewayLoad(Subscriber):
    """What the gateway process itself adds to a request's time to first token (above)."""

    def __init__(self, window_s: float = 0.25, *, samples: int = 64, min_gaps: int = 16,
                 busy: float = 0.8, min_relays: int = 8, cpu=time.process_time,
                 clock=time.monotonic) -> None:
        self.window_s = window_s
        self.min_gaps, self.busy, self.min_relays = min_gaps, busy, min_relays
        self.awaiting = 0  # sent upstream, no first token yet (all instances)
        self.in_flight = 0  # sent upstream, not ended
        self.intake_s = 0.0
        self._received: Callable[[], int] | None = None
        self._cpu, self._clock = cpu, clock
        self._stretch: tuple[float, int] | None = None  # the stretch under way: start, gaps
        self._loaded: float | None = None  # intake_s of the last stretch with min_gaps
        self._lone: deque[float] = deque(maxlen=samples)  # lone intakes' own seconds
        self._relays: deque[float] = deque(maxlen=samples)  # seconds per relay, busy windows
        self._last: tuple[float, int] | None = None  # the last dispatch: time, pending after
        # where the window under way began: (time, CPU, dispatches, first tokens)
        self._mark: tuple[float, float, int, int] | None = None
        self._dispatched = 0
        self._firsts = 0

    @property
    def relay_s(self) -> float:
        """Seconds of the loop per first token relayed, under load."""
        if self._relays:
            return statistics.median(self._relays)
        return RELAY_SHARE * self.intake_s

    def count_intake(self, received: Callable[[], int]) -> None:
        """``received()``: the requests the gateway's server holds (read and not answered,
        and one per new connection not read yet), set when the server starts."""
        self._received = received

    def pending(self) -> int:
        """Requests at the server not sent upstream yet, besides the one being decided."""
        if self._received is None:
            return 0
        return max(0, self._received() - self.in_flight - 1)

    def delay_s(self) -> float:
        """Seconds the gateway's loop needs for the work ahead of a request sent now."""
        p = self.pending()
        if p == 0 and self.awaiting == 0:
            return 0.0
        return p * self.intake_s + (p + self.awaiting) * self.relay_s

    # -- the lifecycle ------------------------------------------------------------------------

    def on_dispatch(self, a: Attempt) -> None:
        t = a.flight.dispatched
        self.in_flight += 1
        self.awaiting += 1
        self._dispatched += 1
        last = self._last
        if last is not None and last[1] > 0:  # intakes waited since the last dispatch
            if self._stretch is None:
                self._stretch = (last[0], 0)
            t0, n = self._stretch
            self._stretch = (t0, n + 1)
            if n + 1 >= self.min_gaps:
                self._loaded = max(0.0, t - t0) / (n + 1)
        else:
            self._stretch = None  # (a stretch ends when no intake waits)
            if a.number == 1:  # a lone intake (a retry's arrival is its first attempt's)
                self._lone.append(max(0.0, t - a.arrival))
        if self._loaded is not None:
            self.intake_s = self._loaded
        elif self._lone:
            self.intake_s = statistics.fmean(self._lone)
        self._last = (t, self.pending())
        self._roll(t)

    def on_first_token(self, a: Attempt) -> None:
        self.awaiting = max(0, self.awaiting - 1)
        self._firsts += 1
        self._roll(self._clock())

    def on_end(self, a: Attempt) -> None:
        if a.flight.first_token is None:
            self.awaiting = max(0, self.awaiting - 1)
        self.in_flight = max(0, self.in_flight - 1)

    def _roll(self, t: float) -> None:
        """Close the window once ``window_s`` has passed: if the process was busy in it and
        relayed enough first tokens, a sample of ``relay_s``."""
        if self._mark is None:
            self._mark = (t, self._cpu(), self._dispatched, self._firsts)
            return
        t0, cpu0, d0, f0 = self._mark
        if t - t0 < self.window_s:
            return
        cpu = self._cpu() - cpu0
        relays = self._firsts - f0
        if cpu >= self.busy * (t - t0) and relays >= self.min_relays:
            spent = cpu - self.intake_s * (self._dispatched - d0)
            self._relays.append(max(0.0, spent) / relays)
        self._mark = (t, self._cpu(), self._dispatched, self._firsts)
