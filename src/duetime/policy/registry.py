"""The policy registry: every routing policy declares its name, its typed parameters (with
defaults) and what it consumes; the gateway, the simulator and the command line read the
declarations instead of lists of names (in the style of llm-d's scheduler plugins, which
register a type with its parameters).

What a policy may consume (:data:`INPUTS`): the gateway keeps fresh only what its policy
declares (it polls ``/snapshot`` and steps the shadow replicas for ``snapshot``, scrapes
``/metrics`` for ``load``, asks the predictors for ``quality``, ``success`` or
``output_length``) and fills only the declared fields of the
:class:`~duetime.policy.base.RoutingRequest`: a policy that reads what it did not declare
fails at once instead of silently reading stale or missing state. ``prefix_cache`` is carried
by the views (a ``prefix_index`` attribute) and the request (``prompt_hashes``); a policy
given neither matches no prefix and falls back to its load rule.

Adding a policy: write its class (a :class:`~duetime.policy.base.Policy` with ``name``,
``summary``, ``params`` and ``consumes``) in a module of this package, and add one line
``register(MyPolicy)`` to :mod:`duetime.policy.catalog`. ``duetime policies``, ``duetime
simulate --policy`` and the pool config's ``policy:`` then know it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duetime.policy.base import Policy

SNAPSHOT = "snapshot"
LOAD = "load"
STATS = "stats"
QUALITY = "quality"
SUCCESS = "success"
OUTPUT_LENGTH = "output_length"
PREFIX = "prefix_cache"
SESSIONS = "session_bindings"
LORA = "lora_adapters"

INPUTS: dict[str, str] = {
    SNAPSHOT: "each instance's resident requests (a snapshot: published by the instance, or "
              "the gateway's shadow replica)",
    LOAD: "each instance's load gauges (running, waiting, KV use: scraped from vLLM's "
          "/metrics, else read from the snapshot)",
    STATS: "each instance's time-averaged observations (arrival rate, mean lengths, latency)",
    QUALITY: "the request's predicted quality per candidate model",
    SUCCESS: "the request's predicted probability of a correct answer per candidate model",
    OUTPUT_LENGTH: "the request's predicted output tokens per candidate model",
    PREFIX: "each instance's prefix-cache index: precise (the instance's own cache, as KV "
            "events give it) or estimated (inferred from the router's own routing decisions)",
    SESSIONS: "session bindings (session -> instance) it reads and writes: its own, unless "
              "the caller provides a shared mapping (the gateway's replicas share theirs)",
    LORA: "each instance's LoRA adapters with live requests and its max_loras (vLLM's "
          "vllm:lora_requests_info)",
}

# what is read from the instances (the rest is about the request): a policy that consumes none
# of these never looks at an instance's state (the simulator then steps an instance only when
# it is given a request)
INSTANCE_INPUTS = frozenset({SNAPSHOT, LOAD, STATS, PREFIX, LORA})


class PolicyError(ValueError):
    """An unknown policy or a bad parameter; the message names it and the reason."""


@dataclass(frozen=True, slots=True)
class Param:
    """One typed parameter of a policy: its public ``name`` (config key, ``--policy-param``),
    the constructor argument it feeds, its default, bounds and a line of help."""

    name: str
    arg: str
    kind: type
    default: Any
    help: str
    min: float | None = None
    min_open: bool = False

    def parse(self, value: Any, where: str) -> Any:
        """The value checked (strings, from a command line, are read as numbers)."""
        if value is None and self.default is None:
            return None
        given = value
        if isinstance(value, str):
            try:
                value = int(value) if self.kind is int else float(value)
            except ValueError:
                raise PolicyError(f"{where}: must be {self._what()}, got {value!r}") from None
        ok_type = (isinstance(value, int) if self.kind is int
                   else isinstance(value, int | float))
        if isinstance(value, bool) or not ok_type or (
                self.kind is float and not math.isfinite(value)):
            raise PolicyError(f"{where}: must be {self._what()}, got {value!r}")
        if self.min is not None and (value < self.min or (self.min_open and value == self.min)):
            raise PolicyError(f"{where}: must be {self._what()}, got {given!r}")
        return self.kind(value)

    def _what(self) -> str:
        kind = "an integer" if self.kind is int else "a number"
        if self.min is None:
            return kind
        return f"{kind} {'>' if self.min_open else '>='} {self.min:g}"

    def describe(self) -> str:
        default = "fitted" if self.default is None else f"{self.default:g}"
        return f"{self.name} (default {default}): {self.help}"


LAMBDA = Param("lambda", "lam", float, 5.0e-4, "weight of the predicted cost (micro-dollars) "
               "in the utility U = quality - lambda x cost", min=0.0)
SEED = Param("seed", "seed", int, 0, "seed of the random tie-breaks")


_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Make a policy class known by its ``name`` (one line per policy in :mod:`catalog`)."""
    name = cls.name
    if not name or name in _REGISTRY:
        raise ValueError(f"policy name {name!r} is empty or already registered")
    unknown = set(cls.consumes) - set(INPUTS)
    if unknown:
        raise ValueError(f"policy {name!r} consumes unknown inputs {sorted(unknown)}")
    names = [p.name for p in cls.params]
    if len(set(names)) != len(names):
        raise ValueError(f"policy {name!r} declares a parameter twice")
    _REGISTRY[name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    """The registered policies, in registration order."""
    return tuple(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; one of {', '.join(_REGISTRY)}") from None


def consumes(name: str) -> frozenset[str]:
    """What the policy ``name`` reads (see :data:`INPUTS`)."""
    return frozenset(policy_class(name).consumes)


def check_params(name: str, params: Mapping[str, Any] | None, where: str = "policy") -> dict:
    """``params`` checked against the policy's declarations (an unknown name is an error);
    returns them by public name, parsed."""
    cls = policy_class(name)
    by_name = {p.name: p for p in cls.params}
    out = {}
    for key, value in (params or {}).items():
        p = by_name.get(key)
        if p is None:
            known = ", ".join(by_name) or "none"
            raise PolicyError(f"{where}.{key}: policy {name!r} has no parameter {key!r} "
                              f"(its parameters: {known})")
        out[key] = p.parse(value, f"{where}.{key}")
    return out


def make_policy(name: str, params: Mapping[str, Any] | None = None, *,
                defaults: Mapping[str, Any] | None = None, where: str = "policy",
                bindings: MutableMapping[str, str] | None = None) -> Policy:
    """A policy by name. ``params`` must be the policy's own (checked strictly);
    ``defaults`` are shared settings (a pool's ``lambda``, ``seed``, ...) that apply to the
    policies that declare them and are ignored by the others. ``bindings``: session bindings
    the caller provides, given to a policy that consumes :data:`SESSIONS` (None: it keeps its
    own)."""
    cls = policy_class(name)
    given = check_params(name, params, where)
    kwargs = {}
    for p in cls.params:
        if p.name in given:
            kwargs[p.arg] = given[p.name]
        elif defaults is not None and p.name in defaults:
            kwargs[p.arg] = p.parse(defaults[p.name], f"{where}.{p.name}")
        else:
            kwargs[p.arg] = p.default
    if bindings is not None and SESSIONS in cls.consumes:
        kwargs["bindings"] = bindings
    return cls(**kwargs)


def describe(names: Iterable[str] | None = None) -> str:
    """The registry as text: each policy's summary, parameters and inputs."""
    lines = []
    for name in names or _REGISTRY:
        cls = _REGISTRY[name]
        lines.append(f"{name}: {cls.summary}")
        for p in cls.params:
            lines.append(f"    {p.describe()}")
        lines.append(f"    consumes: {', '.join(sorted(cls.consumes)) or 'nothing'}")
    return "\n".join(lines)
