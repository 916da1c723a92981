"""Snapshots: one instance's state at one moment (``shared/reference/snapshot-format.md``).

``Snapshot.from_dict`` validates untrusted JSON (errors name the field and the reason);
the constructor takes already-checked parts from trusted producers (the gateway, the simulator).
A snapshot is immutable, so what a forecast derives from it is computed once and cached on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duetime.engine.batch_time import BatchTimeModel, model_from_dict
from duetime.engine.config import SchedulerConfig

SNAPSHOT_VERSION = 1


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

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "prompt_tokens": self.prompt_tokens,
                "computed_tokens": self.computed_tokens, "output_tokens": self.output_tokens,
                "predicted_output_tokens": self.predicted_output_tokens, "arrival": self.arrival}


# -- JSON schema (pydantic) ---------------------------------------------------------------------

class _ConfigIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int = Field(32768, ge=2)
    block_size: int = Field(16, ge=1)
    num_gpu_blocks: int = Field(100_000, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0)


class _RequestIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | int
    status: Literal["running", "waiting"] | None = None
    prompt_tokens: int = Field(ge=1, strict=True)
    computed_tokens: int = Field(0, ge=0, strict=True)
    output_tokens: int = Field(0, ge=0, strict=True)
    predicted_output_tokens: int = Field(ge=1, strict=True)
    arrival: float = 0.0


class _BatchTimeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
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


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = "snapshot"
    for part in first["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else f".{part}"
    more = len(err.errors()) - 1
    tail = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
    return f"{loc}: {first['msg']}{tail}"


# -- the snapshot -------------------------------------------------------------------------------

class Snapshot:
    """An instance's scheduler config, batch-time model and resident requests at ``time``."""

    __slots__ = ("__weakref__", "_cache", "config", "model", "running", "time", "waiting")

    def __init__(self, config: SchedulerConfig, model: BatchTimeModel, *, time: float = 0.0,
                 running: Sequence[ResidentRequest] = (),
                 waiting: Sequence[ResidentRequest] = ()) -> None:
        self.config = config
        self.model = model
        self.time = float(time)
        self.running = tuple(running)
        self.waiting = tuple(waiting)
        self._cache: dict[str, Any] = {}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Snapshot:
        """Validate a snapshot in the public JSON form; raise :class:`SnapshotError`."""
        if not isinstance(d, Mapping):
            raise SnapshotError("snapshot: must be a JSON object")
        try:
            s = _SnapshotIn.model_validate(d)
        except ValidationError as e:
            raise SnapshotError(_format_error(e)) from None
        if s.version != SNAPSHOT_VERSION:
            raise SnapshotError(f"snapshot.version: unsupported version {s.version}; "
                                f"this duetime reads version {SNAPSHOT_VERSION}")
        try:
            model = model_from_dict(s.batch_time.model_dump(), "snapshot.batch_time")
            config = SchedulerConfig(**s.config.model_dump())
        except ValueError as e:
            raise SnapshotError(str(e)) from None

        def convert(items: list[_RequestIn], where: str) -> list[ResidentRequest]:
            out = []
            for i, r in enumerate(items):
                if r.status is not None and r.status != where:
                    raise SnapshotError(f"snapshot.{where}[{i}].status: {r.status!r} request "
                                        f"listed under {where!r}")
                out.append(ResidentRequest(str(r.id), r.prompt_tokens, r.computed_tokens,
                                           r.output_tokens, r.predicted_output_tokens,
                                           r.arrival))
            return out

        snap = cls(config, model, time=s.time, running=convert(s.running, "running"),
                   waiting=convert(s.waiting, "waiting"))
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
        seen: set[str] = set()
        held = 0
        for where, items in (("running", self.running), ("waiting", self.waiting)):
            for i, r in enumerate(items):
                f = f"snapshot.{where}[{i}]"
                if r.id in seen:
                    raise SnapshotError(f"{f}.id: duplicate request id {r.id!r}")
                seen.add(r.id)
                total = r.prompt_tokens + r.output_tokens
                if total >= cfg.max_model_len:
                    raise SnapshotError(
                        f"{f}: prompt_tokens + output_tokens = {total} reaches max_model_len "
                        f"{cfg.max_model_len} (such a request has finished)")
                if where == "running":
                    if r.computed_tokens >= total:
                        raise SnapshotError(
                            f"{f}.computed_tokens: {r.computed_tokens} must be below "
                            f"prompt_tokens + output_tokens = {total} (the last token is "
                            f"computed in the next step)")
                    held += -(-r.computed_tokens // cfg.block_size)
                elif r.computed_tokens != 0:
                    raise SnapshotError(
                        f"{f}.computed_tokens: a waiting request holds no KV cache (recompute "
                        f"preemption, no prefix caching), so it must be 0, got "
                        f"{r.computed_tokens}")
        if len(self.running) > cfg.max_num_seqs:
            raise SnapshotError(f"snapshot.running: {len(self.running)} running requests exceed "
                                f"config.max_num_seqs = {cfg.max_num_seqs}")
        if held > cfg.num_gpu_blocks:
            raise SnapshotError(f"snapshot.running: the running requests hold {held} KV blocks "
                                f"(ceil(computed_tokens / block_size) each) but "
                                f"config.num_gpu_blocks = {cfg.num_gpu_blocks}")

    def to_dict(self) -> dict[str, Any]:
        return {"version": SNAPSHOT_VERSION, "time": self.time, "config": self.config.to_dict(),
                "batch_time": self.model.to_dict(),
                "running": [r.to_dict() for r in self.running],
                "waiting": [r.to_dict() for r in self.waiting]}

    def __repr__(self) -> str:
        return (f"Snapshot(time={self.time}, model={self.model.name}, "
                f"running={len(self.running)}, waiting={len(self.waiting)})")
