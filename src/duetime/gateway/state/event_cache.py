"""An instance's prefix cache as its KV events tell it (the *precise* source), kept in the
instance's shadow replica.

Without events the replica is the gateway's *estimate* of the cache: it caches the blocks of
the requests this gateway sent there (:mod:`duetime.gateway.state.shadow`). With ``kv_events`` in
the pool config, vLLM's own events correct it, on the event loop thread, before each decision
and each dispatch (:meth:`EventCache.apply`):

* ``BlockStored`` blocks, as gateway keys (:class:`~duetime.gateway.state.kv_events.CacheMirror`),
  are cached in the replica (``Engine.cache_store``): blocks of other clients' requests too;
* ``BlockRemoved`` ones leave it (``Engine.cache_drop``): evictions the replica did not
  predict;
* ``AllBlocksCleared`` (a cache reset, a restart of the instance, or a gap in the events that
  replay could not fill) empties it.

What the gateway predicts itself (a request it routed caches its prompt's blocks) stands
until events confirm it: blocks of a request's prompt that no event has reported
``expire_s`` after its first token (vLLM publishes them at the step that computes them)
leave the replica. While the events are not live (never received, or the connection is down:
an instance restarting), nothing expires and the replica is the estimate again; requests
never wait for events.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from duetime.engine.engine import Engine
from duetime.gateway.config import KvEventsSpec
from duetime.gateway.state.kv_events import CacheMirror, KvEventSubscriber
from duetime.gateway.state.lifecycle import Attempt, Subscriber

log = logging.getLogger("duetime.gateway")


class EventCache(Subscriber):
    """One instance's KV-event subscription, its mirror of the engine's hashes, and the
    predictions awaiting confirmation (a lifecycle subscriber: a first token of an attempt in
    the replica is such a prediction)."""

    def __init__(self, name: str, spec: KvEventsSpec) -> None:
        self.name = name
        self.spec = spec
        self.subscriber = KvEventSubscriber(spec.endpoint, replay_endpoint=spec.replay,
                                            topic=spec.topic, name=name)
        self.mirror: CacheMirror | None = None
        self._pending: deque[tuple[float, Sequence[int]]] = deque()
        self.stored = self.removed = self.cleared = self.expired = 0

    def start(self) -> None:
        self.subscriber.start()

    def close(self) -> None:
        self.subscriber.close()

    @property
    def live(self) -> bool:
        """Events are arriving: the subscription is connected and has delivered a batch."""
        sub = self.subscriber
        return sub.connected and sub.batches > 0

    def on_first_token(self, a: Attempt) -> None:
        f = a.flight
        if f.shadowed and f.first_token is not None:
            self.predicted(f.hashes, f.first_token)

    def predicted(self, keys: Sequence[int] | None, now: float) -> None:
        """A request's prompt blocks were computed at ``now`` (its first token): the replica
        cached them; events must confirm them within ``expire_s``."""
        if keys is not None and len(keys):
            tolist = getattr(keys, "tolist", None)  # (numpy keys: ints for the mirror's dict)
            self._pending.append((now + self.spec.expire_s,
                                  tolist() if tolist is not None else keys))

    def apply(self, engine: Engine, now: float) -> None:
        """Bring the replica's cache up to the events received, then expire the predictions
        that no event confirmed (only while events are live)."""
        bs = engine.config.block_size
        if self.mirror is None or self.mirror.block_size != bs:
            self.mirror = CacheMirror(bs)
        mirror = self.mirror
        for _seq, _ts, events in self.subscriber.drain():
            change = mirror.apply(events)
            if change.cleared:
                self.cleared += 1
                engine.cache_clear()
                self._pending.clear()
            if change.removed:
                self.removed += engine.cache_drop(change.removed)
            if change.stored:
                self.stored += engine.cache_store(change.stored)
        pending = self._pending
        if not pending or not self.live:
            return
        while pending and pending[0][0] <= now:
            _, keys = pending.popleft()
            gone = [k for k in keys if k not in mirror]
            if gone:
                self.expired += engine.cache_drop(gone)

    def describe(self) -> dict[str, object]:
        sub = self.subscriber
        return {"endpoint": self.spec.endpoint, "live": self.live, "connected": sub.connected,
                "batches": sub.batches, "events": sub.events, "replayed": sub.replayed,
                "lost_gaps": sub.lost_gaps, "restarts": sub.restarts,
                "bad_payloads": sub.bad_payloads,
                "mirrored_blocks": 0 if self.mirror is None else len(self.mirror),
                "stored": self.stored, "removed": self.removed, "cleared": self.cleared,
                "expired": self.expired}
