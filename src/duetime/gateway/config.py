"""The gateway's pool config: one YAML file (see docs/gateway.md), validated with errors that
name the file, the field and the reason (``pool.yaml: instances[1].url: must be an http(s)
URL``)."""

from __future__ import annotations

import ipaddress
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.engine.frontend import FrontendModel
from duetime.engine.profiles import load_profile, profile_names
from duetime.engine.spec import InstanceSpec, resolve_spec
from duetime.gateway.autoscaling import AutoscaleConfig, AutoscaleSpec, resolve_autoscale
from duetime.gateway.keys import AuthConfig, AuthSpec, resolve_auth
from duetime.policy.registry import PolicyError, check_params, policy_names
from duetime.web.limits import DEFAULT_LIMITS, LimitsSpec

ALIAS_DEFAULT = "auto"


class ConfigError(ValueError):
    """A pool config that cannot be used; the message names the source, field and reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Prices(_Strict):
    prompt: float = Field(ge=0)
    output: float = Field(ge=0)


class EmbeddedSpec(BaseModel):
    """``emulate:`` an instance that the service running the gateway starts in-process (an
    emulator) instead of ``url``; its URL is filled in once it listens. The gateway reads its
    ``speed`` (the instance's timing); the other keys are the embedded emulator's options,
    validated by the service that starts it (:mod:`duetime.service`)."""

    model_config = ConfigDict(extra="allow")
    speed: float = Field(1.0, gt=0)


class KvEventsSpec(_Strict):
    """``kv_events:`` where an instance publishes vLLM's KV-cache events (its
    ``--kv-events-config``'s ``endpoint`` as seen from the gateway, e.g. ``tcp://host:5557``,
    or an ``ipc://`` path on the same machine; ``replay``: its ``replay_endpoint``, to recover
    missed batches)."""

    endpoint: str
    replay: str | None = None
    topic: str = ""
    # a block the gateway predicted (it routed the request) that no event confirms within this
    # long after the request's first token leaves the estimate
    expire_s: float = Field(2.0, gt=0, le=600)

    @field_validator("endpoint", "replay")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is None or (v.startswith("tcp://") and ":" in v[6:]) or (
                v.startswith("ipc://") and len(v) > 6):
            return v
        raise ValueError(f"must be a ZMQ address tcp://HOST:PORT or ipc://PATH, got {v!r}")


class _InstanceIn(_Strict):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    url: str | None = None
    emulate: EmbeddedSpec | None = None
    served_model: str | None = None
    profile: str | None = None
    batch_time: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    speed: float = Field(1.0, gt=0)
    price_usd_per_mtok: Prices | None = None
    snapshot: Literal["auto", "off"] = "auto"
    kv_events: KvEventsSpec | None = None  # (a bare address: the endpoint)
    # time outside the engine loop until the first token is back (HTTP, tokenisation):
    # added to the engine's forecast; `duetime calibrate` measures it
    request_overhead_ms: float = Field(0.0, ge=0, le=60_000)
    # the API server's costs (request_ms, chunk_ms, servers: engine/frontend.py), from
    # `duetime calibrate`: its queue enters the forecasts
    frontend: dict[str, Any] | None = None
    # an emulated instance started this many times (name.0, name.1, ...; seeds seed, seed+1..)
    replicas: int = Field(1, ge=1, le=1000)
    # dns: the URL's host is a name whose addresses are the replicas (a headless Service),
    # looked up every discovery.dns_interval_s: one member per address (name@address)
    # kubernetes: the ready pods an InferencePool selects (inference_pool: NAMESPACE/NAME),
    # watched through the Kubernetes API: one member per pod and target port (name@pod)
    discover: Literal["none", "dns", "kubernetes"] = "none"
    inference_pool: str | None = Field(None, pattern=r"^([a-z0-9][-a-z0-9]*/)?[a-z0-9][-a-z0-9.]*$")
    # the LoRA adapters it serves (vLLM's --lora-modules names): a request whose model is one
    # of them may go there, and runs on it; needs config.max_loras (vLLM's --max-loras)
    adapters: list[str] = Field(default_factory=list)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("http://", "https://")) or len(v.split("://", 1)[1]) == 0:
            raise ValueError(f"must be an http(s) URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("kv_events", mode="before")
    @classmethod
    def _kv_events(cls, v: Any) -> Any:
        return {"endpoint": v} if isinstance(v, str) else v

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                load_profile(v)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        return v


class QualitySpec(_Strict):
    workload: str | None = "paper"
    tasks: dict[str, dict[str, float]] = {}
    default_task: str | None = None
    predictor: str | None = None  # a directory from `duetime predict train`

    @field_validator("tasks")
    @classmethod
    def _acc(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for task, row in v.items():
            for model, acc in row.items():
                if not 0.0 <= acc <= 1.0:
                    raise ValueError(f"{task}.{model}: accuracy must be in [0, 1], got {acc}")
        return v


class TaskTargetSpec(_Strict):
    """A class's own TTFT target: the fields given override the pool's."""

    base_ms: float | None = Field(None, ge=0)
    per_prompt_token_ms: float | None = Field(None, ge=0)
    min_ms: float | None = Field(None, ge=0)
    max_ms: float | None = Field(None, gt=0)


class TargetSpec(_Strict):
    """The default TTFT target: clip(base + per token x prompt tokens, min, max); ``tasks``:
    per task (SLO class, ``x-duetime-task``) what differs from it."""

    base_ms: float = Field(155.0, ge=0)
    per_prompt_token_ms: float = Field(0.035, ge=0)
    min_ms: float = Field(150.0, ge=0)
    max_ms: float = Field(1120.0, gt=0)
    tasks: dict[str, TaskTargetSpec] = Field(default_factory=dict)

    def for_task(self, task: str | None) -> TargetSpec:
        """The rule that applies to ``task``'s requests."""
        own = self.tasks.get(task) if task is not None else None
        if own is None:
            return self
        return self.model_copy(update={k: v for k, v in own.model_dump().items()
                                       if v is not None})


