"""Published snapshots: an instance that serves ``GET /snapshot`` (the emulator; a patched
vLLM) tells the gateway its exact state.

The poller fetches one every ``state.scrape_interval_s``; it is moved onto the gateway's clock
(the response's ``x-duetime-clock`` header gives the instance's clock; the offset is taken at
the middle of the fetch) and, when read, merged with what the gateway did since: requests it
completed are dropped, requests it dispatched that the snapshot does not hold yet are appended
(waiting, or running if their first token came).

A decision forecasts from that merged state through one forecaster kept per instance
(:meth:`PublishedSnapshots.forecaster`: a :class:`~duetime.engine.live_forecast.RowState`
whose rows are the published requests, written once per snapshot, and the gateway's
dispatches since, rewritten per ledger change): no snapshot or forecaster is built per decision
and a re-dated state keeps its base (``benchmarks/instructions.py``'s ``gateway-published``).
With prefix caching it is the merged snapshot's own forecaster (the rows hold no cache).
"""

from __future__ import annotations

import math

import numpy as np

from duetime.engine import scheduler_kernel as kn
from duetime.engine.forecasting import Forecaster, forecaster
from duetime.engine.live_forecast import RowState
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
        # the forecasts' rows: the state, the (snapshot, ledger) versions its rows hold, the
        # published requests' ids (running, waiting, all) and the ledger and time last asked
        self._rows: RowState | None = None
        self._rows_key: tuple[int, int] | None = None
        self._ids: tuple[list[str], list[str], set[str]] = ([], [], set())
        self._all = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._asked: tuple[float, Ledger] | None = None

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

    def forecaster(self, now: float, ledger: Ledger) -> Forecaster:
        """The forecaster of :meth:`merged`'s state, dated ``max(snapshot time, now)`` (not
        rounded to the millisecond as the merged snapshot is: its re-dating is free). Its
        forecasts equal ``forecaster(self.merged(now, ledger))``'s."""
        pub = self._snap
        assert pub is not None
        if pub.config.enable_prefix_caching:
            return forecaster(self.merged(now, ledger))
        rows = self._rows
        key = (self._version, ledger.version)
        if key != self._rows_key:
            fresh = self._rows_key is None or self._rows_key[0] != self._version
            if rows is None or (fresh and (rows.config != pub.config or rows.model != pub.model)):
                rows = self._rows = RowState(pub.config, pub.model, self._asked_snapshot)
            self._fill(rows, pub, ledger, fresh=fresh)
            self._rows_key = key
        self._asked = (now, ledger)
        rows.date(max(pub.time, now))
        return rows.forecaster()

    def _asked_snapshot(self) -> Snapshot:
        """The state the rows hold, as a snapshot (for a forecast's exact fallback replay)."""
        assert self._asked is not None
        now, ledger = self._asked
        snap = self.merged(now, ledger)
        return snap if snap.time == self._rows.time else snap.at(self._rows.time)

    def _fill(self, rows: RowState, pub: Snapshot, ledger: Ledger, *, fresh: bool) -> None:
        """Write the merged state's rows: with ``fresh``, the published requests' (running,
        then waiting); always, the order without the ended ones and the flights the snapshot
        does not hold after them, as :meth:`merged` appends them."""
        run_t, wait_t = pub.running_table, pub.waiting_table
        n_r, n_w = len(run_t), len(wait_t)
        if fresh:
            req, pred = rows.rows(n_r + n_w + 8)
            req[:n_r, kn.PROMPT], req[:n_r, kn.COMP] = run_t.prompt, run_t.computed
            req[:n_r, kn.OUTPUT], pred[:n_r] = run_t.output, run_t.predicted
            w = slice(n_r, n_r + n_w)
            req[w, kn.PROMPT], req[w, kn.COMP] = wait_t.prompt, 0
            req[w, kn.OUTPUT], pred[w] = wait_t.output, wait_t.predicted
            ids_r, ids_w = run_t.ids, wait_t.ids
            self._ids = (ids_r, ids_w, set(ids_r) | set(ids_w))
            self._all = (np.arange(n_r, dtype=np.int64),
                         np.arange(n_r, n_r + n_w, dtype=np.int64))
        ids_r, ids_w, held = self._ids
        run, wait = self._all
        ended = ledger.ended
        if ended:
            if any(i in ended for i in ids_r):
                run = run[[i not in ended for i in ids_r]]
            if any(i in ended for i in ids_w):
                wait = wait[[i not in ended for i in ids_w]]
        extra = [f for f in ledger.flights.values() if f.id not in held]
        extra_r: list[int] = []
        extra_w: list[int] = []
        if extra:
            req, pred = rows.rows(n_r + n_w + len(extra))
            r = n_r + n_w
            for f in extra:  # (as merged's _append: running ones with their tokens so far)
                out = f.tokens if f.first_token else 0
                req[r, kn.PROMPT], req[r, kn.OUTPUT], pred[r] = f.prompt_tokens, out, f.predicted
                req[r, kn.COMP] = f.prompt_tokens + out - 1 if f.first_token else 0
                (extra_r if f.first_token else extra_w).append(r)
                r += 1
        rows.order(run, wait, extra_r, extra_w)


def _append(t: RequestTable, flights: list[Flight], *, running: bool) -> RequestTable:
    out = np.array([f.tokens if running else 0 for f in flights], dtype=np.int64)
    prompt = np.array([f.prompt_tokens for f in flights], dtype=np.int64)
    comp = prompt + out - 1 if running else np.zeros(len(flights), dtype=np.int64)
    return RequestTable(t.ids + [f.id for f in flights],
                        np.concatenate((t.prompt, prompt)), np.concatenate((t.computed, comp)),
                        np.concatenate((t.output, out)),
                        np.concatenate((t.predicted, [f.predicted for f in flights])),
                        np.concatenate((t.arrival, [f.dispatched for f in flights])))
