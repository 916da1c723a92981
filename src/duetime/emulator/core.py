"""The emulated instance: a live engine stepped in real time by one asyncio task.

The clock is ``time.monotonic()`` (seconds). ``speed`` X divides every
step's duration by X: an emulator at speed X is exactly an instance whose batch-time model's
coefficients are divided by X, so that is what it runs and what its ``/snapshot`` publishes.

The driver task sleeps while the engine is idle. A submitted request joins the engine's waiting
queue at once — the engine reads the queue only when a step starts, so it is admitted at the
next step boundary, as in vLLM. Each step is computed when it starts (``Engine.step``); the
driver then sleeps until the step's end and only then releases what it produced: first tokens,
one more token for every decoding request, finishes (with asynchronous scheduling a step
applies the previous step's outputs, which are due when it starts: they are released then).
If the loop wakes more than ``MAX_LAG_S`` late (a stalled process) the engine's clock jumps to
the present, so the lag shows as latency, as a late CPU would on a real server; smaller jitter
is absorbed (the next sleep is shorter), so the emulator keeps the model's pace on average.

Prefix caching is on by default, as in vLLM: a request brings the keys of its prompt's full
blocks (:mod:`duetime.web.prefix_keys`; its output blocks get the engine's own keys, since
the emulator's output is filler), and a prompt that starts like one still cached computes only
the rest. ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` count the tokens looked
up and found, as vLLM's scheduler stats do, when each step ends.

LoRA adapters (``max_loras`` > 0: vLLM's ``--enable-lora --max-loras K``): :class:`Adapters`
names them and numbers them 1, 2, 3… in load order (vLLM's ``lora_int_id``, never reused); a
request on one runs with that id in the engine, which runs at most ``max_loras`` distinct
adapters per step, and its block keys carry the adapter's name (:meth:`Adapter.keyed`), so a
prompt cached under one adapter misses under another and under the base model, as vLLM's
block hashes do. ``vllm:lora_requests_info`` names the adapters running and waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from duetime.engine import BatchTimeModel, Engine, EngineStuck, SchedulerConfig, Snapshot
from duetime.engine.frontend import Frontend, FrontendModel
from duetime.engine.warmup import warm_up
from duetime.web.prefix_keys import adapter_block_keys

log = logging.getLogger("duetime.emulator")

MAX_LAG_S = 0.05
FAULT_KINDS = ("5xx", "timeout", "disconnect", "break")
BREAK_AFTER = 3  # tokens a ``break`` fault streams before the connection drops

# vLLM's buckets for vllm:time_to_first_token_seconds and the latency histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(slots=True)
class Faults:
    """Failure injection: each request fails with probability ``rate``, its kind drawn
    uniformly from ``kinds`` (``5xx``: an immediate 500; ``timeout``: no answer until the client
    gives up; ``disconnect``: the response starts, then the connection drops before any
    token; ``break``: a stream drops after :data:`BREAK_AFTER` tokens, or, if it ends
    sooner, after its last token (before its usage and ``[DONE]``), as an instance dying
    mid-stream). ``healthy`` False: /health answers 503 and every request 503 (a dead engine)."""

    rate: float = 0.0
    kinds: tuple[str, ...] = ("5xx",)
    healthy: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fail rate must be in [0, 1], got {self.rate}")
        bad = [k for k in self.kinds if k not in FAULT_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"fail kinds must be among {', '.join(FAULT_KINDS)}, got "
                             f"{', '.join(self.kinds) or 'none'}")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` item: vLLM's ``LoRAModulePath`` (the path is only recorded: the
    emulator reads no weights)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=path``, or a JSON object ``{"name", "path", "base_model_name"?}``, as vLLM's
    ``--lora-modules`` takes them (its rule: ``=`` and no comma is the old form)."""
    if "=" in text and "," not in text:
        name, _, path = text.partition("=")
        if not name or not path or "=" in path:
            raise ValueError(f"expected name=path, got {text!r}")
        return LoraModule(name, path)
    try:
        d = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"invalid JSON format: {text}") from None
    if not isinstance(d, dict) or set(d) - {"name", "path", "base_model_name"}:
        raise ValueError(f'expected {{"name", "path", "base_model_name"?}}, got {text}')
    name, path, base = d.get("name"), d.get("path"), d.get("base_model_name")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path or (
            base is not None and not isinstance(base, str)):
        raise ValueError(f'"name" and "path" must be non-empty strings, got {text}')
    return LoraModule(name, path, base)


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded LoRA adapter: vLLM's ``LoRARequest`` as the emulator keeps it."""

    name: str
    id: int  # vLLM's lora_int_id: 1, 2, 3… in load order
    path: str
    base_model_name: str | None = None

    def keyed(self, keys: Sequence[int]) -> list[int]:
        """``keys`` with this adapter in each (:func:`~duetime.web.prefix_keys.
        adapter_block_keys`, as the gateway keys them): vLLM puts the adapter's name in every
        block hash, so its cached blocks are nobody else's."""
        return adapter_block_keys(keys, self.name)


