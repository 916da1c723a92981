"""The compiled replay core: the V1 rules over flat arrays, compiled with numba.

Why compiled. A forecast sits on the routing hot path and must replay a few hundred resident
requests over several steps in well under 100 µs. Interpreted Python costs ~15-30 ns per
bytecode here, so even an aggregate, event-skipping replay spends ~10 µs per step; the same
plain per-request loop compiled by numba costs ~1 µs per step for 200 requests. So the fast path
is the *plain* rules, request by request, exactly as :mod:`duetime.engine.scheduler` states them,
only compiled — easy to check against the oracle, with no cleverness to get wrong.

The state lives in arrays so a replay can be paused and resumed (the forecaster extends its base
trajectory lazily). Without numba (``DUETIME_NO_JIT=1`` or not installed) the same functions
run as plain Python: correct, slow.

Layout (all int64 unless noted; request ``r`` is an index):

* ``req``: shape (N, 10): prompt, output, stop, computed, KV blocks held (the block ledger's
  column, :mod:`duetime.engine.kv_kernel`: only its ``kv_*`` functions touch it), done flag, and for
  asynchronous scheduling: placeholder tokens (``pending``), in flight in the previous step
  (0 no, 1 yes, 2 and samples), the same for this step, stale flag;
* ``stamps`` (float64, (N, 2)): first-token and finish time (NaN until stamped);
* ``run``: running order (first ``st[NRUN]`` entries); ``wq``: waiting queue, a ring buffer of
  size N with head ``st[WH]`` and length ``st[WC]`` (preempted requests are pushed at the front);
* ``st``: step index, free blocks, run length, queue head, queue length, the livelock watch
  (request, quiet since), rows in flight (async); ``clock`` (float64[1]);
* ``cfg``: budget, chunk cap (the long-prefill threshold, or the budget), max_num_seqs,
  max_model_len, block size, usable blocks, log2(block size) or -1 (see
  :mod:`duetime.engine.kv_kernel`), watermark blocks, full-sequence admission (0/1), asynchronous
  scheduling (0/1) (prefix caching is not a flag: see the pool arguments below);
* with prefix caching, the block pool (:mod:`duetime.engine.block_pool_kernel`): ``pool``, ``kmap``
  and the arenas ``rb`` (each request's blocks, from column ``BOFF``) and ``rk`` (its known
  block keys, ``NKEY`` of them from column ``KOFF``); ``NCACHED``: its blocks registered in
  the cache; ``UID``: what its own keys are made from; ``BCAP``: the length of its slice of
  ``rb`` (the blocks it can ever hold). In a forecast, the first ``H0`` blocks of a request
  that held blocks at the snapshot stay where the engine keeps them, ``rb[B0OFF:]`` (the
  forecast's arena is the engine's, its own slices in the free space past the engine's:
  nothing is copied; see :mod:`duetime.engine.prefix_state`); ``H0`` is 0 otherwise, and
  after the request gives its blocks back. Without caching they are ``None`` (:data:`NO_POOL`)
  and the free count is all the ledger keeps: numba then compiles a version of every
  function without the caching branches (it prunes ``if kmap is not None`` for a ``None``
  argument), as fast as before caching existed (a runtime flag cost the forecasts ~30%);
* ``w`` (float64[8]): the batch-time model as intercept + weights of the seven features, in the
  order of :meth:`duetime.engine.batch_time.BatchTimeModel.weights`.
"""

from __future__ import annotations

import math

import numpy as np

from duetime.engine._jit import njit
from duetime.engine.block_pool_kernel import (
    U_STAMP,
    pool_allocate,
    pool_cache,
    pool_evictable,
    pool_lookup,
    pool_release,
    pool_touch,
    req_key,
)
from duetime.engine.kv_kernel import HELD, kv_admit, kv_blocks, kv_need, kv_release, kv_take
from duetime.engine.remaining import stop_length

