"""Random snapshot builders shared by the tests (plain ``random``, seedable, and hypothesis)."""

from __future__ import annotations

import random

from duetime.engine import Paper4, ResidentRequest, SchedulerConfig, Sfs6, Snapshot
from duetime.engine.snapshot import RequestTable

PAPER4 = Paper4(b0=0.004, b1=2.0e-5, b2=5.0e-8, b3=1.0e-9)
SFS6 = Sfs6(c0=0.0072959, cp=2.0789e-5, cpsq=5.1196e-10, cd=2.5632e-5, cs=4.6491e-8,
            css=2.6851e-13)


def random_snapshot(rng: random.Random, *, n_running: int | None = None,
                    n_waiting: int | None = None, kv_pressure: bool | None = None,
                    model=None) -> Snapshot:
    """A consistent but otherwise arbitrary snapshot: decoders, partial prefills and
    recomputing requests in any order, waiting requests (some preempted, with outputs)."""
    bs = rng.choice([1, 4, 10, 16])
    budget = rng.choice([8, 32, 64, 256, 2048, 8192])
    max_seqs = rng.choice([2, 4, 16, 64, 256])
    max_seqs = min(max_seqs, budget)
    thr = rng.choice([0, 0, 0, 4, 16, 100])
    max_len = rng.choice([4096, 32768])
    if n_running is None:
        n_running = rng.randint(0, min(max_seqs, 40))
    n_running = min(n_running, max_seqs)
    if n_waiting is None:
        n_waiting = rng.randint(0, 12)

    def lengths() -> tuple[int, int]:
        p = rng.choice([rng.randint(1, 40), rng.randint(1, 400), rng.randint(1, 3000)])
        t = rng.choice([rng.randint(1, 10), rng.randint(1, 200)])
        return min(p, max_len - 2), t

    running = []
    held = 0
    for i in range(n_running):
        p, t = lengths()
        kind = rng.random()
        if kind < 0.6:  # decoding
            o = rng.randint(1, max(1, min(t + 30, max_len - p - 1)))
            c = p + o - 1
        elif kind < 0.85:  # partial prefill
            o = 0
            c = rng.randint(0, p - 1)
        else:  # recomputing after preemption (has outputs, partially recomputed)
            o = rng.randint(1, max(1, min(t + 5, max_len - p - 1)))
            c = rng.randint(0, p + o - 2) if p + o >= 2 else 0
        if p + o >= max_len:
            continue
        held += -(-c // bs)
        running.append(ResidentRequest(f"r{i}", p, c, o, t, 0.0))
    waiting = []
    for i in range(n_waiting):
        p, t = lengths()
        o = rng.randint(1, 20) if rng.random() < 0.2 else 0
        if p + o >= max_len:
            o = 0
        waiting.append(ResidentRequest(f"w{i}", p, 0, o, t, 0.0))
    if kv_pressure is None:
        kv_pressure = rng.random() < 0.5
    if kv_pressure:
        blocks = max(held + rng.randint(0, 50), -(-max_len // bs) // 8, 8)
    else:
        blocks = held + 1_000_000
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          max_model_len=max_len, block_size=bs,
                          num_gpu_blocks=blocks + 1,  # (one is vLLM's null block)
                          long_prefill_token_threshold=thr,
                          scheduler_reserve_full_isl=rng.random() < 0.85,
                          watermark=rng.choice([0.0, 0.0, 0.0, 0.01, 0.05]))
    if model is None:
        model = rng.choice([PAPER4, SFS6])
    return Snapshot(cfg, model, time=rng.uniform(0, 100), running=running, waiting=waiting)


def lora_snapshot(rng: random.Random, **kwargs) -> Snapshot:
    """A :func:`random_snapshot` on vLLM with ``--enable-lora``: ``max_loras`` from 1 to 8,
    adapters 1.. on its requests (Zipf-popular; some on the base model), the running ones on at
    most ``max_loras`` distinct adapters (as vLLM's scheduler keeps them); mostly a model that
    prices LoRA steps."""
    snap = random_snapshot(rng, **kwargs)
    max_loras = rng.choice([1, 2, 3, 8])
    adapters = rng.choice([2, 4, 16])
    weights = [1.0 / (a + 1) for a in range(adapters + 1)]
    live = rng.sample(range(1, adapters + 1), min(max_loras, adapters))
    run, wait = snap.running_table, snap.waiting_table
    r_lora = [rng.choice([0, *live]) for _ in range(len(run))]
    w_lora = rng.choices(range(adapters + 1), weights, k=len(wait))
    cfg = SchedulerConfig(**{**snap.config.to_dict(), "max_loras": max_loras})
    model = snap.model
    if rng.random() < 0.75:  # a step with LoRA costs more (over all its tokens)
        per_token = max(model.weights[1], model.weights[2], 1e-6)
        model = model.with_lora(model.intercept * rng.uniform(0.1, 1.0),
                                per_token * rng.uniform(0.5, 2.0),
                                per_token * rng.uniform(0.5, 3.0))
    return Snapshot(cfg, model, time=snap.time,
                    running=RequestTable(run.ids, run.prompt, run.computed, run.output,
                                         run.predicted, run.arrival, r_lora),
                    waiting=RequestTable(wait.ids, wait.prompt, wait.computed, wait.output,
                                         wait.predicted, wait.arrival, w_lora))