class TaskDeadlineSpec(_Strict):
    """A class's own deadline rule: the fields given override the pool's."""

    base_ms: float | None = Field(None, ge=0)
    per_prompt_token_ms: float | None = Field(None, ge=0)
    per_output_token_ms: float | None = Field(None, ge=0)
    max_ms: float | None = Field(None, gt=0)


class DeadlineSpec(_Strict):
    """The default end-to-end deadline (from the request's arrival to its last token): base +
    per prompt token x prompt tokens + per output token x its output tokens (``max_tokens``,
    else the pool's default), at most ``max_ms``; none while ``base_ms`` is unset. ``tasks``:
    per task what differs (``base_ms`` set there gives that task deadlines alone)."""

    base_ms: float | None = Field(None, ge=0)
    per_prompt_token_ms: float = Field(0.0, ge=0)
    per_output_token_ms: float = Field(0.0, ge=0)
    max_ms: float | None = Field(None, gt=0)
    tasks: dict[str, TaskDeadlineSpec] = Field(default_factory=dict)

    def for_task(self, task: str | None) -> DeadlineSpec:
        own = self.tasks.get(task) if task is not None else None
        if own is None:
            return self
        return self.model_copy(update={k: v for k, v in own.model_dump().items()
                                       if v is not None})


class StateSpec(_Strict):
    source: Literal["auto", "shadow", "published", "metrics"] = "auto"
    scrape_interval_s: float = Field(0.05, ge=0.005, le=60)
    idle_scrape_interval_s: float = Field(1.0, ge=0.005, le=600)
    max_age_s: float = Field(0.25, gt=0)
    sync_interval_s: float = Field(0.02, ge=0)
    # online correction of each instance's TTFT forecasts from the first tokens it delivers
    # (duetime.estimate.correction): on unless false
    ttft_correction: bool = True
    # online correction of each instance's step time from the tokens it streams (the shadow
    # replica's model; duetime.estimate.correction.StepCorrection): off unless true
    step_correction: bool = False
    # ask each instance for the output tokens so far in every streamed chunk (vLLM's
    # stream_options.continuous_usage_stats), to count tokens where a lagging API server merged
    # several into one chunk; stripped from what clients that did not ask for it see. False
    # for servers that reject the option (tokens are then counted one per chunk)
    continuous_usage: bool = True
    # where gateway replicas share live state (duetime.gateway.backends.redis_flights): a redis:// (or
    # rediss://, unix://) URL; unset: this process's memory only
    store: str | None = None
    # a replica syncs with the store at each dispatch, first token and end (its own or, told
    # by Redis pub/sub, another's), and at least this often (token counts, its heartbeat)
    store_sync_s: float = Field(0.05, gt=0, le=10)
    store_ttl_s: float = Field(5.0, gt=0, le=3600)  # a silent replica's state expires after this
    store_prefix: str = Field("duetime", min_length=1, max_length=64, pattern=r"^[\w.:-]+$")

    @field_validator("store")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("a Redis URL: redis://host:port/db, rediss://... or unix://path")
        return v


