"""What changes when the pool's config changes while serving: which of its fields may change
without a restart, and the instances a new config adds, removes and changes.

The instances are the point of a live change (docs/gateway.md, "Membership"): added ones join,
removed ones drain, changed ones (URL, profile, timing, limits, prices, overhead, state
sources) are reconfigured in place, and the quality table follows the models (a new model
brings its accuracies). The rest of the config builds parts that live as long as the process
(the shared store, keys, limits, the tokenizer, the policy and its pollers, admission): a new
file that changes any of them is refused whole, naming them, and the running pool is kept —
a half-applied config would be neither the old nor the new one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit, urlunsplit

from duetime.gateway.config import ConfigError, Instance, Pool

# Pool fields that may change while serving (the others need a restart)
LIVE_FIELDS = frozenset({"source", "instances", "quality", "default_task", "discovery"})


@dataclass
class InstanceChanges:
    """The instances to join, drain and reconfigure (by name) to get from one list to
    another."""

    added: list[Instance] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[Instance] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def describe(self) -> str:
        parts = [f"{what} {', '.join(names)}" for what, names in (
            ("added", [i.name for i in self.added]), ("removed", self.removed),
            ("changed", [i.name for i in self.changed])) if names]
        return "; ".join(parts) or "no instance changed"


def check_live(old: Pool, new: Pool) -> None:
    """ConfigError unless ``new`` differs from ``old`` only in what may change while serving
    (:data:`LIVE_FIELDS`), and its instances keep their model and emulator under their
    names."""
    fixed = [f.name for f in dataclasses.fields(Pool)
             if f.name not in LIVE_FIELDS and getattr(old, f.name) != getattr(new, f.name)]
    if fixed:
        raise ConfigError(f"{new.source}: {', '.join(_field_name(f) for f in fixed)} "
                          "changed: that needs a restart (only the instances and the quality "
                          "table change while serving); the running pool is kept")
    was = {i.name: i for i in old.instances}
    for i in new.instances:
        o = was.get(i.name)
        if o is None:
            continue
        if o.model != i.model:
            raise ConfigError(f"{new.source}: instance {i.name!r}: its model changed ({o.model} "
                              f"-> {i.model}); give the new one another name; the running "
                              "pool is kept")
        if (o.emulate, o.discover, o.inference_pool) != (i.emulate, i.discover,
                                                            i.inference_pool):
            what = "emulate" if o.emulate != i.emulate else "discover"
            raise ConfigError(f"{new.source}: instance {i.name!r}: its {what} setting changed; "
                              "give the new one another name; the running pool is kept")


def _field_name(f: str) -> str:
    return {"lam": "lambda", "target": "ttft_target", "policy_params": "policy"}.get(f, f)


def instance_changes(old: list[Instance], new: list[Instance]) -> InstanceChanges:
    """From the instances ``old`` (by name) to ``new``."""
    was = {i.name: i for i in old}
    now = {i.name: i for i in new}
    return InstanceChanges(
        added=[i for i in new if i.name not in was],
        removed=[n for n in was if n not in now],
        changed=[i for i in new if i.name in was and was[i.name] != i])


def moved(old: Instance, new: Instance) -> bool:
    """Whether the instance is somewhere else now (its health must be checked again)."""
    return old.url != new.url


# -- groups: DNS names and Kubernetes InferencePools ---------------------------------------------

# a group's member as discovered: (its name's suffix, its host, its port: None for the group
# url's); a DNS group's are (address, address, None), an InferencePool's (pod, pod IP, port)
Endpoint = tuple[str, str, "int | None"]


def member_name(group: str, suffix: str) -> str:
    """A group's member: ``group@suffix`` (an address, or a pod's name)."""
    return f"{group}@{suffix}"


def group_members(group: Instance, endpoints: list[Endpoint]) -> list[Instance]:
    """A group's members: the group's instance at each endpoint (its URL's host and port
    replaced; a group without a URL, an InferencePool's, is plain http)."""
    u = urlsplit(group.url or "http://pod")
    out = []
    for suffix, address, port in sorted(endpoints):
        host = f"[{address}]" if ":" in address else address
        p = port if port is not None else u.port
        url = urlunsplit((u.scheme, host + (f":{p}" if p is not None else ""), u.path,
                          u.query, u.fragment))
        out.append(replace(group, name=member_name(group.name, suffix), url=url,
                           discover="none", inference_pool=None))
    return out


def members_of(pool: Pool, endpoints: dict[str, list[Endpoint]]) -> list[Instance]:
    """The pool's instances with each group replaced by its members at the endpoints last
    discovered (``endpoints``: by group name; a group not discovered yet has none)."""
    out: list[Instance] = []
    for i in pool.instances:
        if i.discover != "none":
            out += group_members(i, endpoints.get(i.name, []))
        else:
            out.append(i)
    return out


def groups(pool: Pool, kind: str = "dns") -> list[Instance]:
    """The pool's groups of one kind (``dns`` or ``kubernetes``)."""
    return [i for i in pool.instances if i.discover == kind]