class AdapterError(ValueError):
    """A refused load or unload, with vLLM's status and error type."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Adapters:
    """vLLM's registry of LoRA adapters by name (its ``OpenAIServingModels.lora_requests``):
    ids count from 1 and are never reused (a load in place gets a new one). Unloading only
    forgets the name: requests already on the adapter run on, as in vLLM."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if cpu < max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})")
        self.max_loras, self.max_cpu_loras = max_loras, cpu
        self._by_name: dict[str, Adapter] = {}
        self._ids = itertools.count(1)

    def __iter__(self) -> Iterator[Adapter]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str | None) -> Adapter | None:
        return None if name is None else self._by_name.get(name)

    def load(self, name: str, path: str, base_model_name: str | None = None, *,
             inplace: bool = False) -> Adapter:
        """Register ``name`` (vLLM's ``load_lora_adapter`` checks and messages)."""
        if not name or not path:
            raise AdapterError(400, "InvalidUserInput",
                               "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._by_name and not inplace:
            raise AdapterError(400, "InvalidUserInput",
                               f"The lora adapter '{name}' has already been loaded. If you "
                               "want to load the adapter in place, set 'load_inplace' to True.")
        adapter = Adapter(name, next(self._ids), path, base_model_name)
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        """Forget ``name`` (vLLM's ``unload_lora_adapter`` checks and messages)."""
        if not name:
            raise AdapterError(400, "InvalidUserInput",
                               "'lora_name' needs to be provided to unload a LoRA adapter.")
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise AdapterError(404, "NotFoundError",
                               f"The lora adapter '{name}' cannot be found.")
        return adapter


class _LoraInfo(Collector):
    """vLLM's ``vllm:lora_requests_info`` gauge: labels ``max_lora``, ``waiting_lora_adapters``
    and ``running_lora_adapters`` (the adapters' names, each once, in order of first
    appearance), value the Unix time (vLLM's ``set_to_current_time()`` at each logging
    interval). vLLM keeps every label set it ever set; this exports only the current one,
    stamped at the scrape: what a scraper taking the series with the newest value reads."""

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu

    def collect(self) -> Iterator[GaugeMetricFamily]:
        emu = self.emu
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters",
                                      "running_lora_adapters"])
        running, waiting = emu.lora_names()
        g.add_metric([str(emu.config.max_loras), ",".join(waiting), ",".join(running)],
                     time.time())
        yield g


class EmuRequest:
    """One request in the emulator: how far it got, and an event set when that changes;
    ``lora``: its adapter's name and ``lora_id`` its id (None and 0: the base model)."""

    __slots__ = ("aborted", "arrival", "done", "event", "finish_reason", "finish_time",
                 "first_token_time", "id", "lora", "lora_id", "produced", "prompt_tokens",
                 "stop")

    def __init__(self, rid: str, prompt_tokens: int, stop: int, finish_reason: str,
                 arrival: float, adapter: Adapter | None = None) -> None:
        self.id = rid
        self.lora = None if adapter is None else adapter.name
        self.lora_id = 0 if adapter is None else adapter.id
        self.prompt_tokens = prompt_tokens
        self.stop = stop
        self.finish_reason = finish_reason
        self.arrival = arrival
        self.produced = 0
        self.done = False
        self.aborted = False
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.event = asyncio.Event()


