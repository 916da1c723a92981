"""The SFS page's two interactive panels, live on duetime's own simulator and engine models:
``GET /demo`` (the page), ``POST /duetime/demo/simulate`` and ``POST /duetime/demo/batch``.

* simulate: one arrival trace of the ``demo`` workload (three identical instances) routed by
  each of four routers (:func:`duetime.experiments.catalog.demo`'s setting, through the same
  :class:`~duetime.experiments.runner.Runner`), with the chosen router's per-request timeline,
  each instance's queue over time and a small load sweep.
* batch: one token batch of a chosen composition priced, term by term, by the batch-time model
  of every instance of the serving pool, and the step time as one knob varies while the batch's
  total tokens stay fixed.

Simulations run in a worker thread, one at a time (the event loop keeps serving the gateway);
inputs are bounded so that one call stays well under a few seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from duetime.engine.batch_time import BatchTimeModel
from duetime.experiments.runner import Point, Runner
from duetime.gateway.config import Pool
from duetime.gateway.observe.pages import page
from duetime.metrics import summarize
from duetime.policy.latency import DELTA
from duetime.policy.registry import LAMBDA
from duetime.sim import SimResult
from duetime.web.errors import ApiError
from duetime.workload import load_workload

WORKLOAD = "demo"
ROUTERS = ("latency-agnostic", "round-robin", "shortest-queue", "sfs")
DETAIL_ROUTERS = (*ROUTERS, "sfs-soft")
TABLE_COLUMNS = ("mean_ttft_s", "p95_ttft_s", "on_time", "utility", "ontime_utility")
MAX_RATE = 12.0
MAX_REQUESTS = 600        # the detail run (each of the four routers)
MAX_SWEEP_REQUESTS = 400  # each sweep point
MAX_SWEEP_RATES = 8
MAX_QUEUED = 4            # simulate calls waiting for the one running before a 429
MAX_TOKENS = 32768        # a batch's tokens (the demo pool's max_num_batched_tokens)
MAX_CONTEXT = 131072      # a sequence's context (the demo pool's max_model_len)
MAX_SEQS = 512            # decode sequences (the demo pool's max_num_seqs)
MAX_PREFILL_REQUESTS = 64
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Knob = Literal["decode_context", "prefill_context", "decode_share", "prefill_requests"]


# -- inputs --------------------------------------------------------------------------------------

class SimulateIn(BaseModel):
    """One simulate call (bounded so that one call takes about a second on one core)."""

    model_config = ConfigDict(extra="forbid")
    rate: float = Field(6.0, gt=0, le=MAX_RATE, description="arrival rate, queries per second")
    requests: int = Field(400, ge=20, le=MAX_REQUESTS, description="requests in the trace")
    router: Literal[DETAIL_ROUTERS] = "sfs"  # type: ignore[valid-type]
    lam: float = Field(LAMBDA.default, ge=0, le=0.01, alias="lambda",
                       description="utility = acc - lambda x cost (micro-dollars)")
    delta: float = Field(DELTA.default, ge=0, le=1e-3,
                         description="sfs-soft: utility lost per microsecond of TTFT forecast")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    sweep_rates: list[float] = Field([3.0, 5.0, 6.0, 7.0, 8.0, 9.0], max_length=MAX_SWEEP_RATES)
    sweep_requests: int = Field(300, ge=20, le=MAX_SWEEP_REQUESTS)

    @field_validator("sweep_rates")
    @classmethod
    def _rates_in_range(cls, rates: list[float]) -> list[float]:
        for r in rates:
            if not 0 < r <= MAX_RATE:
                raise ValueError(f"each rate in (0, {MAX_RATE:g}] q/s, got {r!r}")
        return rates


class BatchIn(BaseModel):
    """One token batch: ``decode_seqs`` decoding sequences of ``decode_context`` tokens each,
    and ``prefill_tokens`` prefill tokens split evenly over ``prefill_requests`` chunks, each
    after ``prefill_context`` tokens already computed and ending its prompt. ``vary``: the
    knob the sweep moves while the batch's total tokens stay fixed."""

    model_config = ConfigDict(extra="forbid")
    decode_seqs: int = Field(5, ge=0, le=MAX_SEQS)
    decode_context: int = Field(2048, ge=0, le=MAX_CONTEXT)
    prefill_tokens: int = Field(512, ge=0, le=MAX_TOKENS)
    prefill_requests: int = Field(1, ge=1, le=MAX_PREFILL_REQUESTS)
    prefill_context: int = Field(0, ge=0, le=MAX_CONTEXT)
    vary: Knob = "decode_context"
    points: int = Field(17, ge=2, le=65)

    @model_validator(mode="after")
    def _fits(self) -> BatchIn:
        total = self.decode_seqs + self.prefill_tokens
        if total < 1:
            raise ValueError("the batch is empty: decode_seqs + prefill_tokens must be >= 1")
        if total > MAX_TOKENS:
            raise ValueError(f"decode_seqs + prefill_tokens must be <= {MAX_TOKENS} (a step's "
                             f"token budget), got {total}")
        if self.prefill_tokens and self.prefill_requests > self.prefill_tokens:
            raise ValueError(f"prefill_requests ({self.prefill_requests}) must be <= "
                             f"prefill_tokens ({self.prefill_tokens})")
        return self


