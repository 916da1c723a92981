"""The autoscaler registry: each autoscaler declares its name, a summary and its typed
parameters (the routing policies' :class:`~duetime.policy.registry.Param`), and is made by
name with its parameters checked, as routing policies are.

Adding one: write its class (``name``, ``summary``, ``params``, ``desired(status)``) in a
module of this package and add it to :data:`_CLASSES`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from duetime.autoscale.forecast import ForecastAutoscaler
from duetime.autoscale.queue_threshold import QueueThreshold
from duetime.autoscale.saturation import LlmdSaturation
from duetime.autoscale.status import Autoscaler
from duetime.autoscale.throughput import ThroughputPlanner
from duetime.autoscale.timetable import Static
from duetime.policy.registry import PolicyError

_CLASSES = (Static, QueueThreshold, LlmdSaturation, ThroughputPlanner, ForecastAutoscaler)
_REGISTRY: dict[str, Any] = {cls.name: cls for cls in _CLASSES}


def autoscaler_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def autoscaler_class(name: str) -> Any:
    """The registered class of ``name`` (its ``summary`` and ``params``)."""
    if name not in _REGISTRY:
        raise PolicyError(f"unknown autoscaler {name!r}; one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def make_autoscaler(name: str, params: Mapping[str, Any] | None = None,
                    where: str = "autoscaler", *,
                    capacity: Mapping[str, float] | None = None,
                    table: Sequence[tuple[float, Mapping[str, int]]] = ()) -> Autoscaler:
    """An autoscaler by name, its ``params`` (by public name) checked against its
    declarations; :class:`~duetime.policy.registry.PolicyError` naming what is wrong.
    ``capacity``: one replica's requests/s at the SLO per model, for those that need it;
    ``table``: the planner's pools at rate levels, for those that take it (both are left
    out for those that do not)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise PolicyError(f"unknown autoscaler {name!r}; one of {', '.join(_REGISTRY)}")
    by_name = {p.name: p for p in cls.params}
    kwargs = {}
    for key, value in (params or {}).items():
        p = by_name.get(key)
        if p is None:
            raise PolicyError(f"{where}.{key}: autoscaler {name!r} has no parameter {key!r} "
                              f"(its parameters: {', '.join(by_name) or 'none'})")
        kwargs[p.arg] = p.parse(value, f"{where}.{key}")
    fields = getattr(cls, "__dataclass_fields__", {})
    if table and "table" in fields:
        kwargs["table"] = tuple(table)
    if getattr(cls, "needs_capacity", False) and not capacity:
        raise PolicyError(f"{where}: autoscaler {name!r} needs each model's capacity (one "
                          "replica's requests/s at the SLO, from a profile sweep)")
    if capacity and "capacity" in fields:
        kwargs["capacity"] = dict(capacity)
    return cls(**kwargs)


def describe_autoscalers(names: Iterable[str] | None = None) -> str:
    lines = []
    for name in names or _REGISTRY:
        cls = _REGISTRY[name]
        lines.append(f"{name}: {cls.summary}")
        lines += [f"    {p.describe()}" for p in cls.params]
    return "\n".join(lines)
