"""Admission by priority: what happens to a request when no instance's forecast meets its TTFT
target.

A request's priority (``x-duetime-priority``: ``critical``, ``standard`` (the default) or
``sheddable``) decides it, as llm-d's latency-SLO admission does with its criticalities: a
``sheddable`` request is refused at once (429 with ``Retry-After``: :func:`shed_error`), a
``critical`` one waits in the gateway — a bounded queue, fair across clients — until an
instance can meet its target or its target is spent, then goes to the best forecast; a
``standard`` one goes to the best forecast at once (SFS's own rule). The router asks
:meth:`Admission.admit` after each decision (:mod:`duetime.gateway.routing.router`).

The queue learns that capacity may have freed from the attempt lifecycle: each first token and
each attempt's end releases one waiter (whether or not the gateway's own load is counted).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque

from duetime.gateway.intake.controls import Controls
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.web.errors import ApiError


class AdmissionQueue(Subscriber):
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

    def on_first_token(self, a: Attempt) -> None:
        self.poke()  # (a prefill is done: the instance has room again)

    def on_end(self, a: Attempt) -> None:
        self.poke()  # (a request left the instance)

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


def shed_error(e: Shed) -> ApiError:
    """The 429 a shed request gets, with its ``Retry-After`` header (the relay and the picker
    answer the same)."""
    return ApiError(429, f"no instance can meet this sheddable request's TTFT target now "
                    f"(target {e.target_s * 1000:.1f} ms, best forecast "
                    f"{e.forecast_s * 1000:.1f} ms); retry later", code="overloaded",
                    type_="rate_limit_error",
                    headers=[(b"retry-after", str(max(1, math.ceil(e.retry_after_s))).encode())])


class Admission:
    """The admission rule over the queue (none: critical requests never wait)."""

    def __init__(self, queue: AdmissionQueue | None, metrics: GatewayMetrics) -> None:
        self.queue = queue
        self.metrics = metrics

    async def admit(self, forecast: float | None, target_s: float, ctl: Controls,
                    waited: bool) -> bool:
        """Whether the request goes to the decision's instance now (True), or was queued and
        must be decided again (False). A forecast that meets the target (or none made): now.
        Otherwise by priority: ``sheddable`` raises :class:`Shed`; ``critical`` waits in the
        queue (once) until capacity frees or its target is spent; ``standard``, and a
        critical one that has waited or finds the queue full, goes to the best forecast."""
        m = self.metrics.admission
        if forecast is None or not math.isfinite(forecast) or forecast <= target_s:
            m.labels(ctl.priority, "queued" if waited else "on_time").inc()
            return True
        if ctl.priority == "sheddable":
            m.labels(ctl.priority, "shed").inc()
            raise Shed(forecast - target_s, forecast, target_s)
        if ctl.priority == "critical" and not waited and self.queue is not None:
            # released, or its target spent, or the queue full: decide once more either way
            await self.queue.wait(ctl.client, target_s)
            return False
        m.labels(ctl.priority, "late").inc()
        return True

    @staticmethod
    def verdict(forecast: float | None, target_s: float, priority: str) -> str:
        """What :meth:`admit` would do, in a word (the dry run's ``admission``): ``on_time``,
        ``shed``, ``queued`` or ``late``."""
        if forecast is None or not math.isfinite(forecast) or forecast <= target_s:
            return "on_time"
        return {"sheddable": "shed", "critical": "queued"}.get(priority, "late")