class TimeoutSpec(_Strict):
    connect_s: float = Field(2.0, gt=0)
    first_token_s: float = Field(60.0, gt=0)
    read_s: float = Field(60.0, gt=0)


class HealthSpec(_Strict):
    """``health:`` probes, outlier detection and how much of the pool may be ejected
    (:mod:`duetime.gateway.state.health`)."""

    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    eject_after: int = Field(3, ge=1)          # failures in a row
    window_s: float = Field(10.0, gt=0)        # the failure-rate window
    failure_rate: float = Field(0.5, gt=0, le=1)
    min_requests: int = Field(5, ge=1)         # in the window, before the rate counts
    max_ejected_fraction: float = Field(0.5, ge=0, le=1)
    # none of a request's candidates in rotation: try the least bad one instead of a 503
    fail_open: bool = True


class AdmissionSpec(_Strict):
    """``admission:`` what happens when no instance can meet a request's target, by its
    priority (:mod:`duetime.gateway.intake.admission`)."""

    max_queued: int = Field(256, ge=0, le=100_000)  # critical requests waiting in the gateway
    # the queue lets the key served the fewest tokens recently go first; "recently": its
    # count of tokens halves every this many seconds (policy/admission_order.py)
    fairness_half_life_s: float = Field(60.0, gt=0, le=86_400)
    # a critical request that found no instance able to meet its target before the target was
    # spent (or found the queue full): ``late``, sent to the best forecast anyway; ``reject``,
    # refused (429), so that a saturated pool's instances queue only what can still be served
    expired: Literal["late", "reject"] = "late"
    # the gateway's own loop under every forecast: the intakes it holds and the first tokens
    # it has to relay ahead of a request, at their measured costs (gateway/state/load.py)
    gateway_load: bool = True
    cpu_window_s: float = Field(0.25, gt=0, le=600)  # the window its relay cost is measured on


class DiscoverySpec(_Strict):
    """``discovery:`` how the pool follows changes while serving (docs/gateway.md,
    "Membership"): its config file re-read when it changes, DNS groups looked up again."""

    # the pool config file is checked for changes this often (0: only on SIGHUP)
    watch_s: float = Field(1.0, ge=0, le=3600)
    dns_interval_s: float = Field(5.0, gt=0, le=3600)  # DNS groups are looked up this often
    # the DNS servers to ask, HOST or HOST:PORT (none: the system's resolver)
    dns_servers: list[str] = []
    dns_timeout_s: float = Field(2.0, gt=0, le=60)
    # the Kubernetes API for discover: kubernetes: a kubeconfig file (relative to the pool
    # config); null: the pod's service account (in-cluster), else $KUBECONFIG
    kubeconfig: str | None = None

    @field_validator("dns_servers")
    @classmethod
    def _servers(cls, v: list[str]) -> list[str]:
        for server in v:
            dns_server_address(server)
        return v


