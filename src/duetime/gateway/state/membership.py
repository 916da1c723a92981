"""The pool's members now: instances join, serve, drain and leave while the gateway serves.

A pool is not a fixed list: an edited pool config, a DNS name whose addresses change (a
headless Service) or an autoscaler adds and removes instances. Each member has a
:class:`Phase`:

- **joining**: added while serving, out of rotation until its first health probe passes (an
  instance that is still loading its model must not get requests);
- **serving**: in rotation (the instances of the pool the gateway started with begin here);
- **draining**: removed: no new requests (not a candidate, not retried), its requests in
  flight finish; once none is left it *leaves* and its state is dropped.

:class:`Membership` keeps the members in order and the serving ones by model (what the intake
reads), counts the changes (``duetime_membership_changes_total``, ``duetime_instances``) and
tells its listeners (the pollers, the picker's endpoints, the dashboard, the service that runs
embedded instances) of each change. It decides nothing: the gateway's reconfiguration and
the pollers' probes drive it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from duetime.gateway.config import adapter_id
from duetime.gateway.prometheus import GatewayMetrics

if TYPE_CHECKING:
    from duetime.gateway.state.instance import InstanceState

log = logging.getLogger("duetime.gateway")

RECENT_CHANGES = 50  # changes kept for /duetime/instances


class Phase(enum.Enum):
    JOINING = "joining"
    SERVING = "serving"
    DRAINING = "draining"


CHANGES = ("join", "ready", "update", "drain", "leave", "adapters")  # (adapters: /v1/models)


@dataclass(frozen=True, slots=True)
class Change:
    """One membership change: ``change`` (one of :data:`CHANGES`) of ``instance`` at ``t``
    (wall clock), and why (the source: ``config``, ``dns``, ``store``...)."""

    t: float
    change: str
    instance: str
    why: str = ""

    def describe(self) -> dict[str, object]:
        return {"t": round(self.t, 3), "change": self.change, "instance": self.instance,
                "why": self.why}


Listener = Callable[[Change, "InstanceState"], None]


class Membership:
    """The members, in the order they joined; :attr:`by_model`: each model's serving ones
    (a model whose instances all joined and none passed a probe yet maps to an empty list:
    its requests get a 503, not a 404)."""

    def __init__(self, instances: list[InstanceState], metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.members: dict[str, InstanceState] = {}
        self.by_model: dict[str, list[InstanceState]] = {}
        self.serving: list[InstanceState] = []
        self.listeners: list[Listener] = []
        self.recent: deque[Change] = deque(maxlen=RECENT_CHANGES)
        self.version = 0  # changes so far
        self._adapter_ids: tuple[int, dict[str, int]] = (-1, {})  # (at version, ids)
        for s in instances:
            s.phase = Phase.SERVING
            self.members[s.name] = s
        self._index()

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(list(self.members.values()))

    def __len__(self) -> int:
        return len(self.members)

    def get(self, name: str) -> InstanceState | None:
        return self.members.get(name)

    def _index(self) -> None:
        """The serving lists rebuilt (new lists: a request's candidates taken before keep
        theirs) and the phase gauge set."""
        by_model: dict[str, list[InstanceState]] = {}
        for s in self.members.values():
            if s.phase is not Phase.DRAINING:
                by_model.setdefault(s.model, [])
        self.serving = [s for s in self.members.values() if s.phase is Phase.SERVING]
        for s in self.serving:
            by_model[s.model].append(s)
        self.by_model = by_model
        for phase in Phase:
            self.metrics.members.labels(phase.value).set(
                sum(s.phase is phase for s in self.members.values()))

    @property
    def adapter_ids(self) -> dict[str, int]:
        """Each LoRA adapter a member serves (:attr:`InstanceState.adapters`: listed by its
        ``/v1/models``, else by its config), by name, with the gateway's id of it
        (:func:`~duetime.gateway.config.adapter_id`); rebuilt after a change."""
        at, ids = self._adapter_ids
        if at != self.version:
            ids = {a: adapter_id(a) for s in self.members.values() for a in s.adapters}
            self._adapter_ids = (self.version, ids)
        return ids

    def adapters_listed(self, s: InstanceState, names: tuple[str, ...]) -> None:
        """The member's ``/v1/models`` listed these adapters: they are what it serves from now
        on (a change when they differ from what it served)."""
        before = s.adapters
        s.loaded_adapters = names
        if names != before:
            self._changed("adapters", s, f"/v1/models lists {', '.join(names) or 'none'}")

    def _changed(self, change: str, s: InstanceState, why: str) -> None:
        c = Change(time.time(), change, s.name, why)
        self.version += 1
        self.recent.append(c)
        self.metrics.membership.labels(change).inc()
        log.info(f"instance {change}", extra={"fields": {
            "event": f"member_{change}", "instance": s.name, "model": s.model, "why": why,
            "url": s.instance.url}})
        for listen in list(self.listeners):
            listen(c, s)

    # -- the changes ----------------------------------------------------------------------------

    def join(self, s: InstanceState, why: str) -> None:
        """A new member, out of rotation until :meth:`ready`."""
        if s.name in self.members:
            raise ValueError(f"instance {s.name!r} is a member already")
        s.phase = Phase.JOINING
        self.members[s.name] = s
        self._index()
        self._changed("join", s, why)

    def ready(self, s: InstanceState, why: str = "health probe passed") -> None:
        """A joining member passed its health probe: in rotation."""
        if s.phase is not Phase.JOINING or self.members.get(s.name) is not s:
            return
        s.phase = Phase.SERVING
        self._index()
        self._changed("ready", s, why)

    def updated(self, s: InstanceState, why: str, *, rejoin: bool) -> None:
        """A member's instance changed in place (``rejoin``: its address did, so it is out of
        rotation again until its new address passes a probe)."""
        if rejoin:  # (serving, or draining and wanted back)
            s.phase = Phase.JOINING
        self._index()
        self._changed("update", s, why)

    def drain(self, s: InstanceState, why: str) -> None:
        """No new requests for ``s``; it leaves once its requests in flight end."""
        if s.phase is Phase.DRAINING or self.members.get(s.name) is not s:
            return
        s.phase = Phase.DRAINING
        self._index()
        self._changed("drain", s, why)

    def leave(self, s: InstanceState, why: str = "drained") -> None:
        """``s`` is gone: its state is dropped (by the listeners)."""
        if self.members.get(s.name) is not s:
            return
        del self.members[s.name]
        self._index()
        self._changed("leave", s, why)

    def describe(self) -> dict[str, object]:
        """For ``GET /duetime/instances``: members by phase and the latest changes."""
        return {"version": self.version,
                "phases": {p.value: [s.name for s in self.members.values() if s.phase is p]
                           for p in Phase},
                "recent": [c.describe() for c in self.recent]}
