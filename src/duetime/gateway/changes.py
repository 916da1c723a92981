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
        if o.emulate != i.emulate or o.discover != i.discover:
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


# -- DNS groups ---------------------------------------------------------------------------------

def member_name(group: str, address: str) -> str:
    """A DNS group's member at ``address``: ``group@address``."""
    return f"{group}@{address}"


def group_members(group: Instance, addresses: list[str]) -> list[Instance]:
    """A DNS group's members: the group's instance at each address (its URL's host replaced
    by the address)."""
    assert group.url is not None
    u = urlsplit(group.url)
    port = f":{u.port}" if u.port is not None else ""
    out = []
    for a in sorted(addresses):
        host = f"[{a}]" if ":" in a else a
        url = urlunsplit((u.scheme, f"{host}{port}", u.path, u.query, u.fragment))
        out.append(replace(group, name=member_name(group.name, a), url=url, discover="none"))
    return out


def members_of(pool: Pool, addresses: dict[str, list[str]]) -> list[Instance]:
    """The pool's instances with each DNS group replaced by its members at the addresses
    last looked up (``addresses``: by group name; a group not looked up yet has none)."""
    out: list[Instance] = []
    for i in pool.instances:
        if i.discover == "dns":
            out += group_members(i, addresses.get(i.name, []))
        else:
            out.append(i)
    return out


def groups(pool: Pool) -> list[Instance]:
    """The pool's DNS groups."""
    return [i for i in pool.instances if i.discover == "dns"]
