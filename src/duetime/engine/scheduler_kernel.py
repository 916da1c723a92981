"""The compiled scheduler: the reference step loop's rules (:mod:`duetime.engine.scheduler`)
over flat arrays, compiled with numba; :func:`step` runs one step, phase by phase, and
:func:`run_probe`, :func:`run_base`, :func:`run_until` run many.

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

* ``req``: shape (N, ``REQ_COLUMNS`` = 19), one row per request: ``PROMPT``, ``OUTPUT`` (tokens
  produced so far), ``STOP`` (the output length it stops at), ``COMP`` (computed tokens),
  ``HELD`` (KV blocks held: the block ledger's column, :mod:`duetime.engine.kv_kernel`;
  with prefix caching the block pool's moves write it too), ``DONE``; for asynchronous
  scheduling ``PEND`` (placeholder tokens), ``INF`` (in flight in the previous step: 0 no, 1
  yes, 2 and samples), ``NINF`` (the same for this step), ``STALE`` (preempted with a token
  in flight); for prefix caching ``BOFF`` .. ``B0OFF`` (below); ``LORA``: its adapter (vLLM's
  ``lora_int_id``, 0: the base model);
* ``stamps`` (float64, (N, 2)): first-token and finish time (NaN until stamped);
* ``run``: running order (first ``st[NRUN]`` entries); ``wq``: waiting queue, a ring buffer of
  size N with head ``st[WH]`` and length ``st[WC]`` (preempted requests are pushed at the front);
* ``st`` (``ST_SIZE`` = 11): step index ``K``, free blocks ``FREE``, running count ``NRUN``,
  queue head ``WH`` and length ``WC``, the livelock watch (``LONE``: the request, ``QUIET``:
  no output since), rows in flight ``NINFL`` (async), prefix-cache queries and hits so far
  ``PQ`` / ``PH`` (tokens), the step noise's seed ``NSEED``; ``clock`` (float64[1]);
* ``cfg``: budget, chunk cap (the long-prefill threshold, or the budget), max_num_seqs,
  max_model_len, block size, usable blocks, log2(block size) or -1 (see
  :mod:`duetime.engine.kv_kernel`), watermark blocks, full-sequence admission (0/1),
  asynchronous scheduling (0/1), ``max_loras`` (0: LoRA off) (prefix caching is not a flag:
  see the pool arguments below);
* with prefix caching, the block pool (:mod:`duetime.engine.block_pool_kernel`): ``pool``,
  ``kmap`` and the arenas ``rb`` (each request's blocks, from column ``BOFF``) and ``rk`` (its
  known block keys, ``NKEY`` of them from column ``KOFF``); ``NCACHED``: its blocks registered
  in the cache; ``UID``: what its own keys are made from; ``BCAP``: the length of its slice of
  ``rb`` (the blocks it can ever hold). In a forecast, the first ``H0`` blocks of a request
  that held blocks at the snapshot stay where the engine keeps them, ``rb[B0OFF:]`` (the
  forecast's arena is the engine's, its own slices in the free space past the engine's:
  nothing is copied; see :mod:`duetime.engine.prefix_state`); ``H0`` is 0 otherwise, and
  after the request gives its blocks back. Without caching they are ``None`` (:data:`NO_POOL`)
  and the free count is all the ledger keeps: numba then compiles a version of every
  function without the caching branches (it prunes ``if kmap is not None`` for a ``None``
  argument, in the inlined helpers too), as fast as before caching existed (a runtime flag
  cost the forecasts ~30%);
* ``adapters``: with ``max_loras``, the step's LoRA scratch (``LORA_ROWS``, N): the rows
  skipped for their adapters, the step's adapters (:func:`adapter_scratch`); ``None`` without:
  numba then compiles the kernel without the adapter rule as it does without caching (a
  runtime test of ``max_loras`` cost the forecasts without adapters 10-30%, measured with
  ``benchmarks/ab.py``);
* ``w`` (float64[11]): the batch-time model as intercept + weights of the seven features, in the
  order of :meth:`duetime.engine.batch_time.BatchTimeModel.weights`, then its LoRA weights
  (``lora_weights``: read only with ``adapters``).
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

# req columns (HELD, 4, is the KV ledger's: kv_kernel; BOFF .. B0OFF: prefix caching's; module doc)
PROMPT, OUTPUT, STOP, COMP, DONE, PEND, INF, NINF, STALE = 0, 1, 2, 3, 5, 6, 7, 8, 9
BOFF, KOFF, NKEY, NCACHED, UID, BCAP, H0, B0OFF = 10, 11, 12, 13, 14, 15, 16, 17
LORA = 18
REQ_COLUMNS = 19
assert HELD == 4
# st fields (module doc)
K, FREE, NRUN, WH, WC, LONE, QUIET, NINFL, PQ, PH, NSEED = range(11)
ST_SIZE = 11
# cfg fields (SHIFT: log2(block_size) when it is a power of two, else -1)
BUDGET, CAP, MAXSEQS, MAXLEN, BS, NBLOCKS, SHIFT, WM, FULLSEQ, ASYNC, MAXLORAS = range(11)
CFG_SIZE = 11
# step()'s ``out``: see step()
OUT_SIZE = 14
# step()'s ``work`` rows: finished rows, first tokens
WORK_ROWS = 2
# rows of the LoRA scratch (``adapters``, with max_loras): skipped rows, the step's adapters
LORA_ROWS = 2

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


def adapter_scratch(max_loras: int, rows: int) -> np.ndarray | None:
    """The ``adapters`` argument for ``rows`` requests: None without ``max_loras`` (see the
    module doc)."""
    return np.zeros((LORA_ROWS, rows), dtype=np.int64) if max_loras else None

# a base record's LoRA columns (run_base): the step's adapters count, decode and prefill
# tokens, then the adapters
REC_NL, REC_DEC, REC_PRE, REC_ADAPTERS = 3, 4, 5, 6

# flag bits recorded per base step
DRAINED = 1     # waiting queue empty after admission and nothing preempted
SEATS = 2       # running < max_num_seqs after admission
PREEMPTED = 4
NO_MODEL = 8    # nothing scheduled (asynchronously: a step that only applies outputs)
TAIL = 16       # admission went through the whole queue (each request admitted or skipped)
ADMITTED = 32   # admission admitted a request


@njit(cache=True, nogil=True)
def fill_replay(req, stamps, run, wq, st, clock, r_prompt, r_comp, r_out, r_pred, w_prompt,
                w_out, w_pred, bs, shift, num_blocks, sigma, time, r_lora=None,
                w_lora=None):  # pragma: no cover - jit
    """:func:`prepare`'s state written into given arrays with room for its ``n`` rows (a live
    forecaster's kept buffers); what lies past them is left as it was (the kernel reads rows
    only through ``run`` and the ring ``wq``). ``r_lora`` / ``w_lora``: the adapters (None:
    all on the base model)."""
    n_run = r_prompt.shape[0]
    n_wait = w_prompt.shape[0]
    n = n_run + n_wait + 1
    req[:n] = 0
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
        if r_lora is not None:
            req[i, LORA] = r_lora[i]
        run[i] = i
    for i in range(n_wait):
        req[n_run + i, PROMPT] = w_prompt[i]
        req[n_run + i, OUTPUT] = w_out[i]
        req[n_run + i, STOP] = stop_length(w_pred[i], w_out[i], sigma)
        if w_lora is not None:
            req[n_run + i, LORA] = w_lora[i]
        wq[i] = n_run + i
    wq[n_wait] = n - 1
    stamps[:n] = np.nan
    st[:] = 0
    st[LONE] = -1
    st[FREE] = num_blocks - used
    st[NRUN] = n_run
    st[WC] = n_wait
    st[NINFL] = ninfl
    clock[0] = time


@njit(cache=True, nogil=True)
def prepare(r_prompt, r_comp, r_out, r_pred, w_prompt, w_out, w_pred, bs, shift, num_blocks,
            sigma, time, r_lora=None, w_lora=None):  # pragma: no cover - jit
    """Replay state for a snapshot: running rows, then waiting rows, then one spare row (for a
    probe). Stop lengths come from the predictions (:func:`stop_length`); each running request
    holds the blocks of its computed tokens; one with all its tokens computed has its next
    token in flight (asynchronous scheduling: the snapshot was taken between a step and the
    application of its outputs).

    Returns (req, stamps, run, wq, st, clock); ``st[FREE] < 0`` if the running requests hold
    more blocks than the instance has.
    """
    n = r_prompt.shape[0] + w_prompt.shape[0] + 1
    req = np.empty((n, REQ_COLUMNS), dtype=np.int64)
    stamps = np.empty((n, 2))
    run = np.zeros(n, dtype=np.int64)
    wq = np.zeros(n, dtype=np.int64)
    st = np.empty(ST_SIZE, dtype=np.int64)
    clock = np.empty(1)
    fill_replay(req, stamps, run, wq, st, clock, r_prompt, r_comp, r_out, r_pred, w_prompt,
                w_out, w_pred, bs, shift, num_blocks, sigma, time, r_lora, w_lora)
    return req, stamps, run, wq, st, clock


@njit(cache=True, nogil=True)
def live_base(e_req, e_pred, e_run, e_wq, e_st, sigma, req, stamps, run, wq, st, clock, cfg, w,
              adapters, rec, cum, rec_t, room, target, max_steps):  # pragma: no cover - jit
    """A live engine's state (its arrays ``e_*``; ``e_pred``: the predicted output lengths by
    row) read into a forecaster's replay arrays as :func:`prepare` makes them from its snapshot
    (the running rows in order, then the waiting queue from its head), and its base recorded
    from the start by :func:`run_base` (without prefix caching). Returns run_base's (code,
    recorded count, detail), or (``FULL``, -1, rows needed) when the replay arrays are too
    small, or (``FULL``, -1, -1) when the running rows hold more KV blocks than the instance
    has (a state set from outside: :class:`~duetime.engine.live_forecast.RowState`)."""
    nrun = e_st[NRUN]
    nw = e_st[WC]
    if nrun + nw + 1 > req.shape[0]:
        return FULL, -1, nrun + nw + 1
    n_q = e_wq.shape[0]
    wh = e_st[WH]
    r_prompt = np.empty(nrun, dtype=np.int64)
    r_comp = np.empty(nrun, dtype=np.int64)
    r_out = np.empty(nrun, dtype=np.int64)
    r_pred = np.empty(nrun, dtype=np.int64)
    for i in range(nrun):
        r = e_run[i]
        r_prompt[i] = e_req[r, PROMPT]
        r_comp[i] = e_req[r, COMP]
        r_out[i] = e_req[r, OUTPUT]
        r_pred[i] = e_pred[r]
    w_prompt = np.empty(nw, dtype=np.int64)
    w_out = np.empty(nw, dtype=np.int64)
    w_pred = np.empty(nw, dtype=np.int64)
    for i in range(nw):
        r = e_wq[(wh + i) % n_q]
        w_prompt[i] = e_req[r, PROMPT]
        w_out[i] = e_req[r, OUTPUT]
        w_pred[i] = e_pred[r]
    fill_replay(req, stamps, run, wq, st, clock, r_prompt, r_comp, r_out, r_pred, w_prompt,
                w_out, w_pred, cfg[BS], cfg[SHIFT], cfg[NBLOCKS], sigma, 0.0)
    if adapters is not None:  # (max_loras) the adapters, in the same rows
        for i in range(nrun):
            req[i, LORA] = e_req[e_run[i], LORA]
        for i in range(nw):
            req[nrun + i, LORA] = e_req[e_wq[(wh + i) % n_q], LORA]
    if st[FREE] < 0:
        return FULL, -1, -1
    room[:] = 0
    return run_base(req, stamps, run, wq, st, clock, cfg, w, None, None, None, None, None,
                    adapters, rec, cum, rec_t, 0, room, target, max_steps)


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


# -- one step, phase by phase ------------------------------------------------------------------
# Each phase is a helper inlined into step() (``inline="always"``: numba pastes its IR into the
# caller before compiling, so step() still compiles to one function, and the ``kmap is not
# None`` branches are still pruned for a kernel without prefix caching). The phases hand the
# queue over in ``st`` (FREE, NRUN, WH, WC: a phase keeps them in locals while it runs and
# writes them back when it ends) and the budget in ``out``. Per-request sums travel as tuples:
# ``terms``, the batch-time model's seven integer features (the order of
# BatchTimeModel.weights after the intercept), and ``outs`` = (rows that got their first
# token, listed in work[1]; rows that finished, in work[0]; whether an output token was
# applied, for the livelock watch).
#
# How the helpers are written matters for speed. Inlining binds each array argument to a new
# variable, which numba reference-counts: an atomic increment and decrement per call of a
# helper. LLVM removes the pair unless the variable dies at different points on paths that
# meet again (an ``if`` without ``else``, a short-circuit ``and`` / ``or``, a loop's
# ``break``, after its last use), or the region it lives in has an exit that raises (every
# division by a variable, under numba's default error model, and every call of a compiled
# function that is not inlined). So: a per-request helper reads its arrays before it
# branches, or writes them on every path, and calls nothing; the block pool's functions are
# called from the phases themselves; the phases' loops end without a ``break`` (the ``ok``
# and ``blocked`` flags); and step() uses numpy's error model (no division here can be by
# zero: block sizes and queue lengths are at least 1), so that the phases' own arrays cost
# nothing either. Only with prefix caching, whose pool calls can raise, does each phase
# still pay one pair per array and step. What ignoring this cost, measured: a first split
# made every forecast twice as slow (per-request pairs), a ``break`` in the running loop made
# a simulation of small steps 1.4x slower (per-phase pairs). Measured as it is, against the
# single-function step() it replaced: the same times in benchmarks/forecast_speed.py and
# benchmarks/simulate_speed.py (ratios 0.89-1.04), and within 5% of its instructions
# (callgrind).


@njit(cache=True, nogil=True, inline="always")
def chunk(todo, cap, budget):  # pragma: no cover - jit
    """Tokens a request with ``todo`` tokens left gets: at most the chunk cap and the budget
    (chunked prefill)."""
    n = todo
    if n > cap:
        n = cap
    if n > budget:
        n = budget
    return n


@njit(cache=True, nogil=True, inline="always")
def registrable(req, r, tokens, bs, shift):  # pragma: no cover - jit
    """Prefix caching: how far row ``r``, computed up to ``tokens``, has full blocks of known
    tokens (prompt and applied outputs) to register in the cache, or 0 if none is new."""
    known, cached = req[r, PROMPT] + req[r, OUTPUT], req[r, NCACHED]
    t = tokens if tokens < known else known
    return t if (t >> shift if shift >= 0 else t // bs) > cached else 0


@njit(cache=True, nogil=True, inline="always")
def batch_terms(terms, c, n, length, outputs):  # pragma: no cover - jit
    """``terms`` plus the share of a request scheduled ``n`` tokens past ``c`` computed, its
    sequence ``length`` tokens long with ``outputs`` output tokens (a token in flight counts as
    the output it will be): one decode token if it has output and a single token left, else
    ``n`` prefill tokens."""
    n_dec, n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq = terms
    len_sum += length
    len_sq += length * length
    if length - c == 1 and outputs >= 1:
        n_dec += 1
        dec_ctx += c
    else:
        n_pre += n
        pre_sq += n * n
        pre_attn += n * c + n * (n + 1) // 2
    return n_dec, n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq


@njit(cache=True, nogil=True, inline="always")
def advance(req, r, c, n, length, pend, asyn):  # pragma: no cover - jit
    """Row ``r``'s computed tokens grow by its chunk (vLLM's ``_update_after_schedule``); a
    chunk that reaches the end of the sequence samples a token. Returns whether it is applied
    now (synchronously: :func:`sample`, stamped with this step's end); asynchronously it is a
    placeholder (``PEND``) whose token arrives after the next schedule
    (:func:`apply_async_outputs`), and ``NINF`` marks the row in flight (2: it samples)."""
    req[r, COMP] = c + n
    if not asyn:
        return c + n == length
    if c + n == length:
        req[r, PEND] = pend + 1
        req[r, NINF] = 2
    else:
        req[r, NINF] = 1
    return False


@njit(cache=True, nogil=True, inline="always")
def sample(req, r, max_len, work, outs):  # pragma: no cover - jit
    """Row ``r``'s next output token is applied (vLLM's ``update_from_output``): the first
    one joins the step's first tokens (``work[1]``); the request finishes, joining
    ``work[0]``, at its stop length or when its sequence reaches ``max_model_len``
    (``check_stop``). Returns ``outs`` updated."""
    stop, prompt = req[r, STOP], req[r, PROMPT]
    o = req[r, OUTPUT] + 1
    req[r, OUTPUT] = o
    nf, nd = outs[0], outs[1]
    if o == 1:
        work[1, nf] = r
        nf += 1
    if o < stop and prompt + o < max_len:
        return nf, nd, True
    work[0, nd] = r
    return nf, nd + 1, True


@njit(cache=True, nogil=True, inline="always")
def requeue(req, v, wq, wh):  # pragma: no cover - jit
    """Recompute preemption of row ``v``, its blocks given back (vLLM's ``_preempt_request``):
    its computed tokens are forgotten (its outputs are kept, to be computed again as prompt)
    and it goes to the front of the waiting queue (head ``wh``); a token it has in flight
    still arrives, stale. Returns the queue's new head."""
    stale = req[v, INF] > 0
    req[v, COMP] = 0
    req[v, PEND] = 0
    req[v, STALE] = stale
    wh = wh - 1 if wh > 0 else wq.shape[0] - 1
    wq[wh] = v
    return wh


@njit(cache=True, nogil=True, inline="always")
def has_adapter(adapters, nl, mask, a):  # pragma: no cover - jit
    """Whether adapter ``a`` is among the step's ``nl`` adapters (``adapters[1, :nl]``; those
    below 63 also as bits of ``mask``: one test for the usual ids, where the list would cost
    ``max_loras`` per scheduled request)."""
    if a < 63:
        return (mask >> a) & 1 == 1
    found = False
    for j in range(nl):
        if adapters[1, j] == a:
            found = True
    return found


@njit(cache=True, nogil=True, inline="always")
def add_adapter(adapters, nl, mask, a):  # pragma: no cover - jit
    """The step's adapters with ``a`` (> 0; 0, the base model, is none) added if new;
    returns their count and mask."""
    if a > 0 and not has_adapter(adapters, nl, mask, a):
        adapters[1, nl] = a
        nl += 1
        if a < 63:
            mask |= 1 << a
    return nl, mask


@njit(cache=True, nogil=True, inline="always")
def list_adapters(adapters, nbig, mask):  # pragma: no cover - jit
    """The running phase's adapters listed in ``adapters[1]``: the ids of 63 and more already
    there (``nbig``), then those of ``mask``'s bits; returns their count."""
    nl = nbig
    m = mask
    a = 0
    while m != 0:
        if m & 1:
            adapters[1, nl] = a
            nl += 1
        m >>= 1
        a += 1
    return nl


@njit(cache=True, nogil=True, inline="always")
def schedule_running(req, run, wq, st, cfg, cap, work, out, pool, kmap, rb, rk, undo,
                     adapters):  # pragma: no cover - jit
    """Phase 1 (vLLM's ``schedule()``, "schedule the RUNNING requests"): each running request
    in order, while budget remains, gets its next chunk; while too few blocks are free for it,
    the newest running request is preempted (maybe itself: then it is not scheduled and the
    phase ends). Asynchronously, a request whose token in flight is its last, or reaches
    ``max_model_len``, is left out. Writes ``out[0]`` (budget left) and ``out[7]``
    (preemptions) and ``out[10]``: with ``max_loras`` (``adapters`` not None), the distinct
    adapters of the requests scheduled, listed in ``adapters[1]``; returns (requests
    scheduled, terms, outs)."""
    budget, bs, shift, max_len, asyn = cfg[BUDGET], cfg[BS], cfg[SHIFT], cfg[MAXLEN], cfg[ASYNC]
    free, nrun, wh, wc = st[FREE], st[NRUN], st[WH], st[WC]
    nl = 0
    mask = 0
    terms = (0, 0, 0, 0, 0, 0, 0)
    outs = (0, 0, False)
    ns = 0
    preempted = 0
    i = 0
    while i < nrun and budget > 0:
        r = run[i]
        c = req[r, COMP]
        pend = req[r, PEND] if asyn else 0
        outputs = req[r, OUTPUT] + pend
        length = req[r, PROMPT] + outputs
        n = chunk(length - c, cap, budget)
        if asyn and ((pend > 0 and c + 2 - pend >= req[r, PROMPT] + req[r, STOP])
                     or max_len - c - 1 <= 0):
            i += 1  # its token in flight is its last, or reaches max_model_len
            continue
        # (synchronously a chunk never reaches past max_model_len - 1: no need to cap)
        if asyn and n > max_len - c - 1:
            n = max_len - c - 1
        need = kv_need(req, r, c + n, bs, shift)
        ok = True
        while free < need:  # preempt the newest running request (maybe r itself)
            nrun -= 1
            v = run[nrun]
            free += release_blocks(req, v, pool, rb, undo) if kmap is not None else kv_release(
                req, v)
            wh = requeue(req, v, wq, wh)
            wc += 1
            preempted += 1
            if v == r:  # still too big with all after it preempted: it waits
                ok = False
                break
        if not ok:  # nrun == i: the loop's test ends the phase (no ``break``: see above)
            continue
        i += 1
        if kmap is not None and need > 0:  # prefix caching: from the free queue's head
            pool_allocate(pool, kmap, rb, req[r, BOFF] + req[r, HELD], need, undo)
        free -= kv_take(req, r, need)
        if kmap is not None:  # its full blocks of known tokens are registered at once
            t = registrable(req, r, c + n, bs, shift)
            if t > 0:
                register_blocks(req, r, pool, kmap, rb, rk, t, bs, undo)
        budget -= n
        ns += 1
        if adapters is not None:  # (the usual ids as bits: no array written per request;
            a = req[r, LORA]  # bit 0, the base model, is cleared after the loop)
            if a < 63:
                mask |= 1 << a
            else:
                nl, mask = add_adapter(adapters, nl, mask, a)
        terms = batch_terms(terms, c, n, length, outputs)
        if advance(req, r, c, n, length, pend, asyn):
            outs = sample(req, r, max_len, work, outs)
    st[FREE], st[NRUN], st[WH], st[WC] = free, nrun, wh, wc
    out[0] = budget
    out[7] = preempted
    out[10] = 0
    if adapters is not None:
        out[10] = list_adapters(adapters, nl, mask & ~1)
    return ns, terms, outs


@njit(cache=True, nogil=True, inline="always")
def schedule_waiting(req, run, wq, st, cfg, cap, work, out, tally, pool, kmap, rb, rk, undo,
                     adapters):  # pragma: no cover - jit
    """Phase 2 (vLLM's "schedule the WAITING requests"; only in a step that preempted
    nobody): the waiting queue's head, FCFS, while budget and a seat remain, gets its first
    chunk if the block ledger admits it (its whole sequence fits, with the watermark while
    others run); if not, admission stops: nobody behind it is admitted. With prefix caching, a
    request with nothing computed first looks up its cached prefix: only the rest is computed,
    and a hit on a block nobody holds costs a free block. With ``max_loras``, a request whose
    adapter is not among the step's adapters (``adapters[1, :out[10]]``) when they are
    ``max_loras`` already is skipped, before any lookup: it leaves the queue for the rest of
    the phase (listed in ``adapters[0]``) and goes back to its front, in queue order, when the
    phase ends. Takes the budget from ``out[0]``, writes ``out[1]`` (budget left),
    ``out[8]`` / ``out[9]`` (prefix-cache queries and hits), ``out[10]`` (the step's
    adapters), ``out[11]`` (1 if the phase went through the whole queue: each request
    admitted or skipped); returns ``tally`` (requests scheduled, terms, outs) updated."""
    budget, bs, shift, max_len, asyn = out[0], cfg[BS], cfg[SHIFT], cfg[MAXLEN], cfg[ASYNC]
    max_seqs, wm, full, n_q = cfg[MAXSEQS], cfg[WM], cfg[FULLSEQ], wq.shape[0]
    max_loras = cfg[MAXLORAS]
    free, nrun, wh, wc = st[FREE], st[NRUN], st[WH], st[WC]
    ns, terms, outs = tally
    queried = 0
    hit_tokens = 0
    nl = out[10]
    mask = 0
    if adapters is not None:
        for j in range(nl):  # (the running phase's adapters)
            if adapters[1, j] < 63:
                mask |= 1 << adapters[1, j]
    nskip = 0
    blocked = False  # the head was not admitted (a flag, not a ``break``: see above)
    while not blocked and wc > 0 and budget > 0 and nrun < max_seqs:
        r = wq[wh]
        a = 0
        if adapters is not None:
            a = req[r, LORA]
            if a > 0 and nl >= max_loras and not has_adapter(adapters, nl, mask, a):
                adapters[0, nskip] = r  # its adapter would exceed max_loras: skipped
                nskip += 1
                wh = (wh + 1) % n_q
                wc -= 1
                continue
        c = req[r, COMP]
        pend = req[r, PEND] if asyn else 0
        outputs = req[r, OUTPUT] + pend
        length = req[r, PROMPT] + outputs
        n = chunk(length - c, cap, budget)
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
                n = chunk(length - c, cap, budget)
                req[r, HELD] = hits
        need = kv_admit(req, r, length if length < max_len else max_len, c + n, free, spare,
                        full, bs, shift)
        if need < 0:  # not admitted: nobody behind it is
            req[r, HELD] = 0
            blocked = True
            continue
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
        if kmap is not None and need > 0:  # prefix caching: from the free queue's head
            pool_allocate(pool, kmap, rb, req[r, BOFF] + req[r, HELD], need, undo)
        free -= kv_take(req, r, need)
        if kmap is not None:  # its full blocks of known tokens are registered at once
            t = registrable(req, r, c + n, bs, shift)
            if t > 0:
                register_blocks(req, r, pool, kmap, rb, rk, t, bs, undo)
        budget -= n
        ns += 1
        if adapters is not None:
            nl, mask = add_adapter(adapters, nl, mask, a)
        terms = batch_terms(terms, c, n, length, outputs)
        if advance(req, r, c, n, length, pend, asyn):
            outs = sample(req, r, max_len, work, outs)
    out[11] = 1 if not blocked and wc == 0 else 0
    if adapters is not None:
        for j in range(nskip - 1, -1, -1):  # the skipped go back to the front, in queue order
            wh = wh - 1 if wh > 0 else n_q - 1
            wq[wh] = adapters[0, j]
            wc += 1
    st[FREE], st[NRUN], st[WH], st[WC] = free, nrun, wh, wc
    out[10] = nl
    st[PQ] += queried
    st[PH] += hit_tokens
    out[1] = budget
    out[8] = queried
    out[9] = hit_tokens
    return ns, terms, outs


@njit(cache=True, nogil=True, inline="always")
def step_flags(st, cfg, preempted, ns, tail, admitted):  # pragma: no cover - jit
    """The flags a base replay records for the step (DRAINED, SEATS, PREEMPTED, NO_MODEL,
    TAIL, ADMITTED)."""
    waiting, seats = st[WC], st[NRUN] < cfg[MAXSEQS]
    flags = 0
    if admitted:
        flags |= ADMITTED
    if preempted == 0 and waiting == 0:
        flags |= DRAINED
    if preempted == 0 and tail:
        flags |= TAIL
    if seats:
        flags |= SEATS
    if preempted > 0:
        flags |= PREEMPTED
    if ns == 0:
        flags |= NO_MODEL
    return flags


@njit(cache=True, nogil=True, inline="always")
def step_duration(w, terms, noise, seed, k, lora):  # pragma: no cover - jit
    """The step's duration: the batch-time model of what it scheduled (``w``: intercept, then
    the weights of ``terms``; exact integer features, summed in this order in both forms);
    ``lora``: the step holds a request on an adapter (its LoRA terms, ``w[8:11]``, added);
    ``noise`` > 0 multiplies it by a mean-one log-normal factor (:func:`step_normal`)."""
    n_dec, n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq = terms
    dur = (w[0] + w[1] * n_dec + w[2] * n_pre + w[3] * pre_sq + w[4] * pre_attn
           + w[5] * dec_ctx + w[6] * len_sum + w[7] * len_sq)
    if lora:
        dur += w[8] + w[9] * n_pre + w[10] * n_dec
    if noise > 0.0:
        dur *= math.exp(noise * step_normal(seed, k) - 0.5 * noise * noise)
    return dur


@njit(cache=True, nogil=True, inline="always")
def apply_async_outputs(req, run, wq, st, cfg, preempted, outs, work, pool, kmap, rb, rk,
                        undo):  # pragma: no cover - jit
    """Asynchronous scheduling (vLLM's ``AsyncScheduler`` under the engine core's batch queue
    of two): after this step is scheduled, the previous step's outputs are applied — a
    request preempted since receives its token too (stale: its placeholders were reset), and
    with prefix caching a running one registers its newly full blocks
    (``_update_request_with_output``) —; then this step's rows become the ones in flight. All
    of them are running now or were preempted this step (at the queue's front). Sets
    ``st[NINFL]``; returns ``outs`` updated."""
    bs, shift, max_len = cfg[BS], cfg[SHIFT], cfg[MAXLEN]
    nrun, wh, n_q = st[NRUN], st[WH], wq.shape[0]
    ninfl = 0
    for j in range(nrun + preempted):
        r = run[j] if j < nrun else wq[(wh + j - nrun) % n_q]
        if req[r, INF] == 2 and req[r, DONE] == 0:
            if req[r, STALE] == 0:
                req[r, PEND] -= 1
            outs = sample(req, r, max_len, work, outs)
            if kmap is not None and req[r, STALE] == 0:  # (vLLM's AsyncScheduler caches here)
                t = req[r, COMP] - req[r, PEND]
                known = req[r, PROMPT] + req[r, OUTPUT]
                if t > known:
                    t = known
                if (t >> shift if shift >= 0 else t // bs) > req[r, NCACHED]:
                    register_blocks(req, r, pool, kmap, rb, rk, t, bs, undo)
        req[r, STALE] = 0
        req[r, INF] = req[r, NINF]
        req[r, NINF] = 0
        if req[r, INF] > 0:
            ninfl += 1
    st[NINFL] = ninfl
    return outs


@njit(cache=True, nogil=True, inline="always")
def stamp_outputs(stamps, work, nf, nd, t):  # pragma: no cover - jit
    """The step's first tokens and finishes are stamped with ``t`` (this step's end; with
    asynchronous scheduling, the previous step's: this step's start)."""
    for j in range(nf):
        stamps[work[1, j], 0] = t
    for j in range(nd):
        stamps[work[0, j], 1] = t


@njit(cache=True, nogil=True, inline="always")
def free_finished(req, run, wq, st, work, nd, preempted, asyn, pool, kmap, rb,
                  undo):  # pragma: no cover - jit
    """The step's finished rows (``work[0, :nd]``) give their blocks back (vLLM's
    ``_free_request``) and leave the running order; asynchronously also the front of the
    waiting queue, where a request preempted this step with its last token in flight went."""
    free = st[FREE]
    for j in range(nd):
        r = work[0, j]
        free += release_blocks(req, r, pool, rb, undo) if kmap is not None else kv_release(req, r)
        req[r, DONE] = 1
    st[FREE] = free
    m = 0
    for j in range(st[NRUN]):
        r = run[j]
        if req[r, DONE] == 0:
            run[m] = r
            m += 1
    st[NRUN] = m
    if not asyn or preempted == 0:
        return
    # the preempted survivors are packed, in order, at the back of the front block
    n_q, wh = wq.shape[0], st[WH]
    m = 0
    for j in range(preempted - 1, -1, -1):
        r = wq[(wh + j) % n_q]
        if req[r, DONE] == 0:
            wq[(wh + preempted - 1 - m) % n_q] = r
            m += 1
    st[WH] = (wh + preempted - m) % n_q
    st[WC] -= preempted - m


@njit(cache=True, nogil=True, inline="always")
def watch_livelock(st, wq):  # pragma: no cover - jit
    """A step that only preempted: the head preempted itself and nothing runs after this step
    (whoever was skipped has just finished). A livelock if this happened before with no output
    since: every request waits with nothing computed, in the same order, with the same
    outputs, so the steps since then repeat for ever. Returns the head's row then, else -1."""
    lone = wq[st[WH]]
    if st[LONE] == lone and st[QUIET] == 1:
        return lone
    st[LONE] = lone
    st[QUIET] = 1
    return -1


@njit(cache=True, nogil=True, error_model="numpy")  # (see "How the helpers are written")
def step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk, undo,
         adapters, noise=0.0, extra=0):  # pragma: no cover - jit
    """One scheduler step, phase by phase as vLLM's ``Scheduler.schedule()`` and
    ``update_from_output`` take it (``docs/scheduling-rules.md``): the running requests
    (:func:`schedule_running`), the waiting ones if nobody was preempted
    (:func:`schedule_waiting`), the duration (:func:`step_duration`), asynchronously the
    previous step's outputs (:func:`apply_async_outputs`), then the stamps and the finished
    requests' leaving; the same phases as :meth:`ReferenceEngine.step
    <duetime.engine.scheduler.ReferenceEngine.step>`. A scheduled request's tokens are applied
    at once: no later decision in the step reads it again (preemption victims come from the
    unscheduled tail).

    ``work``: int64 scratch (``WORK_ROWS``, N); ``out`` (int64[OUT_SIZE]) gets [budget left
    after the running phase, after admission, free blocks after allocation, flags, the
    waiting head (on STUCK), first tokens, finished, preempted, prefix-cache queries and hits
    (tokens, of the admitted requests that looked up), the step's adapters (with
    ``max_loras``: ``adapters[1, :out[10]]``), whether admission went through the whole
    queue, with ``max_loras`` the decode and the prefill tokens scheduled];
    the rows that got their first token are ``work[1, :out[5]]`` and those that finished
    ``work[0, :out[6]]``. Returns the number of
    scheduled requests, or STUCK. ``noise`` > 0 multiplies the step's duration by a mean-one
    log-normal factor with that log-space spread (a simulated instance's "true" timing; drawn
    from the engine's own stream, see :func:`step_normal`). ``extra``: requests not in the
    arrays that count as present (a forecaster's probe): a request alone ignores the
    long-prefill threshold.
    """
    t_start = clock[0]
    if undo is not None:  # key events of this step's scheduling (see block_pool_kernel)
        undo[U_STAMP] = 2 * st[K]
    # a lone request ignores the long-prefill threshold (nobody to starve)
    cap = cfg[CAP] if st[NRUN] + st[WC] + extra > 1 else cfg[BUDGET]
    tally = schedule_running(req, run, wq, st, cfg, cap, work, out, pool, kmap, rb, rk, undo,
                             adapters)
    preempted = out[7]
    ns_running = tally[0]
    if preempted == 0:
        tally = schedule_waiting(req, run, wq, st, cfg, cap, work, out, tally, pool, kmap, rb,
                                 rk, undo, adapters)
    else:  # nobody is admitted in a step that preempted
        out[1], out[8], out[9], out[11] = out[0], 0, 0, 0
    ns, terms, outs = tally
    out[2] = st[FREE]
    out[3] = step_flags(st, cfg, preempted, ns, out[11], ns > ns_running)
    if ns == 0 and preempted == 0 and st[NINFL] == 0:  # (without arrivals: stuck for ever)
        out[4] = wq[st[WH]] if st[WC] > 0 else -1
        out[5] = 0
        out[6] = 0
        return STUCK
    if undo is not None:  # key events after the scheduling: outputs applied, blocks freed
        undo[U_STAMP] = 2 * st[K] + 1
    t_end = t_start
    lora = False
    if adapters is not None:  # (max_loras) the step's tokens, for a base record
        lora = out[10] > 0
        out[12] = terms[0]
        out[13] = terms[1]
    if ns > 0:
        t_end += step_duration(w, terms, noise, st[NSEED], st[K], lora)
    t_out = t_end  # when the outputs applied now were made
    if cfg[ASYNC]:  # the previous step's: its end is this step's start
        t_out = t_start
        outs = apply_async_outputs(req, run, wq, st, cfg, preempted, outs, work, pool, kmap,
                                   rb, rk, undo)
    nf, nd, made = outs
    stamp_outputs(stamps, work, nf, nd, t_out)
    if nd > 0:
        free_finished(req, run, wq, st, work, nd, preempted, cfg[ASYNC], pool, kmap, rb, undo)
    out[5] = nf
    out[6] = nd
    if made:
        st[QUIET] = 0
    if preempted > 0 and ns == 0:
        lone = watch_livelock(st, wq)
        if lone >= 0:
            out[4] = lone
            return STUCK
    st[K] += 1
    clock[0] = t_end
    return ns


@njit(cache=True, nogil=True)
def run_probe(req, stamps, run, wq, st, clock, cfg, w, pool, kmap, rb, rk, undo, adapters,
              probe, until_finish, max_steps):  # pragma: no cover - jit
    """Step until ``probe`` gets its first token (or finishes). Returns (code, detail)."""
    work = np.empty((WORK_ROWS, run.shape[0]), dtype=np.int64)
    out = np.zeros(OUT_SIZE, dtype=np.int64)
    col = 1 if until_finish else 0
    while np.isnan(stamps[probe, col]):
        if st[K] >= max_steps:
            return STEP_CAP, 0
        if st[NRUN] == 0 and st[WC] == 0:
            return IDLE, 0
        got = step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk,
                   undo, adapters)
        if got < 0:
            return got, out[4]
    return REACHED, 0


