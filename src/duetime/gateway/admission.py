"""Admission by priority, and the gateway's own load in the forecasts.

A request's priority (``x-duetime-priority``: ``critical``, ``standard`` (the default) or
``sheddable``) decides what happens when no instance's forecast meets its TTFT target, as
llm-d's latency-SLO admission does with its criticalities: a ``sheddable`` request is refused
at once (429 with ``Retry-After``), a ``critical`` one waits in the gateway — a bounded queue,
fair across clients — until an instance can meet its target or its target is spent, then goes
to the best forecast; a ``standard`` one goes to the best forecast at once (SFS's own rule).

The gateway's own load (:class:`GatewayLoad`): every forecast also counts the gateway's own
CPU, the wait of a CPU as busy as measured, capped by the requests it has sent and not yet seen
a first token for at its measured CPU seconds per request. Under a burst the gateway
saturates and the forecasts grow with its backlog, so the burst's requests miss their targets
and are admitted by priority (shed, queued, or sent to the best forecast); at a light load it
adds almost nothing (counting the whole backlog there made live forecasts through the gateway
two to three times worse than none). The gateway's CPU is the same whichever instance a
request goes to: it decides admission, not the split (``benchmarks/burst.py``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from duetime.gateway.metrics import GatewayMetrics

PRIORITIES = ("critical", "standard", "sheddable")


class GatewayLoad:
    """What the gateway process itself adds to a request's time to first token.

    The process is one CPU that every request visits about twice before its first token
    (accept, route and send; receive and relay the first token). Measured on windows of
    ``window_s`` that start at the first request (startup's tokenizer load and compilations
    are not requests' work) and close on time, whatever completes: ``utilization`` rho, the
    process CPU time over the window's wall time, and ``cpu_per_request_s`` c, that CPU time
    over the requests completed in the window (kept from an earlier window when none
    completed). Each window replaces the last: a slow average kept a window of compilation
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
        self.on_capacity: Callable[[], None] | None = None  # (the admission queue's poke)
        self.awaiting = 0  # sent upstream, no first token yet (all instances)
        self.cpu_per_request_s = 0.0
        self.utilization = 0.0
        self._cpu, self._clock = cpu, clock
        self._completed = 0
        self._sent = 0
        # (time, CPU, completed, sent) where the window under way began: set by the first
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

    def sent(self) -> None:
        self.awaiting += 1
        if self._mark is None:
            self._mark = (self._clock(), self._cpu(), self._completed, self._sent)
        else:
            self._roll()
        self._sent += 1

    def answered(self) -> None:
        """A first token came back (or the attempt ended without one)."""
        self.awaiting = max(0, self.awaiting - 1)
        if self.on_capacity is not None:
            self.on_capacity()

    def completed(self) -> None:
        """A request ended."""
        self._completed += 1
        if self.on_capacity is not None:
            self.on_capacity()
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
        if self._completed > n0:
            self.cpu_per_request_s = (cpu - cpu0) / (self._completed - n0)
        self._mark = (t, cpu, self._completed, self._sent)
        return t


class AdmissionQueue:
    """Critical requests waiting for an instance that can meet their target: at most
    ``max_queued``, released one at a time in turn across clients (each client's own in
    arrival order) whenever capacity may have freed (:meth:`poke`: a first token, a request's
    end)."""

    def __init__(self, max_queued: int, metrics: GatewayMetrics) -> None:
        self.max_queued = max_queued
        self.metrics = metrics
        self._by_client: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    async def wait(self, client: str, timeout_s: float) -> bool:
        """Wait for a turn (True) or until ``timeout_s`` (False); False at once when full."""
        if self._size >= self.max_queued or timeout_s <= 0 or not math.isfinite(timeout_s):
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._by_client.setdefault(client, deque()).append(fut)
        self._size += 1
        self.metrics.queued.set(self._size)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._drop(client, fut)

    def _drop(self, client: str, fut: asyncio.Future[None]) -> None:
        q = self._by_client.get(client)
        if q is not None and fut in q:
            q.remove(fut)
            self._size -= 1
            if not q:
                del self._by_client[client]
        self.metrics.queued.set(self._size)

    def poke(self) -> None:
        """Release the next waiter, the clients in turn (a released one leaves the queue
        when it resumes)."""
        for client, q in self._by_client.items():
            for fut in q:
                if not fut.done():
                    fut.set_result(None)
                    self._by_client.move_to_end(client)  # (the next poke starts elsewhere)
                    return


class Shed(Exception):
    """A sheddable request refused: no instance can meet its target now."""

    def __init__(self, retry_after_s: float, forecast_s: float, target_s: float) -> None:
        super().__init__("shed")
        self.retry_after_s = retry_after_s
        self.forecast_s = forecast_s
        self.target_s = target_s
