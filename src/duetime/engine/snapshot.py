"""Snapshots: one instance's state at one moment (the JSON format: ``docs/engine.md``,
"Snapshots").

``Snapshot.from_dict`` validates untrusted JSON (errors name the field and the reason);
the constructor takes already-checked parts from trusted producers (the gateway, the simulator).
A snapshot is immutable, so what a forecast derives from it is computed once and cached on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import TypedDict

from duetime.engine.batch_time import BatchTimeModel, model_from_dict
from duetime.engine.config import SchedulerConfig
from duetime.engine.kv import held_blocks
from duetime.engine.prefix_json import block_keys, build_state, export_state
from duetime.engine.prefix_state import PrefixState

SNAPSHOT_VERSION = 1  # what to_dict writes without prefix caching; with it, version 2
SNAPSHOT_VERSIONS = (1, 2, 3)  # 3: LoRA adapters (config.max_loras, a request's lora)


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message names the field and the reason."""


@dataclass(frozen=True, slots=True)
class ResidentRequest:
    """A request resident at the instance when the snapshot was taken."""

    id: str
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    predicted_output_tokens: int
    arrival: float = 0.0
    lora: int = 0  # its LoRA adapter (vLLM's lora_int_id; 0: the base model)

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "prompt_tokens": self.prompt_tokens,
               "computed_tokens": self.computed_tokens, "output_tokens": self.output_tokens,
               "predicted_output_tokens": self.predicted_output_tokens, "arrival": self.arrival}
        if self.lora:
            out["lora"] = self.lora
        return out


class RequestTable:
    """Resident requests column by column (numpy), the form the compiled replay starts from."""

    __slots__ = ("_ids", "arrival", "computed", "lora", "output", "predicted", "prompt")

    def __init__(self, ids: Sequence[str] | Callable[[], list[str]], prompt: Sequence[int],
                 computed: Sequence[int], output: Sequence[int], predicted: Sequence[int],
                 arrival: Sequence[float] | None = None,
                 lora: Sequence[int] | None = None) -> None:
        """``ids``: the ids, or a callable that makes them when first read (a forecast never
        reads them: an engine's snapshot on the routing path skips building them); ``lora``:
        the adapters (None: every request on the base model)."""
        self._ids = ids if callable(ids) else list(ids)
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.computed = np.asarray(computed, dtype=np.int64)
        self.output = np.asarray(output, dtype=np.int64)
        self.predicted = np.asarray(predicted, dtype=np.int64)
        self.arrival = (np.zeros(len(self.prompt)) if arrival is None
                        else np.asarray(arrival, dtype=np.float64))
        if len(self.arrival) != len(self.prompt):
            raise ValueError("RequestTable: arrival and prompt differ in length")
        self.lora = None if lora is None else np.asarray(lora, dtype=np.int64)
        if self.lora is not None and len(self.lora) != len(self.prompt):
            raise ValueError("RequestTable: lora and prompt differ in length")

    @property
    def has_lora(self) -> bool:
        """Whether some request is on an adapter."""
        return self.lora is not None and bool(self.lora.any())

    @property
    def ids(self) -> list[str]:
        if callable(self._ids):
            self._ids = list(self._ids())
        return self._ids

    @classmethod
    def of(cls, requests: Sequence[ResidentRequest]) -> RequestTable:
        lora = [r.lora for r in requests]
        return cls([r.id for r in requests], [r.prompt_tokens for r in requests],
                   [r.computed_tokens for r in requests], [r.output_tokens for r in requests],
                   [r.predicted_output_tokens for r in requests], [r.arrival for r in requests],
                   lora if any(lora) else None)

    def __len__(self) -> int:
        return len(self.prompt)

    def requests(self) -> tuple[ResidentRequest, ...]:
        lora = self.lora.tolist() if self.lora is not None else [0] * len(self)
        return tuple(ResidentRequest(*row) for row in zip(
            self.ids, self.prompt.tolist(), self.computed.tolist(), self.output.tolist(),
            self.predicted.tolist(), self.arrival.tolist(), lora, strict=True))


# -- JSON schema (pydantic) ---------------------------------------------------------------------

