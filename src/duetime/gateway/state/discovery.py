"""Where the pool's members come from while serving: the config (:meth:`Discovery.apply`),
DNS groups looked up every ``discovery.dns_interval_s`` and InferencePools' pods watched
(:mod:`duetime.gateway.dns`, :mod:`duetime.gateway.kubernetes`). Each source yields the
instances the pool should have; :meth:`Discovery.sync` turns the difference into membership
changes (:mod:`.membership`): new ones join, missing ones drain, changed ones are
reconfigured in place."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from duetime.gateway.changes import (
    Endpoint,
    InstanceChanges,
    groups,
    instance_changes,
    members_of,
    moved,
)
from duetime.gateway.config import Instance, Pool
from duetime.gateway.dns import DnsLookup, LookupFailed, endpoint_address
from duetime.gateway.kubernetes import PodWatch
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Change, Membership, Phase

log = logging.getLogger("duetime.gateway")


class Discovery:
    """The pool's members kept as its sources say. ``first``: the instances the membership
    started with; ``make``: a new member's live state; ``started()``: whether the gateway
    runs (a new member's KV-event subscription starts only then)."""

    def __init__(self, pool: Pool, membership: Membership, first: list[Instance],
                 make: Callable[[Instance], InstanceState],
                 started: Callable[[], bool]) -> None:
        self.pool = pool
        self.membership = membership
        self.make = make
        self.started = started
        # each member's instance as configured (its own may have adopted what it reported
        # since), and each group's members as last discovered (DNS, Kubernetes)
        self.configured: dict[str, Instance] = {i.name: i for i in first}
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.pod_watches: dict[str, PodWatch] = {}
        self.dns = DnsLookup(pool.discovery)
        self._dns_task: asyncio.Task[None] | None = None
        membership.listeners.append(self._on_change)

    def _on_change(self, c: Change, s: InstanceState) -> None:
        if c.change == "leave":  # (gone: a later one of its name is configured afresh)
            self.configured.pop(s.name, None)

    async def start(self) -> None:
        await self.resolve_groups()
        self._watch()

    async def close(self) -> None:
        for watch in self.pod_watches.values():
            watch.stop()
        self.pod_watches.clear()
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._dns_task
            self._dns_task = None

    def apply(self, pool: Pool, why: str) -> InstanceChanges:
        """The pool's new config (checked by the caller): its instances, and its groups at
        the endpoints last discovered; new groups are looked up from now on."""
        self.pool = pool
        changes = self.sync(why)
        if self.started():
            self._watch()
        return changes

    def sync(self, why: str) -> InstanceChanges:
        """Make the members the pool's (groups at their last endpoints): new ones join,
        missing ones drain, changed ones are reconfigured (one that moved, or was draining,
        joins again: out of rotation until a probe passes)."""
        wanted = members_of(self.pool, self.endpoints)
        live = [self.configured[s.name] for s in self.membership
                if s.phase is not Phase.DRAINING]
        changes = instance_changes(live, wanted)
        for i in changes.added:
            s = self.membership.get(i.name)
            if s is None:
                self._join(i, why)
            else:  # (removed, not gone yet, and back: it joins again as configured now)
                self._reconfigure(s, i, why, rejoin=True)
        for i in changes.changed:
            s = self.membership.get(i.name)
            assert s is not None
            self._reconfigure(s, i, why, rejoin=moved(self.configured[i.name], i))
        for name in changes.removed:
            s = self.membership.get(name)
            assert s is not None
            self.membership.drain(s, why)
        return changes

    def _reconfigure(self, s: InstanceState, i: Instance, why: str, *, rejoin: bool) -> None:
        self.configured[i.name] = i
        had_events = s.events
        s.reconfigure(i)
        if s.events is not had_events and s.events is not None and self.started():
            s.events.start()
        self.membership.updated(s, why, rejoin=rejoin)

    def _join(self, i: Instance, why: str) -> None:
        s = self.make(i)
        self.configured[i.name] = i
        # its TTFT correction starts from the least of its serving siblings': an optimistic
        # start gets it tried, and its own first tokens then correct it (a pessimistic one
        # starved it: it learns only from the requests it gets)
        siblings = [o for o in self.membership.serving if o.model == i.model]
        if siblings:
            s.ttft_correction.learn_from(min((o.ttft_correction for o in siblings),
                                             key=lambda c: c.factor))
        self.membership.join(s, why)
        if s.events is not None and self.started():
            s.events.start()

    # -- the sources ------------------------------------------------------------------------------

    async def resolve_groups(self) -> bool:
        """Look up the pool's DNS groups once; their members follow. Returns whether any
        group's addresses changed."""
        changed = False
        for g in groups(self.pool):
            host, port = endpoint_address(g.url or "")
            try:
                found = await self.dns.addresses(host, port)
            except LookupFailed as e:
                log.warning("DNS group not looked up: members kept", extra={"fields": {
                    "event": "dns_failed", "group": g.name, "error": str(e)}})
                continue
            eps: list[Endpoint] = [(a, a, None) for a in found]
            if self.endpoints.get(g.name) != eps:
                self.endpoints[g.name] = eps
                changed = True
        live = {g.name for g in self.pool.instances if g.discover != "none"}
        for name in [n for n in self.endpoints if n not in live]:
            del self.endpoints[name]
            changed = True
        if changed:
            self.sync("dns")
        return changed

    def _watch(self) -> None:
        """The DNS loop (while the pool has DNS groups) and a watch of each InferencePool
        group's pods (the Kubernetes API, in a thread; a group gone has its watch stopped)."""
        if groups(self.pool) and (self._dns_task is None or self._dns_task.done()):
            self._dns_task = asyncio.get_running_loop().create_task(self._dns_loop())
        wanted = {g.name: g for g in groups(self.pool, "kubernetes")}
        for name in [n for n in self.pod_watches if n not in wanted]:
            self.pod_watches.pop(name).stop()
        for name, g in wanted.items():
            if name not in self.pod_watches:
                self.pod_watches[name] = PodWatch(
                    g, self.pool.discovery.kubeconfig,
                    functools.partial(self._pods_changed, name)).start()

    def _pods_changed(self, group: str, endpoints: list[Endpoint]) -> None:
        """An InferencePool group's ready pods now (on the event loop)."""
        if group in self.pod_watches and self.endpoints.get(group) != endpoints:
            self.endpoints[group] = endpoints
            self.sync("kubernetes")

    async def _dns_loop(self) -> None:
        while groups(self.pool):
            await asyncio.sleep(self.pool.discovery.dns_interval_s)
            await self.resolve_groups()
