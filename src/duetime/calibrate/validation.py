"""``duetime validate``: how closely the engine model predicts a real server, measured.

The harness drives one OpenAI-compatible endpoint directly (no gateway) and then replays what
it did through duetime's engine:

1. **Capacity.** A short closed loop (``max_num_seqs`` clients, each sending the next request
   of the mix when its last one ends) measures the requests per second the server sustains
   on this workload.
2. **Loads.** For each load (a fraction of that capacity) and each arrival process (Poisson,
   or bursty: a two-state MMPP with the same mean), a seeded trace: prompt lengths
   log-uniform over ``[min_prompt, max_prompt]`` (random token ids from the server's own
   tokenizer, new for every request of every run, so the server's prefix cache holds none of
   them), output lengths uniform over
   ``[min_output, max_output]`` with ``ignore_eos`` (the server stops at exactly that many).
   Every request is streamed with usage (``continuous_usage_stats`` where vLLM has it), and its
   timeline recorded: send, first token, each chunk, finish, token counts.
3. **Replay.** The trace — each request at its observed send time, with its observed prompt
   and output tokens — runs through the engine with the instance's profile (batch-time model,
   scheduler config, per-request overhead). A request's predicted TTFT is its first-token
   stamp minus its send time plus the overhead; its end-to-end latency likewise.
4. **Corrected.** The gateway's online correction (:mod:`duetime.estimate.correction`) over the
   same trace: each prediction scaled by the factor learnt from the requests whose first token
   was seen before it was sent.
5. **Batch time.** Each request's mean inter-token latency (its decode steps: first to last
   token over ``output - 1``) against the replay's; and, where the server exports vLLM's
   histograms on ``/metrics``, the server's own mean inter-token latency and engine-side TTFT
   over each run (scraped before and after it) against the replay's: how much of the error is
   the batch-time model and how much is outside the engine. And a second replay with the
   gateway's online step-time correction (``state.step_correction``): at each send the engine's
   step time is scaled by what the requests ended by then taught (:class:`StepLearner`); its
   ITL and TTFT errors are reported beside the static replay's.
6. **Live.** Driving a duetime gateway (``URL`` is a ``duetime serve``), each answer's
   ``x-duetime-forecast-ttft-ms`` is the forecast the gateway routed on, made from its live
   state with its online correction: its error is reported too.

Errors are per request, relative to the observed value (``predicted / observed - 1``); the
report gives their absolute median, mean (MAPE) and 90th percentile per load and pooled. Against
the emulator (the same engine in real time) the error is the HTTP path's few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import secrets
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from duetime.engine.engine import Engine
from duetime.engine.frontend import FrontedEngine, Frontend
from duetime.engine.spec import InstanceSpec
from duetime.estimate.correction import StepCorrection, TtftCorrection
from duetime.workload.arrivals import MMPP2, Poisson

ARRIVALS = ("poisson", "bursty")


class ValidationError(RuntimeError):
    """The endpoint could not be driven (it refused the workload, or answered nothing)."""


@dataclass(frozen=True, slots=True)
class Mix:
    """The request mix: prompt and output length ranges (tokens); with ``loras`` (adapters the
    server serves), a ``lora_share`` of the requests on one of them, drawn uniformly."""

    min_prompt: int = 16
    max_prompt: int = 1500
    min_output: int = 8
    max_output: int = 128
    loras: tuple[str, ...] = ()
    lora_share: float = 0.5

    def draw(self, rng: random.Random) -> tuple[int, int]:
        lo, hi = math.log(self.min_prompt), math.log(self.max_prompt)
        return (round(math.exp(rng.uniform(lo, hi))),
                rng.randint(self.min_output, self.max_output))

    def adapter(self, rng: random.Random) -> str:
        """A request's adapter ("": the base model; without adapters nothing is drawn, so a
        trace is the one before adapters)."""
        if not self.loras or rng.random() >= self.lora_share:
            return ""
        return rng.choice(self.loras)


@dataclass(slots=True)
class Record:
    """One request as the client saw it (times in seconds from the start of its run)."""

    id: str
    load: float
    arrivals: str
    sent: float
    prompt_tokens: int
    max_tokens: int
    first_token: float = math.nan
    finished: float = math.nan
    output_tokens: int = 0
    chunks: int = 0
    error: str | None = None
    last_token: float = math.nan  # the last chunk that carried text
    lora: str = ""  # its LoRA adapter ("": the base model)
    live_ttft: float = math.nan  # a duetime gateway's forecast (x-duetime-forecast-ttft-ms)
    predicted_ttft: float = math.nan
    predicted_e2e: float = math.nan
    predicted_itl: float = math.nan
    corrected_ttft: float = math.nan  # predicted_ttft x the online correction at its send
    step_ttft: float = math.nan  # the replay with the step-time correction learnt online
    step_itl: float = math.nan

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def e2e(self) -> float:
        return self.finished - self.sent

    @property
    def itl(self) -> float:
        """Mean inter-token latency: the request's decode time per token after the first (NaN
        for a stream that packed tokens into fewer chunks: a server falling behind sends what
        it holds at once, and the chunks' times no longer time the steps)."""
        n = self.output_tokens - 1
        if n <= 0 or self.chunks < self.output_tokens:
            return math.nan
        return (self.last_token - self.first_token) / n

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.first_token) and math.isfinite(
            self.finished)


