"""A stepping engine whose requests can be aborted and corrected while it runs.

:class:`duetime.engine.Engine` models an instance that is left alone: requests join, run and
finish by the rules. A live server needs two more operations, both of which vLLM has and the
stepping API does not:

* ``abort``: a client went away (or the gateway saw the request finish): the request leaves
  the batch at once and frees its KV blocks (vLLM's ``abort_requests``);
* ``observe``: the gateway's shadow replica learns, from the streamed tokens, how far a request
  really got (its prefill is done; it has produced ``n`` tokens) and moves the replica there.

Both work on the compiled engine's arrays (layout in :mod:`duetime.engine.kernel`) and keep
its invariants: running rows hold ``ceil(computed / block_size)`` blocks, free blocks plus held
blocks equal the cache, a waiting request holds none, at most ``max_num_seqs`` run. Tested in
``tests/test_emulator_live.py``. (They would sit naturally on ``Engine`` itself; they live here
so the engine package stays the pure rules.)
"""

from __future__ import annotations

import numpy as np

from duetime.engine import kernel as kn
from duetime.engine.compiled import Engine


class LiveEngine(Engine):
    """:class:`~duetime.engine.Engine` plus ``abort``, ``observe`` and ``set_clock``."""

    def has(self, request_id: str) -> bool:
        """Whether the request is in the engine and not finished."""
        r = self._rows.get(request_id)
        return r is not None and not self._req[r, kn.DONE]

    def output_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Output tokens of these rows (as returned by :meth:`add`), one vector read."""
        return self._req[rows, kn.OUTPUT]

    def row(self, request_id: str) -> int:
        return self._rows[request_id]

    def known(self, request_id: str) -> bool:
        """Whether the id was ever used here (ids are never reused, even when finished)."""
        return request_id in self._rows

    @property
    def rows_used(self) -> int:
        return len(self._ids)

    def compact(self) -> dict[str, int]:
        """Forget finished requests (their rows are otherwise kept forever) and return the new
        row of every live request. Scheduler state and order are unchanged."""
        nrun = int(self._st[kn.NRUN])
        run_rows = self._run[:nrun].copy()
        n_q = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        wait_rows = self._wq[(h + np.arange(c)) % n_q] if c else np.zeros(0, dtype=np.int64)
        live = np.concatenate((run_rows, wait_rows))
        n = max(256, 2 * len(live))
        req = np.zeros((n, 6), dtype=np.int64)
        req[:len(live)] = self._req[live]
        stamps = np.full((n, 2), np.nan)
        stamps[:len(live)] = self._stamps[live]
        pred = np.zeros(n, dtype=np.int64)
        pred[:len(live)] = self._pred[live]
        arrival = np.zeros(n)
        arrival[:len(live)] = self._arrival[live]
        ids = [self._ids[r] for r in live.tolist()]
        self._req, self._stamps, self._pred, self._arrival = req, stamps, pred, arrival
        self._run = np.zeros(n, dtype=np.int64)
        self._run[:nrun] = np.arange(nrun)
        self._wq = np.zeros(n, dtype=np.int64)
        self._wq[:c] = np.arange(nrun, nrun + c)
        self._st[kn.WH] = 0
        self._work = np.zeros((2, n), dtype=np.int64)
        self._ids = ids
        self._rows = {rid: i for i, rid in enumerate(ids)}
        return dict(self._rows)

    def set_clock(self, t: float) -> None:
        """Move the clock forward to ``t`` (a busy engine too: the next step starts then, e.g.
        when the server woke late). Never backwards."""
        if t > self._clock[0]:
            self._clock[0] = t

    # -- surgery ----------------------------------------------------------------------------------

    def _remove_running(self, r: int) -> bool:
        nrun = int(self._st[kn.NRUN])
        run = self._run
        hit = np.flatnonzero(run[:nrun] == r)
        if hit.size == 0:
            return False
        i = int(hit[0])
        run[i:nrun - 1] = run[i + 1:nrun].copy()
        self._st[kn.NRUN] = nrun - 1
        self._st[kn.FREE] += self._req[r, kn.BLOCKS]
        self._req[r, kn.BLOCKS] = 0
        return True

    def _remove_waiting(self, r: int) -> bool:
        n = self._wq.shape[0]
        h, c = int(self._st[kn.WH]), int(self._st[kn.WC])
        if c == 0:
            return False
        idx = (h + np.arange(c)) % n
        items = self._wq[idx]
        hit = np.flatnonzero(items == r)
        if hit.size == 0:
            return False
        rest = np.delete(items, int(hit[0]))
        self._wq[idx[:c - 1]] = rest
        self._st[kn.WC] = c - 1
        return True

    def abort(self, request_id: str) -> bool:
        """Take a request out of the batch now (its blocks are freed; it counts as finished at
        the current clock). Returns False if it was unknown or already finished."""
        r = self._rows.get(request_id)
        if r is None or self._req[r, kn.DONE]:
            return False
        if not self._remove_running(r):
            self._remove_waiting(r)
        self._req[r, kn.DONE] = 1
        self._stamps[r, 1] = self._clock[0]
        return True

    def observe(self, request_id: str, output_tokens: int) -> bool:
        """The request has really produced ``output_tokens`` (>= 1) tokens: its prefill is done
        and it decodes from there. A waiting request is moved to the tail of the running order
        (if a seat and its blocks are free; otherwise the replica keeps its own view). Returns
        whether the replica changed."""
        r = self._rows.get(request_id)
        if r is None or output_tokens < 1 or self._req[r, kn.DONE]:
            return False
        req = self._req
        prompt = int(req[r, kn.PROMPT])
        if prompt + output_tokens >= self.config.max_model_len:
            return False
        computed = prompt + output_tokens - 1
        if req[r, kn.OUTPUT] == output_tokens and req[r, kn.COMP] == computed:
            return False
        bs = self.config.block_size
        need = -(-computed // bs)
        nrun = int(self._st[kn.NRUN])
        running = bool(np.any(self._run[:nrun] == r))
        delta = need - int(req[r, kn.BLOCKS])
        if delta > self._st[kn.FREE]:
            return False
        if not running:
            if nrun >= self.config.max_num_seqs or not self._remove_waiting(r):
                return False
            self._run[nrun] = r
            self._st[kn.NRUN] = nrun + 1
        self._st[kn.FREE] -= delta
        req[r, kn.BLOCKS] = need
        req[r, kn.COMP] = computed
        req[r, kn.OUTPUT] = output_tokens
        if req[r, kn.STOP] <= output_tokens:
            req[r, kn.STOP] = output_tokens + 1
        if self._stamps[r, 0] != self._stamps[r, 0]:
            self._stamps[r, 0] = self._clock[0]
        return True

    def observe_many(self, rows: np.ndarray, output_tokens: np.ndarray) -> int:
        """:meth:`observe` for many requests at once, vectorised, for those already running in
        the engine (others are left alone: correct them one by one with :meth:`observe`).
        Returns how many were corrected."""
        nrun = int(self._st[kn.NRUN])
        if nrun == 0 or rows.size == 0:
            return 0
        req = self._req
        keep = (np.isin(rows, self._run[:nrun]) & (output_tokens >= 1)
                & (req[rows, kn.DONE] == 0))
        rows, outs = rows[keep], output_tokens[keep]
        comp = req[rows, kn.PROMPT] + outs - 1
        keep = (comp + 1 < self.config.max_model_len) & (
            (req[rows, kn.OUTPUT] != outs) | (req[rows, kn.COMP] != comp))
        if not keep.any():
            return 0
        rows, outs, comp = rows[keep], outs[keep], comp[keep]
        bs = self.config.block_size
        need = -(-comp // bs)
        delta = int((need - req[rows, kn.BLOCKS]).sum())
        if delta > self._st[kn.FREE]:
            return 0
        self._st[kn.FREE] -= delta
        req[rows, kn.BLOCKS] = need
        req[rows, kn.COMP] = comp
        req[rows, kn.OUTPUT] = outs
        req[rows, kn.STOP] = np.maximum(req[rows, kn.STOP], outs + 1)
        return int(rows.size)

    def check_invariants(self) -> None:
        """Raise AssertionError if the block accounting or the queues are inconsistent
        (tests)."""
        nrun = int(self._st[kn.NRUN])
        rows = self._run[:nrun]
        held = int(self._req[rows, kn.BLOCKS].sum())
        assert held + int(self._st[kn.FREE]) == self.config.num_gpu_blocks, "blocks leak"
        assert nrun <= self.config.max_num_seqs
        assert len(set(rows.tolist())) == nrun
        waiting = self.waiting_ids()
        assert not set(waiting) & set(self.running_ids())
        for rid in waiting:
            assert self._req[self._rows[rid], kn.BLOCKS] == 0
        bs = self.config.block_size
        for r in rows.tolist():
            assert self._req[r, kn.BLOCKS] == -(-int(self._req[r, kn.COMP]) // bs)
            assert not self._req[r, kn.DONE]


_warm = False


def warm_up() -> None:
    """Load (or compile) the engine's and the forecaster's kernels once per process, so the
    first real step or forecast does not pay for it (numba caches compiled code on disk; loading
    it still takes a fraction of a second)."""
    global _warm
    if _warm:
        return
    from duetime.engine.batch_time import Sfs6
    from duetime.engine.config import SchedulerConfig
    from duetime.engine.forecasting import forecast

    eng = LiveEngine(SchedulerConfig(), Sfs6(c0=1e-3, cp=1e-6, cpsq=0.0, cd=1e-5, cs=0.0,
                                             css=0.0))
    eng.add("a", 100, 3)
    eng.add("b", 50, 2)
    eng.step()
    eng.observe("b", 1)
    eng.run_until(1.0)
    eng.add("c", 10, 2)
    forecast(eng.snapshot(), 64)
    eng.abort("c")
    _warm = True