# req columns (HELD, 4, is the KV ledger's; BOFF .. UID: prefix caching's, see step())
PROMPT, OUTPUT, STOP, COMP, DONE, PEND, INF, NINF, STALE = 0, 1, 2, 3, 5, 6, 7, 8, 9
BOFF, KOFF, NKEY, NCACHED, UID, BCAP, H0, B0OFF = 10, 11, 12, 13, 14, 15, 16, 17
REQ_COLUMNS = 18
assert HELD == 4
# st fields (LONE, QUIET: the livelock watch; NINFL: rows in flight; see step())
# (PQ, PH: prefix-cache queries and hits so far, in tokens; NSEED: the step noise's seed)
K, FREE, NRUN, WH, WC, LONE, QUIET, NINFL, PQ, PH, NSEED = range(11)
ST_SIZE = 11
# cfg fields (SHIFT: log2(block_size) when it is a power of two, else -1)
BUDGET, CAP, MAXSEQS, MAXLEN, BS, NBLOCKS, SHIFT, WM, FULLSEQ, ASYNC = range(10)
# step()'s ``out``: see step()
OUT_SIZE = 10

# step() results (>= 0: number of requests scheduled)
STUCK = -1      # nothing can be scheduled now and nothing changed (without arrivals: forever)

# run_* results
REACHED = 0     # the probe's event happened / the base covered the requested room / the time
IDLE = 1        # nothing left to do
FULL = 2        # the record arrays are full
STEP_CAP = 3    # max_steps reached
FINISHED = 4    # run_until: a request finished (asked to stop there)

# the pool arguments of a kernel without prefix caching (see the module doc)
NO_POOL = (None, None, None, None, None)

# flag bits recorded per base step
DRAINED = 1     # waiting queue empty after admission and nothing preempted
SEATS = 2       # running < max_num_seqs after admission
PREEMPTED = 4
NO_MODEL = 8    # nothing scheduled (asynchronously: a step that only applies outputs)


@njit(cache=True, nogil=True)
def prepare(r_prompt, r_comp, r_out, r_pred, w_prompt, w_out, w_pred, bs, shift, num_blocks,
            sigma, time):  # pragma: no cover - jit
    """Replay state for a snapshot: running rows, then waiting rows, then one spare row (for a
    probe). Stop lengths come from the predictions (:func:`stop_length`); each running request
    holds the blocks of its computed tokens; one with all its tokens computed has its next
    token in flight (asynchronous scheduling: the snapshot was taken between a step and the
    application of its outputs).

    Returns (req, stamps, run, wq, st, clock); ``st[FREE] < 0`` if the running requests hold
    more blocks than the instance has.
    """
    n_run = r_prompt.shape[0]
    n_wait = w_prompt.shape[0]
    n = n_run + n_wait + 1
    req = np.zeros((n, REQ_COLUMNS), dtype=np.int64)
    run = np.zeros(n, dtype=np.int64)
    wq = np.zeros(n, dtype=np.int64)
    used = 0
    ninfl = 0
    for i in range(n_run):
        req[i, PROMPT] = r_prompt[i]
        req[i, OUTPUT] = r_out[i]
        req[i, STOP] = stop_length(r_pred[i], r_out[i], sigma)
        req[i, COMP] = r_comp[i]
        if r_comp[i] == r_prompt[i] + r_out[i]:  # (async) its next token is in flight
            req[i, PEND] = 1
            req[i, INF] = 2
            ninfl += 1
        used += kv_take(req, i, kv_blocks(r_comp[i], bs, shift))
        run[i] = i
    for i in range(n_wait):
        req[n_run + i, PROMPT] = w_prompt[i]
        req[n_run + i, OUTPUT] = w_out[i]
        req[n_run + i, STOP] = stop_length(w_pred[i], w_out[i], sigma)
        wq[i] = n_run + i
    wq[n_wait] = n - 1
    stamps = np.full((n, 2), np.nan)
    st = np.zeros(ST_SIZE, dtype=np.int64)
    st[LONE] = -1
    st[FREE] = num_blocks - used
    st[NRUN] = n_run
    st[WC] = n_wait
    st[NINFL] = ninfl
    clock = np.full(1, time)
    return req, stamps, run, wq, st, clock


@njit(cache=True, nogil=True)
def release_blocks(req, r, pool, rb, undo):  # pragma: no cover - jit
    """Prefix caching: row ``r`` gives back all its blocks; returns how many join the free
    queue."""
    back = pool_release(pool, rb, req[r, BOFF], req[r, HELD], undo, req[r, B0OFF], req[r, H0])
    req[r, HELD] = 0
    req[r, H0] = 0
    req[r, NCACHED] = 0
    return back