@dataclass
class Client:
    """Sends the workload's requests to ``url`` (``/v1/completions``, token-id prompts).

    A prompt's token ids are drawn from the run's ``salt`` and the request's id, so no two
    prompts of a run share a prefix and a second run finds nothing of the first in the
    server's prefix cache (vLLM caches by default; the replay models an empty cache). The
    seed fixes the trace (lengths, arrival times), not the content."""

    url: str
    model: str
    session: aiohttp.ClientSession
    salt: str = field(default_factory=lambda: secrets.token_hex(8))
    ids: list[int] = field(default_factory=list)

    async def token_ids(self) -> None:
        """Ordinary token ids of the server's own tokenizer (``/tokenize`` of a plain text);
        without ``/tokenize`` (not vLLM), small ids."""
        from duetime.calibrate.endpoint import SEED_TEXT

        try:
            async with self.session.post(f"{self.url}/tokenize", json={
                    "model": self.model, "prompt": SEED_TEXT}) as r:
                body = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, ValueError):
            body = {}
        self.ids = sorted(set(body.get("tokens") or [])) or list(range(100, 400))

    def prompt(self, rec: Record) -> list[int]:
        """``rec``'s prompt: token ids of this run's and this request's own."""
        rng = random.Random(f"{self.salt}/{rec.id}")
        return [rng.choice(self.ids) for _ in range(rec.prompt_tokens)]

    async def send(self, rec: Record, t0: float) -> None:
        """Send ``rec`` (at ``t0 + rec.sent``) and record its timeline."""
        prompt = self.prompt(rec)
        body = {"model": rec.lora or self.model, "prompt": prompt, "max_tokens": rec.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        await asyncio.sleep(max(0.0, t0 + rec.sent - time.monotonic()))
        rec.sent = time.monotonic() - t0  # (when it really left)
        usage = None
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
                if r.status != 200:
                    rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return
                live = r.headers.get("x-duetime-forecast-ttft-ms")
                if live is not None:
                    with contextlib.suppress(ValueError):
                        rec.live_ttft = float(live) / 1000
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    d = json.loads(line[6:])
                    if d.get("choices"):
                        rec.last_token = time.monotonic() - t0
                        if math.isnan(rec.first_token):
                            rec.first_token = rec.last_token
                        rec.chunks += 1
                    if d.get("usage"):
                        usage = d["usage"]
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:200]
            return
        rec.finished = time.monotonic() - t0
        if usage is not None:
            rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
            rec.output_tokens = int(usage.get("completion_tokens", 0))
        if rec.output_tokens <= 0:
            rec.error = "no usage in the stream"


def read_results(path: str) -> list[Record]:
    """The requests of a ``results.csv`` that ``duetime validate`` wrote (to replay a recorded
    trace with another profile); ValueError for a file of another shape."""
    import csv

    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                sent = float(row["sent_s"])
                r = Record(row["id"], float(row["load"]), row["arrivals"], sent,
                           int(row["prompt_tokens"]), int(row["output_tokens"]),
                           sent + float(row["ttft_s"]), sent + float(row["e2e_s"]),
                           int(row["output_tokens"]), int(row["chunks"]),
                           row["error"] or None)
                # (columns that later versions added; older files lack them)
                itl = float(row.get("itl_s") or "nan")
                r.last_token = r.first_token + itl * max(r.output_tokens - 1, 0)
                r.live_ttft = float(row.get("live_ttft_s") or "nan")
                r.lora = row.get("lora") or ""
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: row {i + 1}: not a duetime validate results.csv "
                                 f"row ({e})") from None
            out.append(r)
    return out


def trace(load: float, capacity: float, arrivals: str, n: int, mix: Mix,
          seed: int) -> list[Record]:
    """``n`` requests at ``load`` x ``capacity`` per second (seeded)."""
    rate = load * capacity
    process = Poisson(rate) if arrivals == "poisson" else MMPP2(rate)
    times = process.times(n, np.random.default_rng(seed))
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(times.tolist()):
        p, o = mix.draw(rng)
        rec = Record(f"{arrivals}-{load:g}-{i}", load, arrivals, float(t), p, o)
        rec.lora = mix.adapter(rng)
        out.append(rec)
    return out