# -- simulate ------------------------------------------------------------------------------------

def _row(name: str, res: SimResult) -> dict[str, Any]:
    s = summarize(res)
    return {"router": name, **{k: s[k] for k in TABLE_COLUMNS}}


def queue_over_time(res: SimResult) -> dict[str, Any]:
    """Each instance's requests awaiting their first token (queued or prefilling) and decoding,
    at every arrival, first token and finish: exact counts, as a step function of time since
    the first arrival."""
    t0 = float(res.requests.arrival[0])
    arrival, first, fin = res.requests.arrival - t0, res.first_token - t0, res.finish - t0
    t = np.unique(np.concatenate([[0.0], arrival, first, fin]))
    waiting, decoding = [], []
    for k in range(len(res.instance_names)):
        mine = res.instance == k
        a, f, e = (np.sort(x[mine]) for x in (arrival, first, fin))
        arrived, firsted, done = (np.searchsorted(x, t, side="right") for x in (a, f, e))
        waiting.append((arrived - firsted).tolist())
        decoding.append((firsted - done).tolist())
    return {"t": t.tolist(), "awaiting_first_token": waiting, "decoding": decoding}


def timeline(res: SimResult) -> dict[str, Any]:
    """Per request: arrival (s since the first), instance, TTFT, target and whether on time."""
    t0 = float(res.requests.arrival[0])
    ttft = res.ttft
    return {"arrival_s": (res.requests.arrival - t0).tolist(), "instance": res.instance.tolist(),
            "ttft_s": ttft.tolist(), "target_s": res.requests.target.tolist(),
            "on_time": (ttft <= res.requests.target).tolist(),
            "task": res.requests.task.tolist(), "prompt_tokens": res.requests.prompt.tolist()}


def simulate(q: SimulateIn) -> dict[str, Any]:
    """The four routers (and sfs-soft when it is the chosen one) on one trace at ``q.rate``,
    the chosen router's timeline and queues, and OnTimeUtility over ``q.sweep_rates``."""
    t_start = time.perf_counter()
    profile = replace(load_workload(WORKLOAD), lam=q.lam)  # routing and metrics use this lambda
    runner = Runner(profile, seed=q.seed)
    routers = ROUTERS if q.router in ROUTERS else (*ROUTERS, q.router)
    table, chosen = [], None
    for r in routers:
        _, res = runner.run(Point(r, q.rate, q.requests, delta=q.delta))
        table.append(_row(r, res))
        if r == q.router:
            chosen = res
    assert chosen is not None
    t_detail = time.perf_counter()
    sweep: dict[str, list[float]] = {r: [] for r in ROUTERS}
    rates = sorted(set(q.sweep_rates))
    for rate in rates:
        for r in ROUTERS:
            _, res = runner.run(Point(r, rate, q.sweep_requests))
            sweep[r].append(summarize(res)["ontime_utility"])
    t_end = time.perf_counter()
    return {
        "workload": WORKLOAD, "rate": q.rate, "requests": q.requests, "router": q.router,
        "lambda": q.lam, "delta": q.delta, "seed": q.seed,
        "instances": chosen.instance_names, "tasks": list(chosen.requests.tasks),
        "table": table,
        "detail": {"router": q.router, "simulated_s": chosen.simulated_s,
                   "requests": timeline(chosen), "queue": queue_over_time(chosen)},
        "sweep": {"rates": rates, "requests": q.sweep_requests, "ontime_utility": sweep},
        "timing": {"detail_s": t_detail - t_start, "sweep_s": t_end - t_detail,
                   "total_s": t_end - t_start},
    }