@njit(cache=True, nogil=True)
def register_blocks(req, r, pool, kmap, rb, rk, tokens, bs, undo):  # pragma: no cover - jit
    """Prefix caching: row ``r``'s full blocks of its first ``tokens`` tokens are registered
    in the cache (those not yet)."""
    full = tokens // bs
    nc = req[r, NCACHED]
    if full > nc:
        boff, koff, nkey, uid = req[r, BOFF], req[r, KOFF], req[r, NKEY], req[r, UID]
        h0, b0off = req[r, H0], req[r, B0OFF]
        for i in range(nc, full):
            b = rb[boff + i] if i >= h0 else rb[b0off + i]
            pool_cache(pool, kmap, b, req_key(rk, koff, nkey, uid, i), undo)
        req[r, NCACHED] = full


@njit(cache=True, nogil=True)
def step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk, undo,
         noise=0.0, extra=0):  # pragma: no cover - jit
    """One scheduler step. ``work``: int64 scratch (2, N); ``out`` (int64[OUT_SIZE]) gets
    [budget left after running phase, after admission, free blocks after allocation, flags,
    the waiting head (on STUCK), first tokens, finished, preempted, prefix-cache queries and
    hits (tokens, of the admitted requests that looked up)]; the rows that got their
    first token are ``work[1, :out[5]]`` and those that finished ``work[0, :out[6]]``.
    Returns the number of scheduled requests, or STUCK. ``noise`` > 0 multiplies the step's
    duration by a mean-one log-normal factor with that log-space spread (a simulated
    instance's "true" timing; drawn from the engine's own stream, see :func:`step_normal`).
    ``extra``: requests not in
    the arrays that count as present (a forecaster's probe): a request alone ignores the
    long-prefill threshold.

    One loop serves both phases: first the running requests in order (phase 0), then, if
    nothing was preempted, the waiting queue FCFS (phase 1). A scheduled request's tokens are
    counted in the batch features and applied at once: no later decision in the step reads it
    again (preemption victims come from the unscheduled tail); blocks of requests that finish
    are freed at the step's end. With asynchronous scheduling the outputs applied are the
    previous step's (stamped with its end, this step's start), after this step is scheduled
    (see :meth:`duetime.engine.scheduler.ReferenceEngine.step`).
    """
    budget = cfg[BUDGET]
    bs = cfg[BS]
    shift = cfg[SHIFT]
    max_len = cfg[MAXLEN]
    max_seqs = cfg[MAXSEQS]
    wm = cfg[WM]
    full = cfg[FULLSEQ]
    asyn = cfg[ASYNC]
    n_q = wq.shape[0]
    free = st[FREE]
    nrun = st[NRUN]
    wh = st[WH]
    wc = st[WC]
    # a lone request ignores the long-prefill threshold (nobody to starve)
    cap = cfg[CAP] if nrun + wc + extra > 1 else budget
    done = work[0]
    first = work[1]
    nd = 0
    nf = 0
    n_dec = 0
    n_pre = 0
    pre_sq = 0
    pre_attn = 0
    dec_ctx = 0
    len_sum = 0
    len_sq = 0
    ns = 0
    preempted = 0
    queried = 0
    hit_tokens = 0
    made = False  # an output token was applied (the livelock watch)
    phase = 0
    i = 0
    t_start = clock[0]
    if undo is not None:  # key events of this step's scheduling (see block_pool_kernel)
        undo[U_STAMP] = 2 * st[K]
    while True:
        if phase == 0:
            if i >= nrun or budget <= 0:
                out[0] = budget
                if preempted > 0:
                    break
                phase = 1
                continue
            r = run[i]
        else:
            if wc == 0 or budget <= 0 or nrun >= max_seqs:
                break
            r = wq[wh]
        c = req[r, COMP]
        pend = req[r, PEND] if asyn else 0
        length = req[r, PROMPT] + req[r, OUTPUT] + pend
        n = length - c
        if n > cap:
            n = cap
        if n > budget:
            n = budget
        if phase == 0:
            # (synchronously a chunk never reaches past max_model_len - 1: no need to cap)
            if asyn and ((pend > 0 and c + 2 - pend >= req[r, PROMPT] + req[r, STOP])
                         or max_len - c - 1 <= 0):
                i += 1  # its token in flight is its last, or reaches max_model_len
                continue
            if asyn and n > max_len - c - 1:
                n = max_len - c - 1
            need = kv_need(req, r, c + n, bs, shift)
            ok = True
            while free < need:  # preempt the newest running request (maybe r itself)
                nrun -= 1
                v = run[nrun]
                if kmap is not None:
                    free += release_blocks(req, v, pool, rb, undo)
                else:
                    free += kv_release(req, v)
                req[v, COMP] = 0
                req[v, PEND] = 0
                req[v, STALE] = 1 if req[v, INF] > 0 else 0
                wh = (wh - 1) % n_q
                wq[wh] = v
                wc += 1
                preempted += 1
                if v == r:  # still too big with all after it preempted: it waits
                    ok = False
                    break
            if not ok:
                out[0] = budget
                break
            i += 1
        else:  # admission: the whole sequence must fit (and the watermark while others run)
            spare = wm if nrun > 0 else 0
            hits = 0
            if kmap is not None and c == 0:
                # its cached prefix is not computed again; a hit on a block nobody holds
                # costs a free block (written to its own slice of rb: it holds nothing)
                hits = pool_lookup(kmap, rk, req[r, KOFF], req[r, NKEY], req[r, UID],
                                   (length - 1) // bs, rb, req[r, BOFF])
                if hits > 0:
                    spare += pool_evictable(pool, rb, req[r, BOFF], hits)
                    c = hits * bs
                    n = length - c
                    if n > cap:
                        n = cap
                    if n > budget:
                        n = budget
                    req[r, HELD] = hits
            need = kv_admit(req, r, length if length < max_len else max_len, c + n, free,
                            spare, full, bs, shift)
            if need < 0:
                req[r, HELD] = 0
                break
            if kmap is not None and req[r, COMP] == 0:
                queried += length
                if hits > 0:
                    free -= pool_touch(pool, rb, req[r, BOFF], hits, undo)
                    req[r, NCACHED] = hits
                    hit_tokens += c
            wh = (wh + 1) % n_q
            wc -= 1
            run[nrun] = r
            nrun += 1
        if kmap is not None:  # (calls only when there is work: each passes the key map)
            if need > 0:
                pool_allocate(pool, kmap, rb, req[r, BOFF] + req[r, HELD], need, undo)
                req[r, HELD] += need
                free -= need
            known = req[r, PROMPT] + req[r, OUTPUT]
            t = c + n if c + n < known else known
            if (t >> shift if shift >= 0 else t // bs) > req[r, NCACHED]:
                register_blocks(req, r, pool, kmap, rb, rk, t, bs, undo)
        else:
            free -= kv_take(req, r, need)
        budget -= n
        ns += 1
        # batch features (a token in flight counts as the output it will be), then apply
        len_sum += length
        len_sq += length * length
        if length - c == 1 and req[r, OUTPUT] + pend >= 1:
            n_dec += 1
            dec_ctx += c
        else:
            n_pre += n
            pre_sq += n * n
            pre_attn += n * c + n * (n + 1) // 2
        req[r, COMP] = c + n
        if c + n == length:
            if asyn:
                req[r, PEND] = pend + 1
                req[r, NINF] = 2
            else:
                o = req[r, OUTPUT] + 1
                req[r, OUTPUT] = o
                made = True
                if o == 1:
                    first[nf] = r
                    nf += 1
                if o >= req[r, STOP] or length + 1 >= max_len:
                    done[nd] = r
                    nd += 1
        elif asyn:
            req[r, NINF] = 1
    out[1] = budget
    out[2] = free
    flags = 0
    if preempted == 0 and wc == 0:
        flags |= DRAINED
    if nrun < max_seqs:
        flags |= SEATS
    if preempted > 0:
        flags |= PREEMPTED
    if ns == 0:
        flags |= NO_MODEL
    out[3] = flags
    out[7] = preempted
    out[8] = queried
    out[9] = hit_tokens
    st[PQ] += queried
    st[PH] += hit_tokens
    st[NRUN] = nrun
    st[WH] = wh
    st[WC] = wc
    if ns == 0 and preempted == 0 and st[NINFL] == 0:
        st[FREE] = free
        out[4] = wq[wh] if wc > 0 else -1
        out[5] = 0
        out[6] = 0
        return STUCK
    if undo is not None:  # key events after the scheduling: outputs applied, blocks freed
        undo[U_STAMP] = 2 * st[K] + 1
    # duration: the batch-time model of the composition (exact integer features)
    t_end = t_start
    if ns > 0:
        dur = (w[0] + w[1] * n_dec + w[2] * n_pre + w[3] * pre_sq + w[4] * pre_attn
               + w[5] * dec_ctx + w[6] * len_sum + w[7] * len_sq)
        if noise > 0.0:
            dur *= math.exp(noise * step_normal(st[NSEED], st[K]) - 0.5 * noise * noise)
        t_end += dur
    if asyn:
        # the previous step's outputs, then this step's rows are the ones in flight; they
        # are all running now, or preempted this step (at the queue's front)
        t_out = t_start
        ninfl = 0
        for j in range(nrun + preempted):
            r = run[j] if j < nrun else wq[(wh + j - nrun) % n_q]
            if req[r, INF] == 2 and req[r, DONE] == 0:
                if req[r, STALE] == 0:
                    req[r, PEND] -= 1
                # (as in the scheduling loop above: a helper call here doubles the step's
                # time under numba, measured)
                o = req[r, OUTPUT] + 1
                req[r, OUTPUT] = o
                made = True
                if kmap is not None and req[r, STALE] == 0:  # (vLLM's AsyncScheduler caches here)
                    t = req[r, COMP] - req[r, PEND]
                    if t > req[r, PROMPT] + o:
                        t = req[r, PROMPT] + o
                    if (t >> shift if shift >= 0 else t // bs) > req[r, NCACHED]:
                        register_blocks(req, r, pool, kmap, rb, rk, t, bs, undo)
                if o == 1:
                    first[nf] = r
                    nf += 1
                if o >= req[r, STOP] or req[r, PROMPT] + o >= max_len:
                    done[nd] = r
                    nd += 1
            req[r, STALE] = 0
            req[r, INF] = req[r, NINF]
            req[r, NINF] = 0
            if req[r, INF] > 0:
                ninfl += 1
        st[NINFL] = ninfl
    else:
        t_out = t_end
    # stamps; finished requests leave (running, or preempted with a stale last token)
    for j in range(nf):
        stamps[first[j], 0] = t_out
    if nd > 0:
        for j in range(nd):
            r = done[j]
            stamps[r, 1] = t_out
            if kmap is not None:
                free += release_blocks(req, r, pool, rb, undo)
            else:
                free += kv_release(req, r)
            req[r, DONE] = 1
        m = 0
        for j in range(nrun):
            r = run[j]
            if req[r, DONE] == 0:
                run[m] = r
                m += 1
        nrun = m
        st[NRUN] = nrun
        if asyn and preempted > 0:  # preempted with a stale last token: from the front
            m = 0
            for j in range(preempted - 1, -1, -1):
                r = wq[(wh + j) % n_q]
                if req[r, DONE] == 0:
                    wq[(wh + preempted - 1 - m) % n_q] = r
                    m += 1
            # survivors are packed, in order, at the back of the front block
            wh = (wh + preempted - m) % n_q
            wc -= preempted - m
            st[WH] = wh
            st[WC] = wc
    out[5] = nf
    out[6] = nd
    st[FREE] = free
    if made:
        st[QUIET] = 0
    if preempted > 0 and ns == 0:
        # Only preempted: the head preempted itself and nothing runs after this step
        # (whoever was skipped has just finished). A livelock if this happened before with
        # no output since: every request waits with nothing computed, in the same order, with
        # the same outputs, so the steps since then repeat for ever.
        lone = wq[wh]
        if st[LONE] == lone and st[QUIET] == 1:
            out[4] = lone
            return STUCK
        st[LONE] = lone
        st[QUIET] = 1
    st[K] += 1
    clock[0] = t_end
    return ns


@njit(cache=True, nogil=True)
def run_probe(req, stamps, run, wq, st, clock, cfg, w, pool, kmap, rb, rk, undo, probe,
              until_finish, max_steps):  # pragma: no cover - jit
    """Step until ``probe`` gets its first token (or finishes). Returns (code, detail)."""
    work = np.empty((2, run.shape[0]), dtype=np.int64)
    out = np.zeros(OUT_SIZE, dtype=np.int64)
    col = 1 if until_finish else 0
    while np.isnan(stamps[probe, col]):
        if st[K] >= max_steps:
            return STEP_CAP, 0
        if st[NRUN] == 0 and st[WC] == 0:
            return IDLE, 0
        got = step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk,
                   undo)
        if got < 0:
            return got, out[4]
    return REACHED, 0


@njit(cache=True, nogil=True)
def run_base(req, stamps, run, wq, st, clock, cfg, w, pool, kmap, rb, rk, undo, rec, cum,
             rec_t, n_rec, room, target, max_steps):  # pragma: no cover - jit
    """Step and record until the probe room since the queue first drained reaches ``target``.

    Per step ``s``: ``rec[s] = [budget left after admission, free blocks after allocation,
    flags]``, ``rec_t[s]`` = its end time, and prefix sums ``cum[s + 1]`` (``cum[0]`` = 0) of
    y = min(cap, budget left after the running phase) — the tokens a probe at the tail of the
    running order could get —, of y², of the steps with y > 0 and of the steps that preempted
    or ran no model.
    ``room`` = [y summed from the first drained step on, 1 once drained, first drained step].
    Returns (code, recorded count, detail).
    """
    work = np.empty((2, run.shape[0]), dtype=np.int64)
    out = np.zeros(OUT_SIZE, dtype=np.int64)
    cap = cfg[CAP]
    while True:
        if room[1] == 1 and room[0] >= target:
            return REACHED, n_rec, 0
        if st[NRUN] == 0 and st[WC] == 0:
            return IDLE, n_rec, 0
        if n_rec >= rec_t.shape[0]:
            return FULL, n_rec, 0
        if st[K] >= max_steps:
            return STEP_CAP, n_rec, 0
        got = step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk,
                   undo, 0.0, 1)
        if got < 0:
            return got, n_rec, out[4]
        y = cap if out[0] > cap else out[0]
        rec[n_rec, 0] = out[1]
        rec[n_rec, 1] = out[2]
        rec[n_rec, 2] = out[3]
        rec_t[n_rec] = clock[0]
        cum[n_rec + 1, 0] = cum[n_rec, 0] + y
        cum[n_rec + 1, 1] = cum[n_rec, 1] + y * y
        cum[n_rec + 1, 2] = cum[n_rec, 2] + (1 if y > 0 else 0)
        cum[n_rec + 1, 3] = cum[n_rec, 3] + (1 if out[3] & (PREEMPTED | NO_MODEL) else 0)
        if room[1] == 0 and out[3] & DRAINED:
            room[1] = 1
            room[2] = n_rec
        n_rec += 1
        if room[1] == 1:
            room[0] += y


@njit(cache=True, nogil=True)
def prefill_backlog(req, run, wq, st):  # pragma: no cover - jit
    """Prompt tokens not yet computed over the running requests and the waiting queue."""
    total = 0
    for k in range(st[NRUN]):
        left = req[run[k], PROMPT] - req[run[k], COMP]
        if left > 0:
            total += left
    n = wq.shape[0]
    for k in range(st[WC]):
        r = wq[(st[WH] + k) % n]
        left = req[r, PROMPT] - req[r, COMP]
        if left > 0:
            total += left
    return total


@njit(cache=True, nogil=True)
def run_until(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk, undo,
              t_limit, stop_on_finish, noise):  # pragma: no cover - jit
    """Step while the clock is before ``t_limit`` (a step that starts before it may end after
    it). Returns (code, detail): REACHED, IDLE, FINISHED (``stop_on_finish``: the step's
    finished rows are ``work[0, :out[6]]``), or STUCK (detail: the waiting head's row)."""
    while clock[0] < t_limit:
        if st[NRUN] == 0 and st[WC] == 0:
            return IDLE, 0
        got = step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk,
                   undo, noise)
        if got < 0:
            return got, out[4]
        if stop_on_finish and out[6] > 0:
            return FINISHED, 0
    return REACHED, 0


MASK31 = (1 << 31) - 1


@njit(cache=True, nogil=True)
def _hash31(x):  # pragma: no cover - jit
    """A 31-bit integer hash (xor-shift-multiply rounds; products stay below 2**62, so the
    same integers come out compiled or not)."""
    x &= MASK31
    x ^= x >> 16
    x = (x * 0x45D9F3B) & MASK31
    x ^= x >> 13
    x = (x * 0x2C1B3C6D) & MASK31
    x ^= x >> 16
    return x


@njit(cache=True, nogil=True)
def step_normal(seed, k):  # pragma: no cover - jit
    """A standard normal draw for step ``k`` of the engine whose noise seed is ``seed``: a
    function of the two (Box-Muller over two hashed uniforms), so that an engine's noise does
    not depend on when, or in which order with other engines, it is stepped (the simulator
    steps engines only when it needs them)."""
    x = _hash31(_hash31(seed) ^ (_hash31(seed >> 31) + 0x3C6EF372) ^ _hash31(k + 0x1B873593))
    u1 = (_hash31(x ^ 0x5BD1E995) + 1) / (MASK31 + 1.0)  # (0, 1]
    u2 = _hash31(x ^ 0x27D4EB2F) / (MASK31 + 1.0)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