class _ConfigIn(BaseModel):
    # Unknown keys are errors (a misspelt limit would silently change every forecast), but
    # vLLM's names for the modes these rules assume are accepted when they say so.
    model_config = ConfigDict(extra="forbid", strict=True)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int = Field(32768, ge=2)
    block_size: int = Field(16, ge=1)
    num_gpu_blocks: int = Field(100_000, ge=2)
    long_prefill_token_threshold: int = Field(0, ge=0)
    scheduler_reserve_full_isl: bool = True
    watermark: float = Field(0.0, ge=0.0, lt=1.0)
    async_scheduling: bool = False
    chunked_prefill: Literal[True] = True
    enable_chunked_prefill: Literal[True] = True
    prefix_caching: bool | None = None  # vLLM's other name for it
    enable_prefix_caching: bool = False
    max_loras: int = Field(0, ge=0)  # version 3: vLLM's --max-loras (0: LoRA off)
    enable_lora: bool | None = None  # vLLM's flag: true needs max_loras (its default is 1)
    policy: Literal["fcfs"] = "fcfs"
    scheduling_policy: Literal["fcfs"] = "fcfs"
    preemption_mode: Literal["recompute"] = "recompute"

    def limits(self) -> dict[str, int]:
        out = self.model_dump(include=set(SchedulerConfig.__dataclass_fields__))
        if self.prefix_caching is not None:
            out["enable_prefix_caching"] = self.prefix_caching or self.enable_prefix_caching
        if self.enable_lora and not self.max_loras:
            out["max_loras"] = 1  # vLLM's default with --enable-lora
        elif self.enable_lora is False:
            out["max_loras"] = 0
        return out


class _RequestIn(TypedDict):
    # A TypedDict, not a model: pydantic-core validates a list of them ~4x faster.
    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]
    id: str | int
    status: NotRequired[Literal["running", "waiting"] | None]
    prompt_tokens: Annotated[int, Field(ge=1, strict=True)]
    computed_tokens: NotRequired[Annotated[int, Field(ge=0, strict=True)]]
    output_tokens: NotRequired[Annotated[int, Field(ge=0, strict=True)]]
    predicted_output_tokens: Annotated[int, Field(ge=1, strict=True)]
    arrival: NotRequired[float]
    block_hashes: NotRequired[list[str | int]]  # version 2, with prefix caching
    block_ids: NotRequired[list[Annotated[int, Field(strict=True)]]]  # (running requests)
    lora: NotRequired[Annotated[int, Field(ge=0, strict=True)]]  # version 3


class _PrefixCacheIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cached_free: list[str | int] = Field(default_factory=list)
    free_empty: int = Field(0, ge=0, strict=True)


class _BatchTimeIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    coefficients: dict[str, float]