# -- batch ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Batch:
    """A batch's composition (see :class:`BatchIn`)."""

    decode_seqs: int
    decode_context: int
    prefill_tokens: int
    prefill_requests: int
    prefill_context: int

    @property
    def total_tokens(self) -> int:
        return self.decode_seqs + self.prefill_tokens

    def chunks(self) -> list[int]:
        """The prefill chunks: the prefill tokens split as evenly as integers allow."""
        if not self.prefill_tokens:
            return []
        m = min(self.prefill_requests, self.prefill_tokens)
        base, extra = divmod(self.prefill_tokens, m)
        return [base + (i < extra) for i in range(m)]

    def features(self) -> dict[str, int]:
        """The engine's batch features (:mod:`duetime.engine.batch_time`): a decoding sequence
        of context c has L = c + 1; a prefill chunk of n after c ends its prompt, L = c + n."""
        d, c = self.decode_seqs, self.decode_context
        pc, chunks = self.prefill_context, self.chunks()
        return {"n_dec": d, "n_pre": sum(chunks), "pre_sq": sum(n * n for n in chunks),
                "pre_attn": sum(n * pc + n * (n + 1) // 2 for n in chunks),
                "dec_ctx": d * c,
                "len_sum": d * (c + 1) + sum(pc + n for n in chunks),
                "len_sq": d * (c + 1) ** 2 + sum((pc + n) ** 2 for n in chunks)}


FEATURES = ("n_dec", "n_pre", "pre_sq", "pre_attn", "dec_ctx", "len_sum", "len_sq")
# each model's terms: (coefficient, label, features it multiplies)
TERMS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "paper4": (("b0", "fixed per step", ()),
               ("b1", "dense: every token", ("n_pre", "n_dec")),
               ("b2", "decode attention: context x decode", ("dec_ctx",)),
               ("b3", "prefill attention: chunk x context + chunk²/2", ("pre_attn",))),
    "sfs6": (("c0", "fixed per step", ()),
             ("cp", "prefill tokens", ("n_pre",)),
             ("cpsq", "prefill tokens²", ("pre_sq",)),
             ("cd", "decode tokens", ("n_dec",)),
             ("cs", "sequence lengths ΣL", ("len_sum",)),
             ("css", "sequence lengths² ΣL²", ("len_sq",))),
}
GENERIC_LABELS = ("fixed per step", "decode tokens", "prefill tokens", "prefill tokens²",
                  "prefill attention", "decode attention", "sequence lengths ΣL",
                  "sequence lengths² ΣL²")


def terms(model: BatchTimeModel, feats: dict[str, int]) -> list[dict[str, Any]]:
    """The model's step time for these features, term by term (seconds each); the terms sum to
    :meth:`~duetime.engine.batch_time.BatchTimeModel.duration`."""
    spec = TERMS.get(model.name)
    if spec is None:  # a model this page does not know by name: its weight vector's slots
        w = model.weights  # type: ignore[attr-defined]
        values = (1, *(feats[f] for f in FEATURES))
        return [{"name": f"w{i}", "label": GENERIC_LABELS[i], "coefficient": w[i],
                 "feature": v, "seconds": w[i] * v} for i, v in enumerate(values)]
    coef = model.coefficients
    out = []
    for name, label, fs in spec:
        v = sum(feats[f] for f in fs) if fs else 1
        out.append({"name": name, "label": label, "coefficient": coef[name], "feature": v,
                    "seconds": coef[name] * v})
    return out


def price(model: BatchTimeModel, b: Batch) -> dict[str, Any]:
    """One instance's prediction for batch ``b``: total, per decode token, prefill rate."""
    f = b.features()
    total = model.duration(**f)
    return {"total_s": total, "terms": terms(model, f),
            "per_decode_token_s": total / b.decode_seqs if b.decode_seqs else None,
            "prefill_tokens_per_s": f["n_pre"] / total if f["n_pre"] and total > 0 else None}


def _grid(lo: int, hi: int, points: int) -> list[int]:
    return sorted(set(np.rint(np.linspace(lo, hi, points)).astype(int).tolist()))