async def run_trace(client: Client, recs: list[Record]) -> None:
    """Send the trace in real time (open loop)."""
    t0 = time.monotonic() + 0.05
    await asyncio.gather(*(client.send(r, t0) for r in recs))


async def measure_capacity(client: Client, mix: Mix, clients: int, n: int,
                           seed: int) -> float:
    """Requests per second the server completes with ``clients`` in a closed loop."""
    rng = random.Random(seed)
    todo = [Record(f"cap-{i}", 0.0, "closed", 0.0, *mix.draw(rng)) for i in range(n)]
    for rec in todo:
        rec.lora = mix.adapter(rng)
    queue = list(reversed(todo))
    t0 = time.monotonic()

    async def worker() -> None:
        while queue:
            rec = queue.pop()
            rec.sent = time.monotonic() - t0
            await client.send(rec, t0)

    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.monotonic() - t0
    done = [r for r in todo if r.ok]
    if not done:
        errors = {r.error for r in todo if r.error}
        raise ValidationError(f"{client.url}: no request of the capacity run completed "
                              f"({'; '.join(sorted(errors))[:300]})")
    return len(done) / elapsed


def replay(recs: list[Record], spec: InstanceSpec) -> None:
    """Predict each completed request's TTFT and end-to-end latency by running the trace
    through the engine (``spec``: the instance's profile); sets ``predicted_*``, the TTFT
    correction's ``corrected_ttft`` and the step-corrected replay's ``step_*``."""
    done = sorted((r for r in recs if r.ok), key=lambda r: r.sent)
    if not done:
        return
    o = spec.request_overhead_s
    if spec.frontend is not None:  # (through the API server's queue: its own work is in o)
        o = max(0.0, o - spec.frontend.own_s)
    for r, (first, fin) in zip(done, _run(done, spec), strict=True):
        r.predicted_ttft = first - r.sent + o
        r.predicted_e2e = fin - r.sent + o
        if r.output_tokens > 1:
            r.predicted_itl = (fin - first) / (r.output_tokens - 1)
    correct(done)
    steps = StepLearner(done)
    for r, (first, fin) in zip(done, _run(done, spec, steps), strict=True):
        r.step_ttft = first - r.sent + o
        if r.output_tokens > 1:
            r.step_itl = (fin - first) / (r.output_tokens - 1)


class StepLearner:
    """The gateway's step-time correction (:class:`~duetime.estimate.correction.StepCorrection`)
    over a trace: at each send, the factor learnt from the requests whose last token the client
    had seen by then, each one sample of its observed decode time against the static replay's
    (how many tokens the replay would have made in the time the server took: ``duration /
    predicted_itl`` against ``output - 1``). The gateway learns the same from token counts as
    they stream; here a request teaches once it has ended (its chunks' times are in the
    record only as first and last)."""

    def __init__(self, done: list[Record]) -> None:
        self._ended = sorted((r for r in done if math.isfinite(r.itl)
                              and math.isfinite(r.predicted_itl) and r.predicted_itl > 0),
                             key=lambda r: r.last_token)
        self._k = 0
        self.correction = StepCorrection()

    def factor_at(self, t: float) -> float:
        """The factor to multiply step times by for a request sent at ``t``."""
        ended, c = self._ended, self.correction
        while self._k < len(ended) and ended[self._k].last_token < t:
            r = ended[self._k]
            n = r.output_tokens - 1
            c.observe(n * r.itl / r.predicted_itl, n)
            self._k += 1
        return c.factor


def _run(done: list[Record], spec: InstanceSpec,
         steps: StepLearner | None = None) -> list[tuple[float, float]]:
    """Each request's (first token, last token) in the replay of ``done`` (in send order):
    through the API server's queue where the profile has one; with ``steps``, the engine's
    step time scaled at each send by the step correction learnt so far. Adapters get ids 1..
    in the order of their names (any distinct ids: the scheduler only compares them)."""
    eng = Engine(spec.config, spec.batch_time, time=done[0].sent)
    names = sorted({r.lora for r in done} - {""})
    if names and not spec.config.max_loras:
        raise ValidationError("requests on LoRA adapters, but the profile's config has no "
                              "max_loras (the server's --max-loras)")
    ids = {"": 0, **{name: k + 1 for k, name in enumerate(names)}}
    applied = 1.0

    def rescale(t: float) -> None:
        nonlocal applied
        f = steps.factor_at(t) if steps is not None else 1.0
        if f != applied:
            eng.set_model(spec.batch_time.scaled(1.0 / f))
            applied = f

    if spec.frontend is not None:
        fronted = FrontedEngine(eng, Frontend(spec.frontend, done[0].sent))
        for r in done:
            fronted.advance(r.sent)
            rescale(r.sent)
            fronted.submit(r.id, r.prompt_tokens, r.output_tokens, r.sent, lora=ids[r.lora])
        fronted.drain()
        return [(fronted.delivered[r.id].first, fronted.delivered[r.id].last) for r in done]
    for r in done:
        eng.run_until(r.sent)
        rescale(r.sent)
        eng.add(r.id, r.prompt_tokens, r.output_tokens, arrival=r.sent, lora=ids[r.lora])
    eng.drain()
    cols = eng.lookup([r.id for r in done])
    return list(zip(cols.first_token.tolist(), cols.finish_time.tolist(), strict=True))