class _SnapshotIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: int = SNAPSHOT_VERSION
    time: float = 0.0
    config: _ConfigIn = Field(default_factory=_ConfigIn)
    batch_time: _BatchTimeIn
    running: list[_RequestIn] = Field(default_factory=list)
    waiting: list[_RequestIn] = Field(default_factory=list)
    prefix_cache: _PrefixCacheIn | None = None  # version 2, with prefix caching


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = "snapshot"
    for part in first["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else f".{part}"
    more = len(err.errors()) - 1
    tail = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
    return f"{loc}: {first['msg']}{tail}"


def _prefix_state_in(s: _SnapshotIn, config: SchedulerConfig, running: RequestTable,
                     waiting: RequestTable) -> PrefixState | None:
    """The cache of a version-2 snapshot with prefix caching (None otherwise); errors name the
    field."""
    if s.version == 1 and not config.enable_prefix_caching and s.prefix_cache is None:
        return None  # (the common case, polled many times a second: no scan of the requests)
    listed = s.prefix_cache is not None or any("block_hashes" in r or "block_ids" in r
                                               for r in (*s.running, *s.waiting))
    if s.version == 1 and (config.enable_prefix_caching or listed):  # (2 and 3 have it)
        raise SnapshotError("snapshot.config.enable_prefix_caching: prefix caching "
                            "(block_hashes, block_ids, prefix_cache) needs a snapshot of "
                            "version 2")
    if not config.enable_prefix_caching:
        if listed:
            raise SnapshotError("snapshot.config.enable_prefix_caching: block_hashes, "
                                "block_ids and prefix_cache need prefix caching on")
        return None
    hashes = []
    for where, items in (("running", s.running), ("waiting", s.waiting)):
        for i, r in enumerate(items):
            try:
                hashes.append(block_keys(r.get("block_hashes", [])))
            except ValueError as e:
                raise SnapshotError(f"snapshot.{where}[{i}].block_hashes: {e}") from None
    for i, r in enumerate(s.waiting):
        if "block_ids" in r:
            raise SnapshotError(f"snapshot.waiting[{i}].block_ids: a waiting request holds no "
                                "blocks")
    with_ids = ["block_ids" in r for r in s.running]
    if any(with_ids) and not all(with_ids):
        i = with_ids.index(False)
        raise SnapshotError(f"snapshot.running[{i}].block_ids: missing (give them for every "
                            "running request, or for none)")
    ids = [r["block_ids"] for r in s.running] if s.running and all(with_ids) else None
    cache = s.prefix_cache or _PrefixCacheIn()
    try:
        cached = block_keys(cache.cached_free)
    except ValueError as e:
        raise SnapshotError(f"snapshot.prefix_cache.cached_free: {e}") from None
    both = (np.concatenate((running.prompt, waiting.prompt)),
            np.concatenate((running.output, waiting.output)),
            np.concatenate((running.computed, waiting.computed)))
    try:
        return build_state(config, *both, len(running), hashes, cached, cache.free_empty, ids)
    except ValueError as e:
        raise SnapshotError(f"snapshot.{e}") from None


# -- the snapshot -------------------------------------------------------------------------------

class Snapshot:
    """An instance's scheduler config, batch-time model and resident requests at ``time``."""

    __slots__ = ("__weakref__", "_cache", "config", "model", "prefix", "running_table", "time",
                 "waiting_table")

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 running: Sequence[ResidentRequest] | RequestTable = (),
                 waiting: Sequence[ResidentRequest] | RequestTable = (),
                 prefix: PrefixState | None = None) -> None:
        """``prefix``: with prefix caching, the cache state behind the requests (a live
        engine's, borrowed: :mod:`duetime.engine.prefix_state`)."""
        self.config = config
        self.prefix = prefix
        self.model = model
        self.time = float(time)
        self.running_table = running if isinstance(running, RequestTable) else (
            RequestTable.of(running))
        self.waiting_table = waiting if isinstance(waiting, RequestTable) else (
            RequestTable.of(waiting))
        self._cache: dict[str, Any] = {}

    @property
    def running(self) -> tuple[ResidentRequest, ...]:
        """Running requests in scheduler order."""
        got = self._cache.get("running")
        if got is None:
            got = self._cache["running"] = self.running_table.requests()
        return got

    @property
    def waiting(self) -> tuple[ResidentRequest, ...]:
        """Waiting requests in queue order."""
        got = self._cache.get("waiting")
        if got is None:
            got = self._cache["waiting"] = self.waiting_table.requests()
        return got

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Snapshot:
        """Validate a snapshot in the public JSON form; raise :class:`SnapshotError`."""
        if not isinstance(d, Mapping):
            raise SnapshotError("snapshot: must be a JSON object")
        try:
            s = _SnapshotIn.model_validate(d)
        except ValidationError as e:
            raise SnapshotError(_format_error(e)) from None
        if s.version not in SNAPSHOT_VERSIONS:
            raise SnapshotError(f"snapshot.version: unsupported version {s.version}; "
                                f"this duetime reads versions 1, 2 and 3")
        if s.version < 3 and (s.config.max_loras or s.config.enable_lora):
            raise SnapshotError("snapshot.config.max_loras: LoRA adapters need a snapshot of "
                                "version 3")
        try:
            model = model_from_dict(s.batch_time.model_dump(), "snapshot.batch_time")
            config = SchedulerConfig(**s.config.limits())
        except ValueError as e:
            raise SnapshotError(str(e)) from None

        def convert(items: list[_RequestIn], where: str) -> RequestTable:
            for i, r in enumerate(items):
                status = r.get("status")
                if status is not None and status != where:
                    raise SnapshotError(f"snapshot.{where}[{i}].status: {status!r} request "
                                        f"listed under {where!r}")
                if "lora" in r and s.version < 3:
                    raise SnapshotError(f"snapshot.{where}[{i}].lora: LoRA adapters need a "
                                        "snapshot of version 3")
            lora = [r.get("lora", 0) for r in items] if s.version >= 3 else None
            return RequestTable([str(r["id"]) for r in items],
                                [r["prompt_tokens"] for r in items],
                                [r.get("computed_tokens", 0) for r in items],
                                [r.get("output_tokens", 0) for r in items],
                                [r["predicted_output_tokens"] for r in items],
                                [r.get("arrival", 0.0) for r in items],
                                lora if lora and any(lora) else None)

        running, waiting = convert(s.running, "running"), convert(s.waiting, "waiting")
        prefix = _prefix_state_in(s, config, running, waiting)
        snap = cls(config, model, time=s.time, running=running, waiting=waiting, prefix=prefix)
        snap.check()
        return snap

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        """Read a snapshot JSON file."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise SnapshotError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data)

    def check(self) -> None:
        """Cross-field consistency; raise :class:`SnapshotError` naming the field."""
        cfg = self.config

        def first(where: str, mask: np.ndarray, field: str, why: Callable[[int], str]) -> None:
            bad = np.flatnonzero(mask)
            if bad.size:
                i = int(bad[0])
                raise SnapshotError(f"snapshot.{where}[{i}]{field}: {why(i)}")

        run, wait = self.running_table, self.waiting_table
        for where, tab in (("running", run), ("waiting", wait)):
            total = tab.prompt + tab.output
            first(where, tab.prompt < 1, ".prompt_tokens",
                  lambda i, t=tab: f"must be >= 1, got {t.prompt[i]}")
            first(where, tab.output < 0, ".output_tokens",
                  lambda i, t=tab: f"must be >= 0, got {t.output[i]}")
            first(where, tab.predicted < 1, ".predicted_output_tokens",
                  lambda i, t=tab: f"must be >= 1, got {t.predicted[i]}")
            first(where, tab.computed < 0, ".computed_tokens",
                  lambda i, t=tab: f"must be >= 0, got {t.computed[i]}")
            first(where, total >= cfg.max_model_len, "",
                  lambda i, tot=total: f"prompt_tokens + output_tokens = {tot[i]} reaches "
                  f"max_model_len {cfg.max_model_len} (such a request has finished)")
            if where == "running" and cfg.async_scheduling:
                first(where, tab.computed > total, ".computed_tokens",
                      lambda i, t=tab, tot=total: f"{t.computed[i]} must be at most "
                      f"prompt_tokens + output_tokens = {tot[i]} (equal while its next token "
                      "is in flight, with asynchronous scheduling)")
            elif where == "running":
                first(where, tab.computed >= total, ".computed_tokens",
                      lambda i, t=tab, tot=total: f"{t.computed[i]} must be below prompt_tokens "
                      f"+ output_tokens = {tot[i]} (the last token is computed in the next step)")
            else:
                first(where, tab.computed != 0, ".computed_tokens",
                      lambda i, t=tab: "a waiting request holds no KV cache (recompute "
                      "preemption; its prefix-cache hits count when it is admitted), so it "
                      f"must be 0, got {t.computed[i]}")
        ids = run.ids + wait.ids
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            for j, rid in enumerate(ids):
                if rid in seen:
                    where, i = ("running", j) if j < len(run) else ("waiting", j - len(run))
                    raise SnapshotError(f"snapshot.{where}[{i}].id: duplicate request id "
                                        f"{rid!r}")
                seen.add(rid)
        if len(run) > cfg.max_num_seqs:
            raise SnapshotError(f"snapshot.running: {len(run)} running requests exceed "
                                f"config.max_num_seqs = {cfg.max_num_seqs}")
        held = held_blocks(run.computed, cfg.block_size)
        if held > cfg.usable_blocks and self.prefix is None:  # (shared blocks count once)
            raise SnapshotError(f"snapshot.running: the running requests hold {held} KV blocks "
                                f"(ceil(computed_tokens / block_size) each) but the instance "
                                f"has {cfg.usable_blocks} (config.num_gpu_blocks = "
                                f"{cfg.num_gpu_blocks}, one is the null block)")

    def live_adapters(self) -> frozenset[int]:
        """The LoRA adapters of the requests scheduled and not finished: running ones, and
        waiting ones with output (preempted) — what vLLM 0.32's ``vllm:lora_requests_info``
        lists, by id."""
        run, wait = self.running_table, self.waiting_table
        ids: set[int] = set()
        if run.lora is not None:
            ids.update(run.lora[run.lora > 0].tolist())
        if wait.lora is not None:
            ids.update(wait.lora[(wait.lora > 0) & (wait.output > 0)].tolist())
        return frozenset(ids)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache the running requests hold (vLLM's
        ``kv_cache_usage_perc``)."""
        return held_blocks(self.running_table.computed, self.config.block_size) / (
            self.config.usable_blocks)

    def shifted(self, dt: float) -> Snapshot:
        """The same state on another clock: ``time`` and every arrival moved by ``dt``
        seconds (e.g. an instance's monotonic clock onto a router's)."""
        def shift(t: RequestTable) -> RequestTable:
            return RequestTable(t.ids, t.prompt, t.computed, t.output, t.predicted,
                                t.arrival + dt, t.lora)
        return Snapshot(self.config, self.model, time=self.time + dt,
                        running=shift(self.running_table), waiting=shift(self.waiting_table),
                        prefix=self.prefix)

    def at(self, time: float) -> Snapshot:
        """The same requests dated ``time`` (a forecast then counts from ``time``, as if nothing
        progressed since this snapshot)."""
        return Snapshot(self.config, self.model, time=time, running=self.running_table,
                        waiting=self.waiting_table, prefix=self.prefix)

    def to_dict(self, version: int | None = None) -> dict[str, Any]:
        """The public JSON form: version 1, or version 2 with the prefix cache (block keys as
        integers; see :mod:`duetime.engine.prefix_json`), by default when caching is on.
        ``version=1`` leaves the cache out of a caching snapshot (it is large: the free cached
        blocks of the whole cache): ``enable_prefix_caching`` then says false and
        ``prefix_cache_omitted`` true, and a forecast from it prices no cache hit. With LoRA
        (``max_loras``, or a request on an adapter) it is version 3, which has everything
        version 2 has (the cache with caching on) and the adapters."""
        config = self.config.to_dict()
        lora = bool(self.config.max_loras) or self.running_table.has_lora or (
            self.waiting_table.has_lora)
        caching = self.config.enable_prefix_caching and self.prefix is not None
        if caching and version == 1:
            config["enable_prefix_caching"] = False
        out = {"version": SNAPSHOT_VERSION, "time": self.time, "config": config,
               "batch_time": self.model.to_dict(),
               "running": [r.to_dict() for r in self.running],
               "waiting": [r.to_dict() for r in self.waiting]}
        if caching and version == 1:
            out["prefix_cache_omitted"] = True
        elif caching:
            try:
                keys, ids, cache = export_state(self.prefix, len(self.running_table))
            except ValueError as e:
                raise SnapshotError(str(e)) from None
            out["version"] = 2
            for r, k in zip(out["running"] + out["waiting"], keys, strict=True):
                r["block_hashes"] = k
            for r, b in zip(out["running"], ids, strict=True):
                r["block_ids"] = b
            out["prefix_cache"] = cache
        if lora:
            if version in (1, 2):
                raise SnapshotError(f"snapshot: version {version} cannot carry LoRA adapters "
                                    "(version 3 does)")
            out["version"] = 3
        return out

    def __repr__(self) -> str:
        return (f"Snapshot(time={self.time}, model={self.model.name}, "
                f"running={len(self.running_table)}, waiting={len(self.waiting_table)})")
