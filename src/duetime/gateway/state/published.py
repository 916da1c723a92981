"""Published snapshots: an instance that serves ``GET /snapshot`` (the emulator; a patched
vLLM) tells the gateway its exact state.

The poller fetches one every ``state.scrape_interval_s``; it is moved onto the gateway's clock
(the response's ``x-duetime-clock`` header gives the instance's clock; the offset is taken at
the middle of the fetch) and, when read, merged with what the gateway did since: requests it
completed are dropped, requests it dispatched that the snapshot does not hold yet are appended
(waiting, or running if their first token came).
"""

from __future__ import annotations

import math

import numpy as np

from duetime.engine.snapshot import RequestTable, Snapshot
from duetime.gateway.state.flight import Flight
from duetime.gateway.state.ledger import Ledger


class PublishedSnapshots:
    """The last snapshot an instance published. ``publishes``: None until known, False once
    the instance answered 404 (never polled again)."""

    def __init__(self, publishes: bool | None) -> None:
        self.publishes = publishes
        self._snap: Snapshot | None = None
        self._at = -math.inf
        self._version = 0
        self._merged: tuple[tuple[int, int], Snapshot] | None = None

    def set(self, snap: Snapshot, instance_clock: float, sent: float, received: float) -> None:
        """A snapshot fetched between ``sent`` and ``received`` (gateway clock) from an instance
        whose clock read ``instance_clock`` when it answered."""
        self._snap = snap.shifted((sent + received) / 2 - instance_clock)
        self._at = received
        self._version += 1
        self.publishes = True

    def fresh(self, now: float, max_age_s: float) -> bool:
        return self._snap is not None and now - self._at <= max_age_s

    def merged(self, now: float, ledger: Ledger) -> Snapshot:
        """The published snapshot with the gateway's changes since, dated no earlier than
        ``now``: a forecast then counts from now, as if nothing progressed since the snapshot
        (conservative by at most its age) — rather than as if the probe had arrived when the
        snapshot was taken (optimistic; an idle instance would forecast a negative TTFT).
        Built once per (snapshot, ledger) version."""
        key = (self._version, ledger.version)
        if self._merged is not None and self._merged[0] == key:
            snap = self._merged[1]
            if snap.time < now - 1e-3:
                snap = snap.at(now)
                self._merged = (key, snap)
            return snap
        pub = self._snap
        assert pub is not None
        ended = ledger.ended

        def keep(t: RequestTable) -> RequestTable:
            if not ended or not any(i in ended for i in t.ids):
                return t
            m = np.array([i not in ended for i in t.ids], dtype=bool)
            return RequestTable([i for i, k in zip(t.ids, m.tolist(), strict=True) if k],
                                t.prompt[m], t.computed[m], t.output[m], t.predicted[m],
                                t.arrival[m])

        run, wait = keep(pub.running_table), keep(pub.waiting_table)
        held = set(run.ids) | set(wait.ids)
        flights = ledger.flights.values()
        extra_r = [f for f in flights if f.id not in held and f.first_token]
        extra_w = [f for f in flights if f.id not in held and not f.first_token]
        if extra_r:
            run = _append(run, extra_r, running=True)
        if extra_w:
            wait = _append(wait, extra_w, running=False)
        snap = Snapshot(pub.config, pub.model, time=max(pub.time, now), running=run,
                        waiting=wait)
        self._merged = (key, snap)
        return snap


def _append(t: RequestTable, flights: list[Flight], *, running: bool) -> RequestTable:
    out = np.array([f.tokens if running else 0 for f in flights], dtype=np.int64)
    prompt = np.array([f.prompt_tokens for f in flights], dtype=np.int64)
    comp = prompt + out - 1 if running else np.zeros(len(flights), dtype=np.int64)
    return RequestTable(t.ids + [f.id for f in flights],
                        np.concatenate((t.prompt, prompt)), np.concatenate((t.computed, comp)),
                        np.concatenate((t.output, out)),
                        np.concatenate((t.predicted, [f.predicted for f in flights])),
                        np.concatenate((t.arrival, [f.dispatched for f in flights])))