@njit(cache=True, nogil=True)
def run_base(req, stamps, run, wq, st, clock, cfg, w, pool, kmap, rb, rk, undo, adapters, rec,
             cum, rec_t, n_rec, room, target, max_steps):  # pragma: no cover - jit
    """Step and record until the probe room since admission first reached the queue's tail
    reaches ``target``.

    Per step ``s``: ``rec[s] = [budget left after admission, free blocks after allocation,
    flags]`` — with ``max_loras`` (``adapters`` not None), then the number of the step's
    adapters, its decode and prefill tokens and the adapters (``rec`` has ``6 + max_loras``
    columns: ``REC_LORA``.. below) —, ``rec_t[s]`` = its end time, and prefix sums
    ``cum[s + 1]`` (``cum[0]`` = 0) of y = min(cap, budget left after the running phase) — the
    tokens a probe at the tail of the running order could get —, of y², of the steps with y >
    0 and of the steps that preempted, ran no model or admitted a request (steps whose
    admissions a probe running in them may change).
    ``room`` = [y summed from the first step that went through the whole queue on (``TAIL``:
    without ``max_loras`` the first that drained it), 1 once there, that step].
    Returns (code, recorded count, detail).
    """
    work = np.empty((WORK_ROWS, run.shape[0]), dtype=np.int64)
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
                   undo, adapters, 0.0, 1)
        if got < 0:
            return got, n_rec, out[4]
        y = cap if out[0] > cap else out[0]
        rec[n_rec, 0] = out[1]
        rec[n_rec, 1] = out[2]
        rec[n_rec, 2] = out[3]
        if adapters is not None:  # max_loras: the step's adapters and tokens
            nl = out[10]
            rec[n_rec, REC_NL] = nl
            rec[n_rec, REC_DEC] = out[12]
            rec[n_rec, REC_PRE] = out[13]
            for j in range(min(nl, rec.shape[1] - REC_ADAPTERS)):  # (more than max_loras:
                rec[n_rec, REC_ADAPTERS + j] = adapters[1, j]     # see Forecaster)
        rec_t[n_rec] = clock[0]
        cum[n_rec + 1, 0] = cum[n_rec, 0] + y
        cum[n_rec + 1, 1] = cum[n_rec, 1] + y * y
        cum[n_rec + 1, 2] = cum[n_rec, 2] + (1 if y > 0 else 0)
        cum[n_rec + 1, 3] = cum[n_rec, 3] + (
            1 if out[3] & (PREEMPTED | NO_MODEL | ADMITTED) else 0)
        if room[1] == 0 and out[3] & TAIL:
            room[1] = 1
            room[2] = n_rec
        n_rec += 1
        if room[1] == 1:
            room[0] += y


