"""Fast replay of the V1 rules: aggregate decode state and event skipping.

Why it is fast. In a step, every decoding request does the same thing: one token, context + 1.
So decoders are not visited one by one. They are kept as aggregates over their *context offset*
``off = C - k`` (k = step index, so a decoder's context at step k is ``off + k``):

* count, Σoff and Σoff², which give the batch-time features of all decoders in O(1)
  (Σc = Σoff + n·k, Σc² = Σoff² + 2k·Σoff + n·k²);
* a histogram of ``off mod block_size``: the decoders that need a new KV block at step k are
  exactly those with ``off ≡ -k``, one lookup;
* a heap of finish steps (a decoder stops at a step known in advance), and the sorted list of
  their positions in the running order.

Requests that are prefilling (or recomputing after preemption) and the waiting queue stay
explicit: there are few of them. A stretch of decode-only steps between two events (a finish,
a KV shortage) is skipped in one go, its duration summed in closed form. Steps whose outcome
depends on the order of individual decoders — KV exhaustion (preemption), or a prefilling
request ahead of decoders taking the whole budget — are rare; they are handed to the reference
step loop on materialised state, so both paths apply literally the same rules.

Each call to :meth:`FastReplay.advance` runs one segment (one step, or a stretch of identical
decode steps) and describes it in a :class:`Segment`, which is what the forecaster needs to
answer further probes without replaying again.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.request import Request
from duetime.engine.scheduler import EngineStuck, ReferenceEngine, blocks_for


@dataclass(slots=True)
class Segment:
    """One step, or ``m`` identical decode-only steps, as seen by a request queued behind.

    ``free_first``/``free_last``: free KV blocks after all allocations of the first/last step.
    ``running_budget``: token budget left after the running phase (the same in every step);
    ``budget``: left after the waiting phase in the first step. ``drained``: the waiting queue
    was empty after the first step's admissions and nothing was preempted; ``seats``: fewer than
    ``max_num_seqs`` requests were running after admission. ``decoders`` is ``(n, Σc, Σc²)``
    at the first step for a stretch (its step times follow in closed form), else ``None``.
    """

    k0: int
    m: int
    t_start: float
    t_end: float
    running_budget: int
    budget: int
    drained: bool
    seats: bool
    free_first: int
    free_last: int
    preempted: bool
    decoders: tuple[int, int, int] | None = None


class FastReplay:
    """A replay engine equivalent to :class:`ReferenceEngine`, step for step."""

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 running: Iterable[Request] = (), waiting: Iterable[Request] = ()) -> None:
        self.config = config
        self.model = model
        self.bs = config.block_size
        self.cap = config.chunk_cap
        self.budget = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.max_len = config.max_model_len
        self.k = 0
        self.t = float(time)
        self.waiting: deque[Request] = deque(waiting)
        for r in self.waiting:
            r.blocks = 0
        running = list(running)
        held = 0
        for r in running:
            r.blocks = blocks_for(r.computed, self.bs)
            held += r.blocks
        self.free = config.num_gpu_blocks - held
        if self.free < 0:
            raise ValueError(f"running requests hold {held} KV blocks but the instance has "
                             f"only {config.num_gpu_blocks}")
        self._load_running(running)

    # -- aggregate bookkeeping ----------------------------------------------------------------

    def _load_running(self, running: list[Request]) -> None:
        """(Re)build the aggregates from explicit running requests in scheduler order."""
        self.dkeys: list[int] = []
        self.dreq: dict[int, Request] = {}
        self.doff: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []
        self.hist = [0] * self.bs
        self.n_dec = 0
        self.s1 = 0
        self.s2 = 0
        self.pref: list[Request] = []
        self.pkeys: list[int] = []
        for key, r in enumerate(running):
            if r.output >= 1 and r.prompt + r.output - r.computed == 1:
                self._add_decoder(key, r, self.k, sort=False)
            else:
                self.pref.append(r)
                self.pkeys.append(key)
        heapq.heapify(self.heap)
        self.next_key = len(running)

    def _add_decoder(self, key: int, r: Request, k: int, sort: bool = True) -> None:
        """Track ``r`` (context ``r.computed`` at step ``k``) as an aggregate decoder."""
        off = r.computed - k
        stop = min(r.stop, self.max_len - r.prompt)
        # At step s its context is off+s and it has O = off+s+1-P outputs; after the step
        # O+1 >= stop  <=>  s >= stop + P - 2 - off.
        kfin = max(stop + r.prompt - 2 - off, k)
        self.dreq[key] = r
        self.doff[key] = off
        self.hist[off % self.bs] += 1
        self.n_dec += 1
        self.s1 += off
        self.s2 += off * off
        if sort:
            heapq.heappush(self.heap, (kfin, key))
            insort(self.dkeys, key)
        else:
            self.heap.append((kfin, key))
            self.dkeys.append(key)

    def _finish_decoders(self, k: int, end: float) -> None:
        """Retire the decoders whose last token is made in step ``k`` (ending at ``end``)."""
        heap = self.heap
        bs = self.bs
        while heap and heap[0][0] == k:
            _, key = heapq.heappop(heap)
            off = self.doff.pop(key)
            r = self.dreq.pop(key)
            c = off + k + 1
            r.computed = c
            r.output = c + 1 - r.prompt
            r.blocks = 0
            r.finished = end
            self.free += blocks_for(c, bs)
            self.hist[off % bs] -= 1
            self.n_dec -= 1
            self.s1 -= off
            self.s2 -= off * off
            del self.dkeys[bisect_left(self.dkeys, key)]

    def _materialise(self) -> list[Request]:
        """Explicit running list in scheduler order, decoders' state brought up to date."""
        k = self.k
        bs = self.bs
        items: list[tuple[int, Request]] = []
        for key, r in self.dreq.items():
            c = self.doff[key] + k
            r.computed = c
            r.output = c + 1 - r.prompt
            r.blocks = blocks_for(c, bs)
            items.append((key, r))
        items.extend(zip(self.pkeys, self.pref, strict=True))
        items.sort(key=lambda kr: kr[0])
        return [r for _, r in items]

    def running_requests(self) -> list[Request]:
        """The running requests with up-to-date state, in scheduler order."""
        return self._materialise()

    @property
    def idle(self) -> bool:
        return not self.n_dec and not self.pref and not self.waiting

    @property
    def num_running(self) -> int:
        return self.n_dec + len(self.pref)

    # -- stepping -----------------------------------------------------------------------------

    def advance(self) -> Segment | None:
        """Run the next segment (a step or a decode-only stretch); ``None`` when idle."""
        if not self.pref:
            if not self.n_dec:
                if not self.waiting:
                    return None
            elif self.n_dec <= self.budget:
                m = self._stretch_length()
                if m >= 2:
                    return self._stretch(m)
        return self._step()

    def _cum_blocks(self, m: int) -> int:
        """New KV blocks the decoders need over the next ``m`` steps."""
        q, r = divmod(m, self.bs)
        total = q * self.n_dec
        hist = self.hist
        bs = self.bs
        k = self.k
        for s in range(k, k + r):
            total += hist[-s % bs]
        return total

    def _stretch_length(self) -> int:
        """Steps from now that are decode-only and identical (0 or 1: take a normal step)."""
        nd = self.n_dec
        k = self.k
        bs = self.bs
        hist = self.hist
        free = self.free
        if self.waiting:
            left = self.budget - nd
            if left > 0 and nd < self.max_seqs:
                head = self.waiting[0]
                n = min(head.prompt + head.output - head.computed, self.cap, left)
                if free - hist[-k % bs] >= blocks_for(head.computed + n, bs) - head.blocks:
                    return 0  # the head is admitted in this step
        m = self.heap[0][0] - k + 1
        if m < 2:
            return m
        if self._cum_blocks(m) <= free:
            return m
        # KV runs short inside the stretch: stop just before the first short step.
        cycles = free // nd
        acc = cycles * nd
        s = k + cycles * bs
        while acc + hist[-s % bs] <= free:
            acc += hist[-s % bs]
            s += 1
        return min(m, s - k)

    def _stretch(self, m: int) -> Segment:
        nd = self.n_dec
        k = self.k
        s1 = self.s1 + nd * k
        s2 = self.s2 + 2 * k * self.s1 + nd * k * k
        t0 = self.t
        t1 = t0 + self.model.stretch(nd, s1, s2, m)
        free_first = self.free - self.hist[-k % self.bs]
        self.free -= self._cum_blocks(m)
        left = self.budget - nd
        seg = Segment(k, m, t0, t1, left, left, not self.waiting, nd < self.max_seqs,
                      free_first, self.free, False, (nd, s1, s2))
        self.k = k + m
        self.t = t1
        self._finish_decoders(k + m - 1, t1)
        return seg

    def _step(self) -> Segment:
        k = self.k
        bs = self.bs
        cap = self.cap
        nd = self.n_dec
        pref = self.pref
        budget = self.budget

        # 1. Running phase: decoders take one token each; prefilling requests their chunks.
        chunks: list[int] = []
        if pref:
            if nd == 0 or self.dkeys[-1] < self.pkeys[0]:
                left = budget - nd
                if left < 0:
                    return self._slow_step()
                for p in pref:
                    if left > 0:
                        x = min(p.prompt + p.output - p.computed, cap, left)
                        left -= x
                    else:
                        x = 0
                    chunks.append(x)
            else:
                chunks = [min(p.prompt + p.output - p.computed, cap) for p in pref]
                left = budget - nd - sum(chunks)
                if left < 0:  # a prefill ahead of decoders takes their budget: order matters
                    return self._slow_step()
        else:
            if nd > budget:
                return self._slow_step()
            left = budget - nd
        need = self.hist[-k % bs] if nd else 0
        pneed = [blocks_for(p.computed + x, bs) - p.blocks if x else 0
                 for p, x in zip(pref, chunks, strict=True)]
        need += sum(pneed)
        if need > self.free:  # KV exhaustion: preemption, decided request by request
            return self._slow_step()
        free = self.free - need
        for p, b in zip(pref, pneed, strict=True):
            p.blocks += b
        running_left = left

        # 2. Waiting phase (nothing was preempted).
        admitted: list[tuple[Request, int]] = []
        nrun = nd + len(pref)
        waiting = self.waiting
        max_seqs = self.max_seqs
        while waiting and left > 0 and nrun < max_seqs:
            r = waiting[0]
            n = min(r.prompt + r.output - r.computed, cap, left)
            b = blocks_for(r.computed + n, bs) - r.blocks
            if free < b:
                break
            waiting.popleft()
            free -= b
            r.blocks += b
            admitted.append((r, n))
            left -= n
            nrun += 1
        self.free = free

        # 3. Duration from exact integer features.
        s1 = self.s1
        dec_ctx = s1 + nd * k
        len_sum = dec_ctx + nd
        k1 = k + 1
        len_sq = self.s2 + 2 * k1 * s1 + nd * k1 * k1
        n_dec = nd
        n_pre = pre_sq = pre_attn = 0
        work = list(zip(pref, chunks, strict=True))
        work.extend(admitted)
        for p, x in work:
            if not x:
                continue
            c = p.computed
            length = p.prompt + p.output
            len_sum += length
            len_sq += length * length
            if p.output >= 1 and length - c == 1:
                n_dec += 1
                dec_ctx += c
            else:
                n_pre += x
                pre_sq += x * x
                pre_attn += x * c + x * (x + 1) // 2
        if not n_dec and not n_pre:
            raise EngineStuck("no request can be scheduled: the waiting queue's head needs "
                              f"more KV blocks than are free ({free} of "
                              f"{self.config.num_gpu_blocks})")
        t0 = self.t
        t1 = t0 + self.model.duration(n_dec, n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq)
        seg = Segment(k, 1, t0, t1, running_left, left, not waiting, nrun < max_seqs,
                      free, free, False)

        # 4. Apply at the step's end.
        max_len = self.max_len
        new_pref: list[Request] = []
        new_keys: list[int] = []
        keys = list(self.pkeys)
        for _ in admitted:
            keys.append(self.next_key)
            self.next_key += 1
        for (p, x), key in zip(work, keys, strict=True):
            if x:
                p.computed += x
                if p.computed == p.prompt + p.output:
                    p.output += 1
                    if p.output == 1:
                        p.first_token = t1
                    if p.output >= p.stop or p.prompt + p.output >= max_len:
                        p.finished = t1
                        self.free += p.blocks
                        p.blocks = 0
                    else:
                        self._add_decoder(key, p, k1)
                    continue
            new_pref.append(p)
            new_keys.append(key)
        self.pref = new_pref
        self.pkeys = new_keys
        self._finish_decoders(k, t1)
        self.k = k1
        self.t = t1
        return seg

    def _slow_step(self) -> Segment:
        """One step by the reference loop on materialised state (preemption, starvation)."""
        ref = ReferenceEngine(self.config, self.model, time=self.t, running=self._materialise(),
                              waiting=self.waiting, free_blocks=self.free, steps=self.k)
        rec = ref.step()
        assert rec is not None
        self.free = ref.free_blocks
        self.waiting = ref.waiting
        self.t = ref.time
        self.k = ref.steps
        self._load_running(ref.running)
        preempted = bool(rec.preempted)
        return Segment(rec.index, 1, rec.start, rec.end, ref.last_running_budget,
                       ref.last_budget, not preempted and not ref.waiting,
                       ref.last_num_running < self.max_seqs, ref.last_free_after,
                       ref.last_free_after, preempted)
