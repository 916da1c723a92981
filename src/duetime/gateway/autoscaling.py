"""The pool config's ``autoscale`` section: which autoscaler (:mod:`duetime.autoscale`) the
gateway runs to say how many replicas each model should have (the live desired-replica
signal: :mod:`duetime.gateway.observe.replicas`), how often, and what it knows of the models
(one replica's rate at the SLO, or the planner's table). The gateway scales nothing itself:
an actuator (KEDA, an operator, a script) reads the signal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from duetime.autoscale import make_autoscaler
from duetime.autoscale.status import Autoscaler
from duetime.policy.registry import PolicyError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TableRow(_Strict):
    rate: float = Field(ge=0)                   # total requests/s
    replicas: dict[str, int]                    # model -> replicas the planner found


class AutoscaleSpec(_Strict):
    autoscaler: str = "duetime"
    params: dict[str, Any] = {}
    interval_s: float = Field(15.0, gt=0, le=3600)
    scale_up_delay_s: float = Field(60.0, ge=0, le=3600)
    min_replicas: int = Field(1, ge=1, le=1000)  # (no scale to zero: a model keeps one)
    max_replicas: int = Field(8, ge=1, le=1000)
    capacity: dict[str, float] = {}             # model -> one replica's requests/s at the SLO
    # the planner's pools by total rate: rows, or a YAML file of rows (`duetime plan
    # --diurnal` writes autoscale-table.yaml)
    table: list[TableRow] | str | None = None


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """The resolved ``autoscale`` section (models and autoscaler checked)."""

    autoscaler: str = "duetime"
    params: Mapping[str, Any] = field(default_factory=dict)
    interval_s: float = 15.0
    scale_up_delay_s: float = 60.0
    min_replicas: int = 1
    max_replicas: int = 8
    capacity: Mapping[str, float] = field(default_factory=dict)
    table: tuple[tuple[float, Mapping[str, int]], ...] = ()

    def make(self) -> Autoscaler:
        """A fresh autoscaler (it keeps state across ticks)."""
        return make_autoscaler(self.autoscaler, self.params, "autoscale.params",
                               capacity=self.capacity or None, table=self.table)

    def clamp(self, n: int) -> int:
        return min(max(int(n), self.min_replicas), self.max_replicas)


def resolve_autoscale(spec: AutoscaleSpec, models: list[str], base: Path,
                      fail: Callable[[str, str], Exception]) -> AutoscaleConfig:
    """The section checked against the pool's ``models`` (``base``: where a table file's
    relative path starts); ``fail(where, why)`` makes the error to raise."""
    if spec.min_replicas > spec.max_replicas:
        raise fail("autoscale", f"min_replicas {spec.min_replicas} > max_replicas "
                   f"{spec.max_replicas}")
    for m, c in spec.capacity.items():
        if m not in models:
            raise fail(f"autoscale.capacity.{m}", f"unknown model; the pool's: {', '.join(models)}")
        if not c > 0:
            raise fail(f"autoscale.capacity.{m}", f"must be > 0 requests/s, got {c}")
    rows = _table(spec.table, base, fail)
    for k, row in enumerate(rows):
        if unknown := sorted(set(row.replicas) - set(models)):
            raise fail(f"autoscale.table[{k}]", f"unknown models {unknown}; the pool's: "
                       f"{', '.join(models)}")
    table = tuple((r.rate, dict(r.replicas)) for r in sorted(rows, key=lambda r: r.rate))
    out = AutoscaleConfig(spec.autoscaler, dict(spec.params), spec.interval_s,
                          spec.scale_up_delay_s, spec.min_replicas, spec.max_replicas,
                          dict(spec.capacity), table)
    try:
        out.make()
    except PolicyError as e:  # ("autoscale.params.KEY: why", or no place named)
        where, _, why = str(e).partition(": ")
        if not where.startswith("autoscale.params"):
            where, why = "autoscale.autoscaler", str(e)
        elif where == "autoscale.params":  # (the one message about no parameter)
            where = "autoscale.capacity"
        raise fail(where, why) from None
    return out


def _table(table: list[TableRow] | str | None, base: Path,
           fail: Callable[[str, str], Exception]) -> list[TableRow]:
    if table is None:
        return []
    if not isinstance(table, str):
        return table
    path = base / table
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise fail("autoscale.table", f"cannot read {path}: {e}") from None
    if not isinstance(data, list):
        raise fail("autoscale.table", f"{path}: want a list of rows (rate, replicas)")
    try:
        return [TableRow.model_validate(row) for row in data]
    except ValueError as e:
        raise fail("autoscale.table", f"{path}: {str(e).splitlines()[0]}") from None