@njit(cache=True, nogil=True)
def scan_admission(rec, s, n, lora, max_loras):  # pragma: no cover - jit
    """The first recorded base step from ``s`` (up to ``n``) where a probe at the queue's
    tail on adapter ``lora`` is reached with budget and a seat left (``TAIL``, ``SEATS``,
    budget after admission > 0) and, with ``max_loras``, room for its adapter (the step's
    adapters fewer than ``max_loras`` or including it; a step that ran more is returned too:
    its record lists only the first); ``n`` if none. (Compiled: a probe on a cold adapter
    may scan a thousand steps.)"""
    need = TAIL | SEATS
    while s < n:
        if rec[s, 2] & need == need and rec[s, 0] > 0:
            if max_loras == 0 or lora <= 0:
                return s
            nl = rec[s, REC_NL]
            if nl < max_loras or nl > max_loras:
                return s
            for j in range(nl):
                if rec[s, REC_ADAPTERS + j] == lora:
                    return s
        s += 1
    return n


@njit(cache=True, nogil=True)
def decode_ahead(req, run, st, cfg, steps, probe_blocks):  # pragma: no cover - jit
    """The decode features of the next ``steps`` steps where the state only decodes from
    here with a probe beside it (:meth:`Forecaster._fast_forward
    <duetime.engine.forecasting.Forecaster._fast_forward>`): per running request ``r`` its
    ``m_r`` remaining tokens (to its stop length or ``max_model_len``; asynchronously a token
    in flight counts as an output) in the next ``m_r`` steps, its context growing by one a
    step. Returns (ok, decode tokens, Σ context, Σ length, Σ length²); ok is False where a
    request still prefills, someone waits, seats or budget do not hold everyone and the
    probe, or the free blocks do not cover everyone's ends and ``probe_blocks``."""
    nrun = st[NRUN]
    if st[WC] > 0 or nrun + 1 > cfg[MAXSEQS] or nrun + 1 > cfg[BUDGET]:
        return False, 0, 0, 0, 0
    bs, max_len = cfg[BS], cfg[MAXLEN]
    n_dec = ctx = lsum = lsq = grow = 0
    for i in range(nrun):
        r = run[i]
        prompt, c = req[r, PROMPT], req[r, COMP]
        out = req[r, OUTPUT] + (req[r, PEND] if cfg[ASYNC] else 0)
        stop = req[r, STOP] if req[r, STOP] < max_len - prompt else max_len - prompt
        left = stop - out
        if left <= 0:
            continue  # (asynchronously: its last token in flight)
        length = prompt + out
        if out < 1 or c != length - 1:
            return False, 0, 0, 0, 0  # (a prefill still to finish)
        m = left if left < steps else steps
        n_dec += m
        tri = m * (m - 1) // 2
        ctx += m * c + tri
        lsum += m * length + tri
        lsq += m * length * length + length * m * (m - 1) + (m - 1) * m * (2 * m - 1) // 6
        need = (c + left + bs - 1) // bs - req[r, HELD]
        if need > 0:
            grow += need
    if st[FREE] < grow + probe_blocks:
        return False, 0, 0, 0, 0
    return True, n_dec, ctx, lsum, lsq


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
              adapters, t_limit, stop_on_finish, noise):  # pragma: no cover - jit
    """Step while the clock is before ``t_limit`` (a step that starts before it may end after
    it). Returns (code, detail): REACHED, IDLE, FINISHED (``stop_on_finish``: the step's
    finished rows are ``work[0, :out[6]]``), or STUCK (detail: the waiting head's row)."""
    while clock[0] < t_limit:
        if st[NRUN] == 0 and st[WC] == 0:
            return IDLE, 0
        got = step(req, stamps, run, wq, st, clock, cfg, w, work, out, pool, kmap, rb, rk,
                   undo, adapters, noise)
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
