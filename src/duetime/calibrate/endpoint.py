"""Calibrate an instance's batch-time model against the running server (``duetime calibrate``).

The built-in profiles describe Qwen3 on H100 (the SFS paper's coefficients). Any other model or
machine needs its own: this module measures one over HTTP, with nothing but the OpenAI API, and
fits the SFS paper's four-coefficient model (``paper4``, eq. 11) plus a per-request overhead.

Two kinds of probes, sent to an otherwise idle server:

* **prefill**: one request at a time, a prompt of P random token ids (distinct per probe, so no
  prefix-cache hit), ``max_tokens`` 1. Its time to first token is the overhead ``o`` (HTTP,
  tokenisation, detokenisation, outside the engine loop) plus its prefill steps: with a token
  budget B a lone prompt is cut into chunks of at most B, and each chunk is one step
  ``b0 + b1·chunk + b3·(chunk·done + chunk(chunk+1)/2)``. Prompts longer than B separate ``b0``
  from ``o``.
* **decode**: n requests at once (n up to ``max_num_seqs``), ``ignore_eos``, with short prompts
  and again with a realistic context (half the model length, at most 2,048 tokens: short
  prompts alone leave ``b2`` unidentified, and it came out anywhere from 0 to 4.9 µs per token
  over repeated calibrations of one server). Once all n stream, the gap between two chunks of
  one stream is one step with n decoders: ``b0 + b1·n + b2·Σ context``.

* **frontend** (last): the API server's CPU counter (``process_cpu_seconds_total`` on
  vLLM's ``/metrics``) over many one-token requests sent at once and over a few long streams
  gives its seconds per request and per output chunk (:func:`frontend_costs`,
  :mod:`duetime.engine.frontend`): the queue in front of the engine that a small, fast model
  saturates before its engine does.

* **LoRA** (``lora``: an adapter the server serves): the same prefill and decode probes on the
  adapter (every request of a decode batch on it). The base model fitted first, what those
  samples take beyond it is fitted to the three LoRA terms (a step holding a LoRA request costs
  ``lora_step + lora_prefill·n_pre + lora_decode·n_dec`` more: :mod:`duetime.engine.batch_time`),
  by the same regression on their residuals.

All rows are fitted together by non-negative least squares on relative error (scikit-learn's
``LinearRegression(positive=True)``, weighted by 1/observed). Each sample keeps the engine's
seven batch features summed over its steps (:mod:`duetime.engine.batch_time`), so the same
probes fit either model: ``paper4`` (the default) or the released SFS code's ``sfs6``. The
result is the instance entry's ``batch_time``, ``config`` and ``request_overhead_ms`` for a
pool YAML (docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from duetime.engine.batch_time import MODELS, BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.frontend import FrontendModel
from duetime.web.cache_info import cache_config_info
from duetime.web.limits import INSTANCE_KEEP_ALIVE_S

# A text whose tokenisation gives the probes' token ids: any model's tokenizer splits it into
# ordinary tokens (no special ids, nothing the server rejects).
SEED_TEXT = ("the quick brown fox jumps over the lazy dog while seven tall ships sail past "
              "quiet harbours under grey northern skies and merchants count silver coins "
              "beside wooden crates of apples pears and plums ")


_CPU_LINE = re.compile(r"^process_cpu_seconds_total (\S+)$", re.M)

Arrival = tuple[float, int]  # (arrival time, output tokens so far)


class CalibrationError(RuntimeError):
    """The server could not be calibrated (unreachable, errors, too few samples)."""


@dataclass(frozen=True)
class Sample:
    kind: str                 # "prefill" or "decode"; "lora prefill", "lora decode"
    # the batch features summed over the sample's steps, in batch_time's order (steps, n_dec,
    # n_pre, pre_sq, pre_attn, dec_ctx, len_sum, len_sq), then 1 if the time holds the
    # per-request overhead
    x: tuple[float, ...]
    observed_s: float
    what: str                 # a label: "P=512" or "n=4"
    # on a LoRA adapter: its steps' LoRA features summed (steps, n_pre, n_dec): see
    # BatchTimeModel.lora_duration
    lora: tuple[float, float, float] | None = None


def on_lora(s: Sample) -> Sample:
    """The same probe on an adapter (every step of it holds a LoRA request)."""
    return Sample(f"lora {s.kind}", s.x, s.observed_s, s.what, (s.x[0], s.x[2], s.x[1]))


@dataclass
class Calibration:
    """The fitted model, its scheduler config and how well it fits its own samples."""

    model: BatchTimeModel
    config: SchedulerConfig
    request_overhead_s: float
    samples: list[Sample] = field(default_factory=list)
    # the API server's costs, where its CPU counter is on /metrics (else None)
    frontend: FrontendModel | None = None

    def fitted(self, s: Sample) -> float:
        w = (*self.model.weights, self.request_overhead_s)  # type: ignore[attr-defined]
        t = float(np.dot(s.x, w))
        if s.lora is not None:
            t += float(np.dot(s.lora, self.model.lora_weights))  # type: ignore[attr-defined]
        return t

    def errors(self, kind: str) -> list[float]:
        """Relative errors (fitted / observed - 1) of one kind of sample."""
        return [self.fitted(s) / s.observed_s - 1.0 for s in self.samples if s.kind == kind]

    def instance_entry(self) -> dict[str, Any]:
        """The keys of a pool YAML instance entry that this calibration supplies."""
        entry = {"batch_time": self.model.to_dict(),
                 "config": self.config.to_dict(),
                 "request_overhead_ms": round(self.request_overhead_s * 1000, 3)}
        if self.frontend is not None:
            entry["frontend"] = self.frontend.to_dict()
        return entry


def prefill_row(prompt: int, budget: int) -> tuple[float, ...]:
    """Features of a lone prompt's prefill (its chunks of at most ``budget``), with the
    overhead: its time to first token."""
    steps = attn = done = sq = 0
    while done < prompt:
        chunk = min(budget, prompt - done)
        attn += chunk * done + chunk * (chunk + 1) // 2
        sq += chunk * chunk
        done += chunk
        steps += 1
    # (a prefilling request's length is its whole prompt, in every chunk's step)
    return (float(steps), 0.0, float(prompt), float(sq), float(attn), 0.0,
            float(steps * prompt), float(steps * prompt * prompt), 1.0)


def decode_row(n: int, context: float, lengths_sq: float | None = None) -> tuple[float, ...]:
    """Features of one decode step of n requests with Σ context tokens (each request's length
    is its context and the token in flight; ``lengths_sq``: Σ length², default as if every
    request had the mean context)."""
    lsum = context + n
    lsq = lsum * lsum / n if lengths_sq is None else lengths_sq
    return (1.0, float(n), 0.0, 0.0, 0.0, float(context), float(lsum), float(lsq), 0.0)


def _nnls(x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> list[float]:
    """Non-negative least squares of ``y`` on the columns of ``x`` (weighted; columns scaled
    to one, so that their magnitudes do not matter)."""
    from sklearn.linear_model import LinearRegression

    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    reg = LinearRegression(positive=True, fit_intercept=False)
    reg.fit(x / scale, y, sample_weight=weight)
    return (reg.coef_ / scale).tolist()


def fit(samples: list[Sample], config: SchedulerConfig, model: str = "paper4") -> Calibration:
    """Non-negative least squares on relative error over all samples, for the batch-time
    ``model`` (a name in :data:`duetime.engine.batch_time.MODELS`); LoRA samples, fitted to
    the LoRA terms on what they take beyond the base model (module doc)."""
    if model not in MODELS:
        raise ValueError(f"unknown batch-time model {model!r}; expected one of {sorted(MODELS)}")
    cls = MODELS[model]
    samples = [s for s in samples if s.observed_s > 0]
    lora = [s for s in samples if s.lora is not None]
    base = [s for s in samples if s.lora is None]
    cal = _fit_base(base, config, cls)
    if lora:
        y = np.array([s.observed_s - cal.fitted(s) for s in lora])
        obs = np.array([s.observed_s for s in lora])
        coef = _nnls(np.array([s.lora for s in lora], dtype=float), y, 1.0 / obs**2)
        cal.model = cal.model.with_lora(*coef)
        cal.samples = samples
    return cal


def _fit_base(samples: list[Sample], config: SchedulerConfig,
              cls: type[BatchTimeModel]) -> Calibration:
    if len({s.kind for s in samples}) < 2 or len(samples) < 6:
        raise CalibrationError(f"too few samples to fit ({len(samples)}): need prefill and "
                               "decode probes")
    # each coefficient's weights on the seven features (the models are linear in them)
    names = cls.coefficient_names
    basis = np.array([cls(**{k: float(k == c) for k in names}).weights  # type: ignore[attr-defined]
                      for c in names], dtype=float).T
    feats = np.array([s.x for s in samples], dtype=float)
    x = np.column_stack([feats[:, :8] @ basis, feats[:, 8]])
    y = np.array([s.observed_s for s in samples], dtype=float)
    coef = _nnls(x, y, 1.0 / y**2)
    return Calibration(cls(**dict(zip(names, coef[:-1], strict=True))), config, coef[-1],
                       samples)


class _Prober:
    def __init__(self, url: str, model: str, session: aiohttp.ClientSession, seed: int) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.session = session
        self.rng = random.Random(seed)
        self.ids: list[int] = []

    async def token_ids(self) -> None:
        """Token ids to build prompts from, from the server's own tokenizer (``/tokenize``)."""
        async with self.session.post(f"{self.url}/tokenize",
                                     json={"model": self.model, "prompt": SEED_TEXT}) as r:
            if r.status != 200:
                raise CalibrationError(f"{self.url}/tokenize answered {r.status}: "
                                       f"{(await r.text())[:200]}")
            body = await r.json()
        ids = sorted(set(body.get("tokens") or []))
        if not ids:
            raise CalibrationError(f"{self.url}/tokenize gave no token ids")
        self.ids = ids

    def prompt(self, n: int) -> list[int]:
        return [self.rng.choice(self.ids) for _ in range(n)]

    async def stream(self, prompt: list[int], max_tokens: int, model: str | None = None
                     ) -> tuple[float, list[Arrival], int]:
        """Send one streamed completion (to ``model``, default the served one: an adapter's
        name puts it on that adapter); (sent at, its chunks' arrivals, prompt tokens the
        server counted). vLLM may pack several tokens into one chunk when its HTTP side falls
        behind: with ``continuous_usage_stats`` every chunk says how many tokens came so far
        (a server that ignores the option: one token per chunk)."""
        body = {"model": model or self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        arrivals: list[Arrival] = []
        counted = len(prompt)
        t0 = time.perf_counter()
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise CalibrationError(f"{self.url}/v1/completions answered {r.status}: "
                                       f"{(await r.text())[:300]}")
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
                for ev in events:
                    data = ev.removeprefix(b"data: ").strip()
                    if not data or data == b"[DONE]":
                        continue
                    d = json.loads(data)
                    usage = d.get("usage") or {}
                    if d.get("choices"):
                        if any(c.get("text") is not None for c in d["choices"]):
                            so_far = usage.get("completion_tokens")
                            n = int(so_far) if so_far else (arrivals[-1][1] + 1 if arrivals
                                                            else 1)
                            arrivals.append((now, n))
                    elif usage:
                        counted = int(usage.get("prompt_tokens", counted))
        return t0, arrivals, counted


def default_prompt_lengths(config: SchedulerConfig) -> list[int]:
    """Lone-prefill probe lengths: small to the token budget, then one to three chunks."""
    b = config.max_num_batched_tokens
    top = config.max_model_len - 8
    grid = {16, 64, b // 4, b // 2, (3 * b) // 4, b, (3 * b) // 2, 2 * b, 3 * b}
    return sorted(p for p in grid if 8 <= p <= top)


def default_batches(config: SchedulerConfig) -> list[int]:
    s = config.max_num_seqs
    return sorted({n for n in (1, 2, 4, 8, 16, 32, s) if 1 <= n <= s})


def default_decode_prompts(config: SchedulerConfig) -> list[int]:
    """Decode-probe prompt lengths: short (the step's fixed and per-request costs) and a
    realistic context (half the model length, at most 2,048 tokens: the per-context-token
    cost ``b2``, which short prompts leave unidentified)."""
    long = min(config.max_model_len // 2, 2048)
    return [16] if long <= 64 else [16, long]


def _fits(config: SchedulerConfig, n: int, prompt: int, tokens: int) -> bool:
    """Whether n streams of ``prompt + tokens`` tokens fit the KV cache together (else the
    server would preempt: no clean decode step to time)."""
    per = -(-(prompt + tokens) // config.block_size)
    return n * per <= config.usable_blocks


def instance_session(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
    """A session for probing an instance, closing idle connections before the server's
    keep-alive would (:data:`~duetime.web.limits.INSTANCE_KEEP_ALIVE_S`): else a request
    written on a connection as the server closes it fails with a connection reset."""
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(keepalive_timeout=INSTANCE_KEEP_ALIVE_S))


async def calibrate(url: str, model: str, config: SchedulerConfig, *, reps: int = 3,
                    prompt_lengths: list[int] | None = None, batches: list[int] | None = None,
                    decode_tokens: int = 32, decode_prompts: list[int] | None = None,
                    seed: int = 0, timeout_s: float = 120.0,
                    batch_model: str = "paper4", measure_frontend: bool = True,
                    lora: str | None = None) -> Calibration:
    """Probe the server at ``url`` (serving ``model`` with this scheduler ``config``) and fit
    ``batch_model``.
    Decode probes run at each of ``decode_prompts`` (default: a short prompt and a realistic
    context); a long prompt's streams decode ``decode_tokens`` more than the steps their
    staggered prefills take, so that all of them decode together for a while. ``lora``: an
    adapter the server serves, probed the same way after the base model (its LoRA terms).
    With ``measure_frontend`` the API server's costs are measured last
    (:func:`frontend_costs`)."""
    plan = _Plan(prompt_lengths or default_prompt_lengths(config),
                 batches or default_batches(config),
                 decode_prompts or default_decode_prompts(config), reps, decode_tokens)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with instance_session(timeout) as session:
            p = _Prober(url, model, session, seed)
            await p.token_ids()
            await p.stream(p.prompt(16), 4)  # warm-up
            samples = await _probe(p, config, plan)
            if lora is not None:
                await p.stream(p.prompt(16), 4, lora)  # (its first use loads it)
                samples += [on_lora(s) for s in await _probe(p, config, plan, lora)]
            frontend = await frontend_costs(p, config) if measure_frontend else None
    except aiohttp.ClientError as e:
        raise CalibrationError(f"{url}: {type(e).__name__}: {e}") from None
    except TimeoutError:
        raise CalibrationError(f"{url}: no answer within {timeout_s:g} s") from None
    cal = fit(samples, config, batch_model)
    cal.frontend = frontend
    return cal


@dataclass(frozen=True)
class _Plan:
    lengths: list[int]  # lone prompts
    batches: list[int]  # decode batches
    contexts: list[int]  # decode prompts
    reps: int
    decode_tokens: int


async def _probe(p: _Prober, config: SchedulerConfig, plan: _Plan,
                 model: str | None = None) -> list[Sample]:
    """The prefill and decode probes (module doc) on ``model`` (default the served one)."""
    samples: list[Sample] = []
    for _ in range(plan.reps):
        for n in plan.lengths:
            t0, arr, counted = await p.stream(p.prompt(n), 1, model)
            if not arr:
                raise CalibrationError(f"no token came back for a {n}-token prompt")
            samples.append(Sample("prefill", prefill_row(counted,
                                                         config.max_num_batched_tokens),
                                  arr[0][0] - t0, f"P={counted}"))
    for _ in range(plan.reps):
        for prompt in plan.contexts:
            for n in plan.batches:
                budget = config.max_num_batched_tokens
                tokens = plan.decode_tokens + -(-(n * prompt) // budget)
                if prompt > 16 and not _fits(config, n, prompt, tokens):
                    continue
                runs = await asyncio.gather(*(p.stream(p.prompt(prompt), tokens, model)
                                              for _ in range(n)))
                samples.extend(_decode_samples(runs, n))
    return samples


async def _api_cpu_s(p: _Prober) -> float | None:
    """The API server's process CPU seconds (``process_cpu_seconds_total`` on ``/metrics``:
    prometheus_client's process collector, in vLLM's API server process), or None."""
    async with p.session.get(f"{p.url}/metrics") as r:
        text = await r.text() if r.status == 200 else ""
    m = _CPU_LINE.search(text)
    return float(m.group(1)) if m else None


async def frontend_costs(p: _Prober, config: SchedulerConfig, *, requests: int = 96,
                         stream_tokens: int = 400) -> FrontendModel | None:
    """The API server's CPU per request and per output chunk (:mod:`duetime.engine.frontend`),
    from its own CPU counter over two probes that weigh them differently: ``requests``
    one-token completions sent at once (mostly per-request work), and ``max_num_seqs`` (at
    most 8) streams of ``stream_tokens`` tokens (mostly per-chunk work); each probe's CPU less
    an idle window's (the scrapes themselves, the server's idle work), solved for the two
    costs. None where ``/metrics`` has no CPU counter (several API servers share a
    multiprocess registry without one; not vLLM)."""
    before = await _api_cpu_s(p)
    if before is None:
        return None
    t0 = time.perf_counter()
    await asyncio.sleep(0.5)
    idle = (await _api_cpu_s(p) or before) - before
    idle_rate = idle / (time.perf_counter() - t0)
    tokens = max(8, min(stream_tokens, config.max_model_len - 32))
    rows, cpu = [], []
    for n, max_tokens in ((requests, 1), (min(8, config.max_num_seqs), tokens)):
        c0, t0 = await _api_cpu_s(p) or 0.0, time.perf_counter()
        runs = await asyncio.gather(*(p.stream(p.prompt(16), max_tokens) for _ in range(n)))
        c1, dt = await _api_cpu_s(p) or 0.0, time.perf_counter() - t0
        # (each stream's chunks: its text chunks and the closing usage one)
        rows.append((float(n), float(sum(len(arr) + 1 for _, arr, _ in runs))))
        cpu.append(max(0.0, c1 - c0 - idle - idle_rate * max(0.0, dt - 0.5)))
    a = np.array(rows)
    try:
        sol = np.linalg.solve(a, np.array(cpu))
    except np.linalg.LinAlgError:
        return None
    request_s, chunk_s = (max(0.0, float(v)) for v in sol)
    if request_s == 0.0 and chunk_s == 0.0:
        return None
    return FrontendModel(request_s, chunk_s)


def _decode_samples(runs: list[tuple[float, list[Arrival], int]], n: int) -> list[Sample]:
    """One sample per stream: its time per token while all n streams decode together (from
    the last stream's first token to the first stream's last one)."""
    if any(not arr for _, arr, _ in runs):
        return []
    start = max(arr[0][0] for _, arr, _ in runs)
    end = min(arr[-1][0] for _, arr, _ in runs)
    out = []
    for _, arr, prompt in runs:
        inside = [(t, k) for t, k in arr if start <= t <= end]
        if len(inside) < 2 or inside[-1][1] - inside[0][1] < 3:
            continue
        (t_a, k_a), (t_b, k_b) = inside[0], inside[-1]
        step = (t_b - t_a) / (k_b - k_a)
        if step <= 0:
            continue
        context = n * (prompt + (k_a + k_b) // 2)  # tokens computed before a middle step
        out.append(Sample("decode", decode_row(n, context), step, f"n={n}"))
    return out


async def cache_facts(url: str, timeout_s: float = 10.0) -> dict[str, int]:
    """``block_size`` and ``num_gpu_blocks`` from vLLM's ``vllm:cache_config_info`` metric."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s, \
            s.get(url.rstrip("/") + "/metrics") as r:
        text = await r.text() if r.status == 200 else ""
    info = cache_config_info(text)
    return {k: int(info[k]) for k in ("block_size", "num_gpu_blocks") if k in info}