def sweep_batches(b: Batch, knob: str, points: int) -> tuple[list[int], list[Batch]]:
    """Batches that differ from ``b`` in ``knob`` only, with the same total tokens:
    ``decode_share`` trades decode sequences for prefill tokens one for one."""
    total = b.total_tokens
    if knob == "decode_context":
        xs = _grid(0, min(MAX_CONTEXT, max(4096, 2 * b.decode_context)), points)
        return xs, [replace(b, decode_context=x) for x in xs]
    if knob == "prefill_context":
        xs = _grid(0, min(MAX_CONTEXT, max(4096, 2 * b.prefill_context)), points)
        return xs, [replace(b, prefill_context=x) for x in xs]
    if knob == "decode_share":
        xs = _grid(max(0, total - MAX_TOKENS), min(total, MAX_SEQS), points)
        return xs, [replace(b, decode_seqs=x, prefill_tokens=total - x,
                            prefill_requests=max(1, min(b.prefill_requests, total - x)))
                    for x in xs]
    if knob == "prefill_requests":
        xs = _grid(1, max(1, min(MAX_PREFILL_REQUESTS, b.prefill_tokens)), points)
        return xs, [replace(b, prefill_requests=x) for x in xs]
    raise ValueError(f"vary: unknown knob {knob!r}")  # pragma: no cover - the input checks it


def batch_report(pool: Pool, q: BatchIn) -> dict[str, Any]:
    """Every pool instance's prediction for the batch, and the sweep over ``q.vary``."""
    b = Batch(q.decode_seqs, q.decode_context, q.prefill_tokens, q.prefill_requests,
              q.prefill_context)
    xs, batches = sweep_batches(b, q.vary, q.points)
    insts = []
    for inst in pool.instances:
        model = inst.batch_time
        insts.append({"name": inst.name, "model": inst.model, "batch_time_model": model.name,
                      "coefficients": model.coefficients,
                      "fits_token_budget": b.total_tokens <= inst.config.max_num_batched_tokens,
                      **price(model, b),
                      "sweep_s": [model.duration(**x.features()) for x in batches]})
    return {"batch": {**q.model_dump(exclude={"vary", "points"}),
                      "prefill_chunks": b.chunks(), "total_tokens": b.total_tokens,
                      "features": b.features()},
            "instances": insts,
            "sweep": {"knob": q.vary, "x": xs,
                      "current": b.decode_seqs if q.vary == "decode_share" else getattr(b, q.vary),
                      "total_tokens": [x.total_tokens for x in batches]}}


# -- routes --------------------------------------------------------------------------------------

def error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def parse(request: Request, model: type[M]) -> M:
    """The JSON body as ``model``; ApiError(400) naming the first bad field."""
    try:
        data = await request.json()
    except ValueError:
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param,
                       code="invalid_value") from None


class OneAtATime:
    """Runs blocking calls in a worker thread, one at a time, with at most ``queued`` waiting
    (more get a 429): simulations are CPU-bound and the gateway shares the process."""

    def __init__(self, queued: int = MAX_QUEUED) -> None:
        self.lock = asyncio.Lock()
        self.queued = queued
        self.waiting = 0

    async def run(self, fn: Callable[[], T]) -> T:
        if self.lock.locked() and self.waiting >= self.queued:
            raise ApiError(429, "The demo is busy with other simulations; try again shortly.",
                           code="demo_busy", type_="rate_limit_error")
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1
        # the lock is held until the thread ends, even when the caller goes away (shield)
        fut = asyncio.ensure_future(asyncio.to_thread(fn))
        fut.add_done_callback(lambda _: self.lock.release())
        return await asyncio.shield(fut)


def demo_routes(pool: Pool) -> list[BaseRoute]:
    """``GET /demo`` and its two JSON routes, over ``pool`` (whose instances' batch-time models
    the batch panel prices)."""
    gate = OneAtATime()

    async def simulate_route(request: Request) -> Response:
        try:
            q = await parse(request, SimulateIn)
            return JSONResponse(await gate.run(lambda: simulate(q)))
        except ApiError as e:
            return error(e)

    async def batch_route(request: Request) -> Response:
        try:
            q = await parse(request, BatchIn)
        except ApiError as e:
            return error(e)
        return JSONResponse(batch_report(pool, q))  # (microseconds: no thread needed)

    return [Route("/demo", page("demo.html"), methods=["GET"], include_in_schema=False),
            Route("/duetime/demo/simulate", simulate_route, methods=["POST"]),
            Route("/duetime/demo/batch", batch_route, methods=["POST"])]
