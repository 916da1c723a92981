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
each attempt's end releases one waiter (whether or not the gateway's own load is counted). Whom
it releases is :class:`~duetime.policy.admission_order.AdmissionOrder`'s: the highest priority
band, then the client with the least attained service (tokens served recently, fed by the same
lifecycle: a served attempt's prompt at its first token, its output at its end), then the
earliest deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from duetime.gateway.intake.controls import PRIORITIES, Controls
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.policy.admission_order import AdmissionOrder, Waiting, band_of
from duetime.web.errors import ApiError

KEY_PREFIX = "key:"  # a client known by its API key (the intake's ``client``), else its address


def client_of(a: Attempt) -> str | None:
    """The client an attempt's tokens are charged to, as the intake names it (``key:NAME``, else
    its address); None for an attempt that names none (the picker's: no client is known)."""
    return a.client or None


def key_label(client: str) -> str:
    """The ``key`` label of a client's series: its API key's name; empty for a client without
    one (addresses would make a series per address)."""
    return client.removeprefix(KEY_PREFIX) if client.startswith(KEY_PREFIX) else ""


class AdmissionQueue(Subscriber):
    """Critical requests waiting for an instance that can meet their target: at most
    ``max_queued``, released one at a time whenever capacity may have freed (:meth:`poke`: a
    first token, a request's end) in :class:`AdmissionOrder`'s order — priority band, then the
    client with the least attained service (decayed with ``half_life_s``), then the earliest
    deadline. A newcomer to a full queue displaces the latest-deadline waiter of a more served
    client (:meth:`AdmissionOrder.victim`), which then goes on as one turned away would."""

    def __init__(self, max_queued: int, metrics: GatewayMetrics, half_life_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queued = max_queued
        self.metrics = metrics
        self.clock = clock
        self.order: AdmissionOrder[asyncio.Future[bool]] = AdmissionOrder(half_life_s)
        metrics.attained.read = self.attained

    def __len__(self) -> int:
        return len(self.order)

    def attained(self) -> dict[str, float]:
        """Attained service now, in tokens, by ``key`` label (clients without a key summed)."""
        out: dict[str, float] = {}
        for client, v in self.order.service.values(self.clock()).items():
            label = key_label(client)
            out[label] = out.get(label, 0.0) + v
        return out

    async def wait(self, client: str, timeout_s: float, *, priority: str = "critical",
                   deadline: float | None = None) -> bool:
        """Wait for a turn (True) or until ``timeout_s`` (False); False at once when full (and
        no waiter to displace), or when displaced. ``deadline``: the request's, on this
        queue's clock (None: ``timeout_s`` from now), which orders it within its client."""
        if timeout_s <= 0 or not math.isfinite(timeout_s):
            return False
        now = self.clock()
        rank = band_of(priority, PRIORITIES)
        if len(self.order) >= self.max_queued and not self._displace(client, rank):
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = self.order.push(client, rank, now + timeout_s if deadline is None else deadline,
                                fut)
        self.metrics.queued.set(len(self.order))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            return fut.done() and not fut.cancelled() and fut.result()  # (released just then)
        finally:
            self._leave(entry, now)

    def _displace(self, client: str, rank: int) -> bool:
        """Make room for a newcomer by displacing a more served client's waiter (False: none)."""
        victim = self.order.victim(client, rank) if self.max_queued > 0 else None
        if victim is None:
            return False
        self.order.remove(victim)
        if not victim.payload.done():
            victim.payload.set_result(False)
        return True

    def _leave(self, entry: Waiting[asyncio.Future[bool]], since: float) -> None:
        self.order.remove(entry)  # (no-op if released or displaced)
        self.metrics.queued.set(len(self.order))
        self.metrics.admission_wait.labels(key_label(entry.key)).observe(self.clock() - since)

    def on_first_token(self, a: Attempt) -> None:
        client = client_of(a)
        if client is not None:  # (the prompt is served: prefill done)
            self.order.served(client, a.flight.prompt_tokens, self.clock())
        self.poke()  # (a prefill is done: the instance has room again)

    def on_end(self, a: Attempt) -> None:
        client = client_of(a)
        if client is not None and a.flight.first_token is not None:
            out = a.output_tokens if a.output_tokens is not None else a.flight.tokens
            self.order.served(client, out, self.clock())
        self.poke()  # (a request left the instance)

    def poke(self) -> None:
        """Release the next waiter in the order (it leaves the queue now; None waiting: no-op)."""
        while (e := self.order.pop()) is not None:
            if not e.payload.done():
                e.payload.set_result(True)
                return


class Shed(Exception):
    """A request refused: no instance can meet its target now (a sheddable one), or none could
    before its target was spent in the queue (a critical one, ``admission.expired: reject``)."""

    def __init__(self, retry_after_s: float, forecast_s: float, target_s: float,
                 priority: str = "sheddable") -> None:
        super().__init__("shed")
        self.retry_after_s = retry_after_s
        self.forecast_s = forecast_s
        self.target_s = target_s
        self.priority = priority


def shed_error(e: Shed) -> ApiError:
    """The 429 a shed request gets, with its ``Retry-After`` header (the relay and the picker
    answer the same)."""
    what = ("no instance can meet this sheddable request's TTFT target now"
            if e.priority == "sheddable" else
            f"no instance could meet this {e.priority} request's TTFT target before it was "
            "spent in the gateway's queue")
    return ApiError(429, f"{what} (target {e.target_s * 1000:.1f} ms, best forecast "
                    f"{e.forecast_s * 1000:.1f} ms); retry later", code="overloaded",
                    type_="rate_limit_error",
                    headers=[(b"retry-after", str(max(1, math.ceil(e.retry_after_s))).encode())])


class Admission:
    """The admission rule over the queue (none: critical requests never wait)."""

    def __init__(self, queue: AdmissionQueue | None, metrics: GatewayMetrics,
                 expired: str = "late") -> None:
        self.queue = queue
        self.metrics = metrics
        self.expired = expired

    async def admit(self, forecast: float | None, target_s: float, ctl: Controls,
                    waited: bool) -> bool:
        """Whether the request goes to the decision's instance now (True), or was queued and
        must be decided again (False). A forecast that meets the target (or none made): now.
        Otherwise by priority: ``sheddable`` raises :class:`Shed`; ``critical`` waits in the
        queue (once) until released — then it is decided again and goes to the best forecast
        — or until its target is spent or the queue turns it away: then, by
        ``admission.expired``, it goes to the best forecast (``late``) or raises
        :class:`Shed` (``reject``); ``standard`` goes to the best forecast."""
        m = self.metrics.admission
        if forecast is None or not math.isfinite(forecast) or forecast <= target_s:
            m.labels(ctl.priority, "queued" if waited else "on_time").inc()
            return True
        if ctl.priority == "sheddable":
            m.labels(ctl.priority, "shed").inc()
            raise Shed(forecast - target_s, forecast, target_s)
        if ctl.priority == "critical" and self.queue is not None and not waited:
            released = await self.queue.wait(ctl.client, target_s, priority=ctl.priority,
                                             deadline=self._deadline(ctl, target_s))
            if not released and self.expired == "reject":  # (target spent, full, displaced)
                m.labels(ctl.priority, "rejected").inc()
                raise Shed(forecast - max(target_s, 0.0), forecast, ctl.target_s,
                           ctl.priority)
            return False  # (released, or gave up: decide once more either way)
        m.labels(ctl.priority, "late").inc()
        return True

    def _deadline(self, ctl: Controls, target_s: float) -> float | None:
        """The request's end-to-end deadline on the queue's clock, where it has one (None: its
        TTFT target's expiry orders it). ``target_s`` is what is left of ``ctl.target_s``, so
        the request arrived ``ctl.target_s - target_s`` ago."""
        if ctl.deadline_s is None or self.queue is None:
            return None
        return self.queue.clock() - (ctl.target_s - target_s) + ctl.deadline_s

    @staticmethod
    def verdict(forecast: float | None, target_s: float, priority: str) -> str:
        """What :meth:`admit` would do, in a word (the dry run's ``admission``): ``on_time``,
        ``shed``, ``queued`` or ``late``."""
        if forecast is None or not math.isfinite(forecast) or forecast <= target_s:
            return "on_time"
        return {"sheddable": "shed", "critical": "queued"}.get(priority, "late")