def correct(done: list[Record]) -> None:
    """The gateway's online correction (:class:`~duetime.estimate.correction.TtftCorrection`)
    over the trace: each request's prediction is scaled by the factor learnt from the requests
    whose first token the client had seen before it was sent (``done``: in send order)."""
    corr = TtftCorrection()
    seen = sorted(done, key=lambda r: r.first_token)
    k = 0
    for r in done:
        while k < len(seen) and seen[k].first_token < r.sent:
            s = seen[k]
            corr.observe(s.predicted_ttft, s.ttft)
            k += 1
        r.corrected_ttft = r.predicted_ttft * corr.factor


def errors(recs: list[Record], what: str, prediction: str = "predicted") -> np.ndarray:
    """Relative errors (prediction / observed - 1) of ``ttft``, ``e2e`` or ``itl`` over the
    completed requests with a prediction (``prediction``: ``predicted``, the static model;
    ``corrected``, with the online correction; ``step``, the replay with the online step-time
    correction; or ``live``, a gateway's own forecast: TTFT only)."""
    pairs = [(getattr(r, f"{prediction}_{what}"), getattr(r, what)) for r in recs if r.ok]
    arr = np.array([(p, o) for p, o in pairs if math.isfinite(p) and math.isfinite(o)
                    and o > 0], dtype=float)
    if arr.size == 0:
        return np.zeros(0)
    return arr[:, 0] / arr[:, 1] - 1.0


def error_stats(errs: np.ndarray) -> dict[str, float]:
    """Median, mean and 90th percentile of |error|, and the median signed error (bias)."""
    if errs.size == 0:
        return {"n": 0, "median_abs": math.nan, "mean_abs": math.nan, "p90_abs": math.nan,
                "median": math.nan}
    a = np.abs(errs)
    return {"n": int(errs.size), "median_abs": float(np.median(a)),
            "mean_abs": float(a.mean()), "p90_abs": float(np.quantile(a, 0.9)),
            "median": float(np.median(errs))}


# vLLM's request histograms on /metrics that say what the engine did (sum and count of each)
SERVER_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds",
                     "itl": "vllm:inter_token_latency_seconds",
                     "queue": "vllm:request_queue_time_seconds"}


def parse_server_stats(text: str) -> dict[str, tuple[float, float]]:
    """``{"ttft"|"itl"|"queue": (sum, count)}`` from a vLLM ``/metrics`` page (summed over its
    label sets: engines, models); empty for a server without them."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {v: k for k, v in SERVER_HISTOGRAMS.items()}
    out: dict[str, list[float]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            key = wanted.get(fam.name)
            if key is None:
                continue
            acc = out.setdefault(key, [0.0, 0.0])
            for smp in fam.samples:
                if smp.name.endswith("_sum"):
                    acc[0] += smp.value
                elif smp.name.endswith("_count"):
                    acc[1] += smp.value
    except ValueError:  # not a Prometheus page
        return {}
    return {k: (v[0], v[1]) for k, v in out.items()}


async def server_stats(session: aiohttp.ClientSession, url: str
                       ) -> dict[str, tuple[float, float]]:
    """The server's histogram sums and counts now (empty when it has none)."""
    try:
        async with session.get(f"{url}/metrics") as r:
            return parse_server_stats(await r.text()) if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return {}


def server_delta(before: dict[str, tuple[float, float]],
                 after: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Each histogram's sum and count over what happened between two scrapes."""
    out = {}
    for k, (s1, c1) in after.items():
        s0, c0 = before.get(k, (0.0, 0.0))
        out[k] = (s1 - s0, c1 - c0)
    return out


def replay_means(recs: list[Record], spec: InstanceSpec) -> dict[str, float]:
    """The replay's counterparts of the server's histogram means (engine side: no request
    overhead):
    mean TTFT, and mean inter-token latency over every decode token of the run."""
    ok = [r for r in recs if r.ok and math.isfinite(r.predicted_ttft)]
    if not ok:
        return {}
    o = spec.request_overhead_s
    out = {"ttft": float(np.mean([r.predicted_ttft - o for r in ok]))}
    dec = [(r.predicted_e2e - r.predicted_ttft, r.output_tokens - 1) for r in ok
           if r.output_tokens > 1]
    if dec:
        out["itl"] = sum(t for t, _ in dec) / sum(n for _, n in dec)
    return out