def dns_server_address(server: str) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT`` as (IP address, port; 53 by default);
    ValueError if the host is not an IP address or the port is not one."""
    host, port = server, "53"
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        port = rest.removeprefix(":") or "53"
    elif server.count(":") == 1:
        host, port = server.split(":")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"a DNS server is an IP address (HOST, HOST:PORT or [IPv6]:PORT), "
                         f"got {server!r}") from None
    if not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"bad port in DNS server {server!r}")
    return host, int(port)


class PoolSpec(_Strict):
    instances: list[_InstanceIn] = Field(min_length=1)
    policy: str | dict[str, Any] = "sfs"
    lambda_: float = Field(5.0e-4, alias="lambda", ge=0)
    delta: float = Field(1.0e-6, ge=0)
    alpha: float = Field(0.7, ge=0)
    seed: int = 0
    # more attempts after a failed one (never the same instance twice until every one in
    # rotation was tried); a 5xx, a refused connection or a broken stream costs milliseconds
    retries: int = Field(5, ge=0, le=10)
    default_output_tokens: int = Field(256, ge=1)
    aliases: list[str] = [ALIAS_DEFAULT]
    # a model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a
    # tokenizer.json: prompts as the token ids vLLM sees (duetime.gateway.intake.prompt_tokens)
    tokenizer: str | None = None
    chat_template: str | None = None  # a jinja file: overrides the tokenizer folder's template
    quality: QualitySpec = QualitySpec()
    ttft_target: TargetSpec = TargetSpec()
    deadline: DeadlineSpec = DeadlineSpec()  # an end-to-end deadline rule (none by default)
    state: StateSpec = StateSpec()
    timeouts: TimeoutSpec = TimeoutSpec()
    health: HealthSpec = HealthSpec()
    admission: AdmissionSpec = AdmissionSpec()
    auth: AuthSpec | None = None  # API keys and admin keys (duetime.gateway.keys)
    limits: LimitsSpec = LimitsSpec()  # protocol limits (duetime.web.limits)
    discovery: DiscoverySpec = DiscoverySpec()  # membership while serving
    autoscale: AutoscaleSpec = AutoscaleSpec()  # the desired-replica signal (gateway/autoscaling)


# -- resolved -----------------------------------------------------------------------------------

def adapter_id(name: str) -> int:
    """The gateway's id of the LoRA adapter ``name`` (>= 1; a CRC-32 of the name: stable
    across reloads and replicas, distinct for any handful of names but by a 1 in 2^31
    chance)."""
    return 1 + zlib.crc32(name.encode()) % ((1 << 31) - 1)


@dataclass(frozen=True, slots=True)
class Instance:
    """One upstream instance of the pool: where it is, what clients call its model, and its
    :class:`~duetime.engine.spec.InstanceSpec` (timing in wall seconds, speed applied; limits;
    prices; request overhead)."""

    name: str
    model: str
    served_model: str
    url: str | None                   # None until an embedded instance is started
    emulate: dict[str, Any] | None    # the embedded instance's options (see EmbeddedSpec)
    profile: str | None
    spec: InstanceSpec
    snapshot: str
    kv_events: KvEventsSpec | None = None  # where it publishes vLLM's KV events, if it does
    discover: str = "none"  # "dns": a group, one member per address of its URL's host;
    # "kubernetes": one member per ready pod of the InferencePool named here
    inference_pool: str | None = None
    adapters: tuple[str, ...] = ()  # the LoRA adapters it serves (a request may name one)

    @property
    def batch_time(self) -> BatchTimeModel:
        return self.spec.batch_time

    @property
    def config(self) -> SchedulerConfig:
        return self.spec.config

    @property
    def price_prompt(self) -> float:
        return self.spec.price_prompt

    @property
    def price_output(self) -> float:
        return self.spec.price_output

    @property
    def request_overhead_s(self) -> float:
        return self.spec.request_overhead_s

    @property
    def frontend(self) -> FrontendModel | None:
        return self.spec.frontend


@dataclass(frozen=True, slots=True)
class Pool:
    """A validated, resolved pool config."""

    source: str
    instances: tuple[Instance, ...]
    policy: str
    policy_params: dict[str, Any]  # the policy's own parameters (policy: {name, ...})
    lam: float
    delta: float
    alpha: float
    seed: int
    retries: int
    default_output_tokens: int
    aliases: tuple[str, ...]
    quality: dict[str, dict[str, float]]   # task -> model -> accuracy
    default_task: str | None
    target: TargetSpec
    state: StateSpec
    timeouts: TimeoutSpec
    health: HealthSpec
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)
    predictor: str | None = None  # trained predictors (quality, lengths, success), if any
    tokenizer: str | None = None  # a tokenizer folder or tokenizer.json, if any
    chat_template: str | None = None  # a chat template file overriding the folder's, if any
    auth: AuthConfig | None = None  # API keys and admin keys, if configured
    limits: LimitsSpec = DEFAULT_LIMITS  # protocol limits of the gateway's server
    discovery: DiscoverySpec = field(default_factory=DiscoverySpec)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    deadline: DeadlineSpec = field(default_factory=DeadlineSpec)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(i.model for i in self.instances))

    @property
    def adapter_ids(self) -> dict[str, int]:
        """Each LoRA adapter the instances serve, by name, and the id the gateway gives it:
        the ``lora`` its forecasts and shadow replicas run a request on (an instance's own ids
        may differ: only equal adapters must have equal ids). A function of the name alone
        (:func:`adapter_id`), so that a reload, or another gateway replica, gives it the
        same."""
        return {name: adapter_id(name) for i in self.instances for name in i.adapters}

    def with_policy(self, name: str, params: dict[str, Any] | None = None) -> Pool:
        """The same pool routed by another policy (``params``: its own parameters, checked);
        raises ConfigError."""
        policy, checked = _policy({"name": name, **(params or {})}, self.source)
        return replace(self, policy=policy, policy_params=checked)

    def with_store(self, url: str | None) -> Pool:
        """The same pool sharing live state through ``url`` (a Redis URL; ``memory`` or None:
        this process's only); raises ConfigError on another scheme."""
        try:
            state = StateSpec.model_validate({**self.state.model_dump(),
                                              "store": None if url == "memory" else url})
        except ValidationError as e:
            why = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
            raise ConfigError(f"--store {url!r}: {why}") from None
        return replace(self, state=state)

    def with_urls(self, urls: dict[str, str]) -> Pool:
        """The same pool with these instances' URLs set (embedded emulators once started)."""
        return replace(self, instances=tuple(replace(i, url=urls.get(i.name, i.url))
                                             for i in self.instances))

    def policy_defaults(self, lam: float | None = None) -> dict[str, Any]:
        """The pool's shared policy settings (``lambda``, ``seed``, ``delta``, ``alpha``): they
        apply to every policy that declares them, the pool's and any a request asks for
        (``lam``: a request's own lambda instead of the pool's)."""
        return {"lambda": self.lam if lam is None else lam, "seed": self.seed,
                "delta": self.delta, "alpha": self.alpha}

    def target_ms(self, prompt_tokens: int, task: str | None = None) -> float:
        """The default TTFT target of a request (its task's rule where it has one)."""
        t = self.target if not self.target.tasks else self.target.for_task(task)
        return min(max(t.base_ms + t.per_prompt_token_ms * prompt_tokens, t.min_ms), t.max_ms)

    def deadline_ms(self, prompt_tokens: int, output_tokens: int,
                    task: str | None = None) -> float | None:
        """The default end-to-end deadline of a request (its task's rule where it has one), or
        None where the rule sets none."""
        d = self.deadline if not self.deadline.tasks else self.deadline.for_task(task)
        if d.base_ms is None:
            return None
        ms = (d.base_ms + d.per_prompt_token_ms * prompt_tokens
              + d.per_output_token_ms * output_tokens)
        return ms if d.max_ms is None else min(ms, d.max_ms)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_errors(err: ValidationError, source: str, prefix: str = "") -> str:
    """Pydantic's errors as ``SOURCE: FIELD: reason`` (``prefix``: where the validated part
    sits in the config)."""
    msgs = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        loc = _loc(e["loc"])
        where = f"{prefix}.{loc}" if prefix and loc != "(top level)" else (prefix or loc)
        msgs.append(f"{source}: {where}: {msg}")
    return "; ".join(msgs)


def pool_from_dict(data: Any, source: str = "pool") -> Pool:
    """Validate and resolve a pool config (the YAML's content)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping (instances, policy, ...)")
    try:
        spec = PoolSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, source)) from None
    return _resolve(spec, source)


Fail = Any  # (a function of (field, reason) that makes the ConfigError to raise)


def _resolve(spec: PoolSpec, source: str) -> Pool:
    def fail(where: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {where}: {why}")

    workload = None
    q = spec.quality
    if q.workload is not None:
        from duetime.workload import ProfileError, load_workload
        try:
            workload = load_workload(q.workload)
        except ProfileError as e:
            raise fail("quality.workload", str(e)) from None
    insts = _instances(spec, workload, source, fail)
    models = list(dict.fromkeys(i.model for i in insts))
    clash = sorted(set(spec.aliases) & set(models))
    if clash:
        raise fail("aliases", f"{clash} are also model names")
    named = {a for i in insts for a in i.adapters}
    if len({adapter_id(a) for a in named}) < len(named):
        raise fail("instances", "two adapter names have one id (adapter_id): rename one")
    clash = sorted(named & (set(spec.aliases) | set(models)))
    if clash:
        raise fail("instances", f"adapters {clash} are also model names or aliases (a "
                   "request's model must say which it is)")
    table = _quality_table(q, workload, models, fail)
    base = Path(source).parent if Path(source).is_file() else Path.cwd()
    predictor = _predictor(q.predictor, base, models, fail)
    tokenizer, chat_template = _tokenizer(spec, base, fail)
    t = spec.ttft_target
    if t.min_ms > t.max_ms:
        raise fail("ttft_target", f"min_ms {t.min_ms} > max_ms {t.max_ms}")
    for task in t.tasks:
        if task not in table:
            raise fail(f"ttft_target.tasks.{task}", f"unknown task; known: {', '.join(table)}")
        own = t.for_task(task)
        if own.min_ms > own.max_ms:
            raise fail(f"ttft_target.tasks.{task}", f"min_ms {own.min_ms} > max_ms "
                       f"{own.max_ms}")
    for task in spec.deadline.tasks:
        if task not in table:
            raise fail(f"deadline.tasks.{task}", f"unknown task; known: {', '.join(table)}")
    if not math.isfinite(spec.lambda_):
        raise fail("lambda", "must be finite")
    policy, params = _policy(spec.policy, source)
    # (a key may name adapters among its models: requests name them as models)
    auth = resolve_auth(spec.auth, base, [*models, *sorted(named)], spec.aliases, fail)
    discovery = spec.discovery
    if discovery.kubeconfig is not None:
        discovery = discovery.model_copy(update={"kubeconfig": str(base / discovery.kubeconfig)})
    return Pool(source, tuple(insts), policy, params, spec.lambda_, spec.delta, spec.alpha,
                spec.seed, spec.retries, spec.default_output_tokens, tuple(spec.aliases), table,
                q.default_task, spec.ttft_target, spec.state, spec.timeouts, spec.health,
                admission=spec.admission, predictor=predictor, tokenizer=tokenizer,
                chat_template=chat_template, auth=auth, limits=spec.limits,
                discovery=discovery,
                autoscale=resolve_autoscale(spec.autoscale, models, base, fail),
                deadline=spec.deadline)


def _instances(spec: PoolSpec, workload: Any, source: str, fail: Fail) -> list[Instance]:
    """The pool's instances resolved: names unique, a URL or an emulator each, their profile,
    timing (speed applied), limits, prices (given, or the quality workload's) and overhead."""
    names: set[str] = set()
    insts = []
    for w, s in _expanded(spec.instances, fail):
        if s.name in names:
            raise fail(f"{w}.name", f"duplicate instance name {s.name!r}")
        names.add(s.name)
        if s.discover == "kubernetes":
            _check_pod_group(s, w, fail)
        elif (s.url is None) == (s.emulate is None):
            raise fail(w, "needs exactly one of url (a running server) or emulate (start an "
                       "in-process emulator)")
        elif s.inference_pool is not None:
            raise fail(f"{w}.inference_pool", "only with discover: kubernetes")
        profile = s.profile
        if profile is None and s.batch_time is None and s.emulate is not None \
                and s.model in profile_names():
            profile = s.model
        try:
            ispec = resolve_spec(s.model, profile=profile, batch_time=s.batch_time,
                                 config=s.config, where=w)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(f"{source}: {msg}" if msg.startswith(w) else
                              f"{source}: {w}: {msg}") from None
        if s.emulate is not None and profile is None:
            raise fail(f"{w}.emulate", "an emulated instance needs a profile")
        speed = s.emulate.speed if s.emulate is not None else s.speed
        if s.price_usd_per_mtok is not None:
            pp, po = s.price_usd_per_mtok.prompt, s.price_usd_per_mtok.output
        elif workload is not None and s.model in workload.models:
            m = workload.models[s.model]
            pp, po = m.price_prompt, m.price_output
        else:
            raise fail(f"{w}.price_usd_per_mtok", f"missing (and model {s.model!r} is not in "
                       "the quality workload); give {prompt: USD/Mtok, output: USD/Mtok}")
        try:
            frontend = (None if s.frontend is None
                        else FrontendModel.from_dict(s.frontend, f"{w}.frontend"))
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        ispec = replace(ispec.scaled(speed).priced(pp, po),
                        request_overhead_s=s.request_overhead_ms / 1000.0, frontend=frontend)
        if s.discover == "dns":
            _check_dns_group(s, w, fail)
        if s.adapters and not ispec.config.max_loras:
            raise fail(f"{w}.adapters", "LoRA adapters need config.max_loras (vLLM's "
                       "--max-loras, at least 1)")
        if len(set(s.adapters)) != len(s.adapters) or not all(s.adapters):
            raise fail(f"{w}.adapters", f"must be distinct non-empty names, got {s.adapters}")
        insts.append(Instance(s.name, s.model, s.served_model or s.model, s.url,
                              None if s.emulate is None else s.emulate.model_dump(), profile,
                              ispec, s.snapshot, s.kv_events, s.discover,
                              s.inference_pool, tuple(s.adapters)))
    return insts


def _check_dns_group(s: _InstanceIn, where: str, fail: Fail) -> None:
    """A DNS group names its replicas by a host name in its URL (its members are named
    ``name@address``: the name may not have an ``@``)."""
    if s.url is None:
        raise fail(f"{where}.discover", "dns needs a url whose host is a DNS name")
    host = urlsplit(s.url).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        raise fail(f"{where}.discover", f"dns needs a host name in the url, not the address "
                   f"{host!r}")
    _check_group(s, where, "ADDRESS", fail)


def _check_pod_group(s: _InstanceIn, where: str, fail: Fail) -> None:
    """An InferencePool's pods: named by the pool, not by a URL or an emulator."""
    if s.inference_pool is None:
        raise fail(f"{where}.inference_pool", "required with discover: kubernetes "
                   "(NAMESPACE/NAME of the InferencePool whose pods serve it)")
    if s.url is not None or s.emulate is not None:
        raise fail(where, "discover: kubernetes takes its pods' addresses from the "
                   "InferencePool: no url or emulate")
    _check_group(s, where, "POD", fail)


def _check_group(s: _InstanceIn, where: str, member: str, fail: Fail) -> None:
    """What any group needs: a name its members' names extend, and no instance-only settings."""
    if "@" in s.name:
        raise fail(f"{where}.name", f"a group's name may not contain '@' (its members are "
                   f"named NAME@{member})")
    if s.kv_events is not None:
        raise fail(f"{where}.kv_events", "not for a group (each replica publishes its own "
                   "events: list the replicas one by one)")


def _quality_table(q: QualitySpec, workload: Any, models: list[str],
                   fail: Fail) -> dict[str, dict[str, float]]:
    """Task -> model -> accuracy: the quality workload's, overridden by ``quality.tasks``;
    every model needs an accuracy for every task."""
    table: dict[str, dict[str, float]] = {}
    if workload is not None:
        for t, task in workload.tasks.items():
            table[t] = {m: task.accuracy[m] for m in models if m in task.accuracy}
    for t, row in q.tasks.items():
        table.setdefault(t, {}).update(row)
    if not table:
        raise fail("quality", "no tasks: give quality.workload or quality.tasks")
    for t, row in table.items():
        missing = [m for m in models if m not in row]
        if missing:
            raise fail(f"quality.tasks.{t}", f"no accuracy for model(s) {missing} (add them, "
                       "or name a quality.workload whose models include them)")
    if q.default_task is not None and q.default_task not in table:
        raise fail("quality.default_task", f"unknown task {q.default_task!r}; tasks: "
                   f"{', '.join(table)}")
    return table


def _predictor(path: str | None, base: Path, models: list[str], fail: Fail) -> str | None:
    """``quality.predictor``: a trained predictor folder that knows every model (loaded once
    here to check it)."""
    if path is None:
        return None
    from duetime.predict.quality_source import Trained
    predictor = str(Path(path) if Path(path).is_absolute() else base / path)
    try:
        trained = Trained(predictor)
    except (OSError, ValueError) as e:  # PredictorFormatError is a ValueError
        raise fail("quality.predictor", str(e)) from None
    unknown = [m for m in models if m not in trained.predictor.models]
    if unknown:
        raise fail("quality.predictor", f"the predictor knows no model(s) {unknown} (it was "
                   f"trained for {', '.join(trained.predictor.models)})")
    return predictor


def _tokenizer(spec: PoolSpec, base: Path, fail: Fail) -> tuple[str | None, str | None]:
    """``tokenizer`` and ``chat_template``: paths that exist, and a tokenizer that loads."""
    tokenizer = chat_template = None
    if spec.chat_template is not None:
        if spec.tokenizer is None:
            raise fail("chat_template", "needs a tokenizer (the template's text is encoded "
                       "with it)")
        chat_template = str(base / spec.chat_template)  # (an absolute path stays as it is)
        if not Path(chat_template).is_file():
            raise fail("chat_template", f"{chat_template}: no such file")
    if spec.tokenizer is not None:
        from duetime.web.prompt_tokens import PromptTokenizer, TokenizerError
        tokenizer = str(base / spec.tokenizer)
        if not Path(tokenizer).exists():
            raise fail("tokenizer", f"{tokenizer}: no such file or folder")
        try:
            PromptTokenizer(tokenizer, chat_template)
        except TokenizerError as e:
            raise fail("tokenizer", str(e)) from None
    return tokenizer, chat_template


def _expanded(instances: list[_InstanceIn], fail: Fail) -> list[tuple[str, _InstanceIn]]:
    """Each instance with where it was written; an emulated one with ``replicas: N`` becomes
    N instances ``name.0`` .. ``name.{N-1}`` whose emulators are seeded one apart."""
    out = []
    for i, s in enumerate(instances):
        w = f"instances[{i}]"
        if s.replicas == 1:
            out.append((w, s))
            continue
        if s.emulate is None:
            raise fail(f"{w}.replicas", "only an emulated instance (emulate:) is started several "
                       "times; list each running server with its own url")
        seed = (s.emulate.model_extra or {}).get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise fail(f"{w}.emulate.seed", f"must be an integer, got {seed!r}")
        out += [(w, s.model_copy(update={
            "name": f"{s.name}.{k}", "replicas": 1,
            "emulate": s.emulate.model_copy(update={"seed": seed + k})}))
            for k in range(s.replicas)]
    return out


def _policy(value: str | dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """``policy: NAME`` or ``policy: {name: NAME, PARAM: VALUE, ...}``, checked against the
    policy registry (the parameters must be the policy's own)."""
    if isinstance(value, dict):
        params = dict(value)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError(f"{source}: policy.name: required (a policy name) when policy is "
                              "a mapping")
    else:
        name, params = value, {}
    if name not in policy_names():
        raise ConfigError(f"{source}: policy: unknown policy {name!r}; one of "
                          f"{', '.join(policy_names())}")
    try:
        return name, check_params(name, params, "policy")
    except PolicyError as e:
        raise ConfigError(f"{source}: {e}") from None


def load_pool(path: str | Path) -> Pool:
    """Read and validate a pool config YAML file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    return pool_from_text(text, source)


def pool_from_text(text: str, source: str) -> Pool:
    """Validate a pool config's YAML text (``source``: the file it is, or stands for: paths
    in it are relative to that file's folder)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML ({' '.join(str(e).split())})") from None
    return pool_from_dict(data, source)