class Emulator:
    """An emulated vLLM instance: ``submit`` requests, await their tokens, ``cancel`` them."""

    def __init__(self, model: BatchTimeModel, config: SchedulerConfig, *, model_name: str,
                 speed: float = 1.0, seed: int = 0, output_median: float = 200.0,
                 output_sigma: float = 0.6, faults: Faults | None = None,
                 enable_prefix_caching: bool = True,
                 frontend: FrontendModel | None = None, max_loras: int = 0,
                 max_cpu_loras: int | None = None,
                 lora_modules: Sequence[LoraModule] = ()) -> None:
        """``enable_prefix_caching`` (vLLM's default, on) replaces the config's own flag (the
        built-in profiles leave it off, the engine's default). ``frontend``: an API server in
        front of the engine (:mod:`duetime.engine.frontend`): a request reaches the engine
        once the server has done the work queued ahead of it and its own, and each token
        reaches its stream once the server has sent it (the engine does not wait); the
        engine-side histograms stay the engine's, as vLLM's are. ``max_loras`` > 0: LoRA on
        (vLLM's ``--enable-lora --max-loras``), ``lora_modules`` loaded in order (ids 1, 2…);
        ``max_cpu_loras`` (default ``max_loras``, not less) is only recorded."""
        if not speed > 0 or not math.isfinite(speed):
            raise ValueError(f"speed must be a positive number, got {speed}")
        if lora_modules and not max_loras:
            raise ValueError("LoRA modules need LoRA enabled (max_loras >= 1)")
        self.model_name = model_name
        self.speed = speed
        self._base_model = model
        self.adapters = Adapters(max_loras, max_cpu_loras) if max_loras else None
        for m in lora_modules:
            self.load_adapter(m.name, m.path, m.base_model_name)
        config = replace(config, enable_prefix_caching=bool(enable_prefix_caching),
                         max_loras=max_loras)
        self.config = config
        self.model = model.scaled(speed)
        self.output_median = output_median
        self.output_sigma = output_sigma
        self.faults = faults or Faults()
        self._rng = random.Random(seed)
        self._fault_rng = random.Random(seed + 1)
        self._ids = itertools.count()
        warm_up()
        self.engine = Engine(config, self.model, retain_finished=False)
        self.frontend = None if frontend is None else Frontend(frontend, time.monotonic())
        self._handing: set[str] = set()  # sent, not at the engine yet (the frontend's queue)
        self._active: dict[str, EmuRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.aborted = 0
        self.finished = 0
        self._cache_seen = (0, 0)  # (queries, hits) already counted in the metrics
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._metrics()

    # -- metrics (vLLM's names) -------------------------------------------------------------------

    def _metrics(self) -> None:
        r, label = self.registry, ["model_name"]
        g = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                  label, registry=r)
        g.labels(self.model_name).set_function(lambda: self.engine.num_running)
        g = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  label, registry=r)
        g.labels(self.model_name).set_function(lambda: self.engine.num_waiting)
        g = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  label, registry=r)
        g.labels(self.model_name).set_function(self.kv_usage)
        self.m_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.", label,
                                buckets=TTFT_BUCKETS, registry=r).labels(self.model_name)
        self.m_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.", label,
                               buckets=LATENCY_BUCKETS, registry=r).labels(self.model_name)
        self.m_tpot = Histogram("vllm:time_per_output_token_seconds",
                                "Histogram of time per output token in seconds.", label,
                                buckets=TPOT_BUCKETS, registry=r).labels(self.model_name)
        self.m_success = Counter("vllm:request_success", "Count of finished requests.",
                                 [*label, "finished_reason"], registry=r)
        self.m_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                label, registry=r).labels(self.model_name)
        self.m_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                             label, registry=r).labels(self.model_name)
        self.m_preempt = Counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                                 label, registry=r).labels(self.model_name)
        self.m_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", label,
            registry=r).labels(self.model_name)
        self.m_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            label, registry=r).labels(self.model_name)
        # vLLM's info gauge of its CacheConfig (there: every field as a string, and the engine)
        cfg = self.config
        info = {"block_size": str(cfg.block_size), "num_gpu_blocks": str(cfg.num_gpu_blocks),
                "enable_prefix_caching": str(cfg.enable_prefix_caching), "engine": "0"}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(info), registry=r).labels(**info).set(1)
        if self.adapters is not None:
            r.register(_LoraInfo(self))

    def kv_usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: cached blocks nobody holds count as free."""
        return self.engine.kv_usage

    @property
    def caching(self) -> bool:
        """Whether prefix caching is on (requests then bring their block keys)."""
        return self.config.enable_prefix_caching

    def lora_names(self) -> tuple[list[str], list[str]]:
        """The names ``vllm:lora_requests_info`` lists as running and as waiting. On vLLM 0.32
        both are the same list (its ``LoRARequestStates`` fills the two dicts from one table,
        zero counts included): the adapters of the requests that have been scheduled and not
        finished, in the order they first arrived; a request still waiting for its first step
        is in neither (its first event travels with its first output: observed on the CPU
        build, ``scripts/vllm_cpu/README.md``). Scheduled: running now, or waiting again with
        output (preempted)."""
        running = set(self.engine.running_ids())
        out: dict[str, None] = {}
        for rid, req in self._active.items():
            if req.lora is not None and not req.done and (rid in running or req.produced):
                out.setdefault(req.lora)
        names = list(out)
        return names, list(names)

    # -- LoRA adapters ----------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str, base_model_name: str | None = None, *,
                     inplace: bool = False) -> Adapter:
        """Load an adapter (vLLM's ``/v1/load_lora_adapter``); AdapterError when refused."""
        if self.adapters is None:
            raise AdapterError(400, "BadRequestError",
                               "LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return self.adapters.load(name, path, base_model_name, inplace=inplace)

    def unload_adapter(self, name: str) -> Adapter:
        """Unload an adapter (vLLM's ``/v1/unload_lora_adapter``); AdapterError when refused."""
        if self.adapters is None:
            raise AdapterError(400, "BadRequestError",
                               "LoRA is not enabled. Use --enable-lora to enable LoRA.")
        return self.adapters.unload(name)

    def resolve(self, model: str | None) -> tuple[bool, Adapter | None]:
        """What a request's ``model`` names: (served, adapter) — the base model (True, None),
        an adapter (True, it), or nothing served here (False, None). The base name wins over
        an adapter of the same name, as in vLLM."""
        if model is None or model == self.model_name:
            return True, None
        adapter = None if self.adapters is None else self.adapters.get(model)
        return adapter is not None, adapter

    def _count_cache(self) -> None:
        """Add the engine's new prefix-cache lookups to the counters (at a step's end)."""
        eng = self.engine
        q, h = eng.prefix_queries, eng.prefix_hits
        q0, h0 = self._cache_seen
        if q != q0 or h != h0:
            self.m_cache_queries.inc(q - q0)
            self.m_cache_hits.inc(h - h0)
            self._cache_seen = (q, h)

    # -- requests ---------------------------------------------------------------------------------

    def draw_output(self, max_tokens: int | None, ignore_eos: bool,
                    prompt_tokens: int) -> tuple[int, str]:
        """(stop length, finish reason): a seeded log-normal natural length around
        ``output_median``, cut at ``max_tokens`` (reason ``length``); ``ignore_eos`` with
        ``max_tokens``: exactly ``max_tokens``. Never past ``max_model_len``."""
        room = self.config.max_model_len - prompt_tokens
        natural = max(1, round(self._rng.lognormvariate(math.log(self.output_median),
                                                         self.output_sigma)))
        if max_tokens is not None and (ignore_eos or natural >= max_tokens):
            stop, reason = max_tokens, "length"
        else:
            stop, reason = natural, "stop"
        if stop >= room:
            stop, reason = max(1, room - 1), "length"
        return stop, reason

    def check(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """Why a request cannot be served (vLLM's 400), or None (see
        :meth:`SchedulerConfig.refusal`)."""
        return self.config.refusal(prompt_tokens, max_tokens)

    def draw_fault(self) -> str | None:
        f = self.faults
        if f.rate > 0 and self._fault_rng.random() < f.rate:
            return self._fault_rng.choice(f.kinds)
        return None

    def submit(self, prompt_tokens: int, *, max_tokens: int | None = None,
               ignore_eos: bool = False, request_id: str | None = None,
               hashes: Sequence[int] = (), adapter: Adapter | None = None) -> EmuRequest:
        """Queue a request (joins at the next step boundary); its id is ``request_id`` when
        given and not in use, else a fresh one. ``hashes``: the keys of its prompt's full
        blocks (:func:`duetime.web.prefix_keys.prompt_block_keys`), for prefix caching;
        ``adapter``: the LoRA adapter it runs on (its name goes into those keys)."""
        if adapter is not None and self.adapters is None:
            raise ValueError("a request on a LoRA adapter needs LoRA enabled")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._drive(), name=f"emulator:{self.model_name}")
        rid = request_id or f"emu-{next(self._ids)}"
        while self.engine.known(rid):
            rid = f"emu-{next(self._ids)}"
        stop, reason = self.draw_output(max_tokens, ignore_eos, prompt_tokens)
        now = time.monotonic()
        req = EmuRequest(rid, prompt_tokens, stop, reason, now, adapter)
        if adapter is not None and hashes:
            hashes = adapter.keyed(hashes)
        self._active[rid] = req
        self.m_prompt.inc(prompt_tokens)
        reach = now if self.frontend is None else self.frontend.admit(rid, now)
        if reach > now:
            self._handing.add(rid)
            asyncio.get_running_loop().call_later(reach - now, self._hand_off, rid, hashes)
        else:
            self._hand_off(rid, hashes)
        return req

    def _hand_off(self, rid: str, hashes: Sequence[int]) -> None:
        """The request reaches the engine's waiting queue (joins at the next step)."""
        self._handing.discard(rid)
        req = self._active.get(rid)
        if req is None:  # (cancelled while the frontend held it)
            return
        now = time.monotonic()
        if self.engine.idle:
            self.engine.set_clock(now)
        self.engine.add(rid, req.prompt_tokens, req.stop, arrival=now, hashes=hashes,
                        lora=req.lora_id)
        self._wake.set()

    def set_speed(self, speed: float) -> None:
        """Run ``speed`` times faster than the profile from the next step on (a server that
        drifts, for tests of the gateway's online correction)."""
        if not speed > 0 or not math.isfinite(speed):
            raise ValueError(f"speed must be a positive number, got {speed}")
        self.speed = speed
        self.model = self._base_model.scaled(speed)
        self.engine.set_model(self.model)

    def cancel(self, req: EmuRequest) -> None:
        """The client went away: abort the request (frees its KV at once)."""
        if req.done:
            return
        if req.id in self._handing:
            self._handing.discard(req.id)
        else:
            self.engine.abort(req.id)
        if self.frontend is not None:
            self.frontend.finish(req.id)
        self._active.pop(req.id, None)
        req.done = req.aborted = True
        req.finish_reason = "abort"
        self.aborted += 1
        self.m_success.labels(self.model_name, "abort").inc()
        req.event.set()

    def snapshot(self) -> Snapshot:
        """The engine's state: at the end of the step in flight, or now when idle."""
        if self.engine.idle:
            self.engine.set_clock(time.monotonic())
        return self.engine.snapshot()

    def snapshot_dict(self, *, full: bool = False) -> dict[str, Any]:
        """The snapshot's JSON form: light (version 1: the prefix cache left out) or ``full``
        (version 2 with the cache while caching is on). With LoRA it is of version 3 (the
        adapters: ``config.max_loras``, each request's ``lora``), and the light form then
        leaves the cache out as version 1 does (``enable_prefix_caching`` false,
        ``prefix_cache_omitted`` true)."""
        snap = self.snapshot()
        if not self.config.max_loras:
            return snap.to_dict(2 if full else 1)
        if full or not self.caching:
            return snap.to_dict(3)
        light = Snapshot(replace(snap.config, enable_prefix_caching=False), snap.model,
                         time=snap.time, running=snap.running_table,
                         waiting=snap.waiting_table)
        return {**light.to_dict(3), "prefix_cache_omitted": True}

    async def close(self) -> None:
        """Stop the driver; requests still in flight end as aborted."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._active.values()):
            self.cancel(req)

    # -- the driver -------------------------------------------------------------------------------

    async def _drive(self) -> None:
        clock = time.monotonic
        eng = self.engine
        while True:
            if eng.idle:
                self._wake.clear()
                await self._wake.wait()
                eng.set_clock(clock())
            elif clock() - eng.time > MAX_LAG_S:
                eng.set_clock(clock())
            try:
                ev = eng.step(tokens=True)
            except EngineStuck as e:  # cannot happen for requests that passed check()
                log.error("emulator %s: %s; aborting the waiting queue", self.model_name, e)
                for rid in eng.waiting_ids():
                    req = self._active.get(rid)
                    if req is not None:
                        self.cancel(req)
                await asyncio.sleep(0)
                continue
            if ev is None:
                continue
            if ev.preempted:
                self.m_preempt.inc(ev.preempted)
            early = ev.outputs_at < ev.end  # asynchronous: the last step's outputs, due now
            if early:
                self._release(ev.outputs_at, ev.tokens, ev.first_token_ids, ev.finished_ids)
            # always yield (sleep(0) when late): the step loop must never starve the server
            await asyncio.sleep(max(0.0, ev.end - clock()))
            if not early:
                self._release(ev.end, ev.tokens, ev.first_token_ids, ev.finished_ids)
            if self.caching:
                self._count_cache()

    def _release(self, t: float, tokens: list[str], first: list[str],
                 finished: list[str]) -> None:
        """What a step produced reaches its requests: one more token each, first-token
        times, finishes — through the frontend, when there is one."""
        if self.frontend is not None:
            self._through_frontend(t, tokens, first, finished)
            return
        active = self._active
        made = 0
        for rid in tokens:
            req = active.get(rid)
            if req is not None:
                req.produced += 1
                req.event.set()
                made += 1
        if made:
            self.m_gen.inc(made)
        self._first_tokens(t, first)
        for rid in finished:
            req = active.pop(rid, None)
            if req is not None:
                self._finish(req, t)

    def _first_tokens(self, t: float, first: list[str]) -> None:
        """The engine made these requests' first tokens at ``t`` (vLLM's TTFT histogram is
        the engine's, whatever the frontend does after)."""
        active = self._active
        for rid in first:
            req = active.get(rid)
            if req is not None:
                req.first_token_time = t
                self.m_ttft.observe(t - req.arrival)

    def _finish(self, req: EmuRequest, t: float) -> None:
        req.done = True
        req.finish_time = t
        self.finished += 1
        self.m_success.labels(self.model_name, req.finish_reason).inc()
        self.m_e2e.observe(t - req.arrival)
        if req.produced > 1 and req.first_token_time is not None:
            self.m_tpot.observe((t - req.first_token_time) / (req.produced - 1))
        req.event.set()

    def _through_frontend(self, t: float, tokens: list[str], first: list[str],
                          finished: list[str]) -> None:
        """A step's outputs handed to the frontend at ``t``: each token reaches its stream
        when the server has sent its chunk (a token whose stream's chunk still waits goes out
        with it); a request ends with its last token; the engine-side metrics count ``t``."""
        fe, active = self.frontend, self._active
        assert fe is not None
        live = [rid for rid in tokens if rid in active]
        if live:
            self.m_gen.inc(len(live))
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for rid, at in zip(live, fe.emit(t, live), strict=True):
            loop.call_later(max(0.0, at - now), self._deliver, active[rid])
        self._first_tokens(t, first)
        for rid in finished:
            if active.pop(rid, None) is not None:
                fe.finish(rid)

    def _deliver(self, req: EmuRequest) -> None:
        """One token of ``req`` out of the frontend; with its last (its ``stop``-th: the
        emulator's requests end there), the request ends (in whatever order timers due at
        the same time run)."""
        if req.done:
            return
        req.produced += 1
        if req.produced >= req.stop:
            self._finish(req, time.monotonic())
        else:
            req.event.set()
