"""API keys as the pool config names them: the ``auth:`` block, the files of hashed keys it
points to, and how a key is made and stored (the checks themselves are the intake's:
:mod:`duetime.gateway.intake.auth`).

Keys are stored as the SHA-256 of the key, never the key: a key is 32 random bytes
(:func:`new_key`), so a fast hash is as safe as a slow one (no dictionary to try, 2^256
guesses), and it lets a request be checked with one dictionary look-up instead of a slow hash
per request (tens of ms of CPU each with bcrypt or argon2, and a lever for anyone who can send
requests). A key someone chose by hand would need a slow hash; ``duetime keys new`` makes them.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

KEY_PREFIX = "dt-"


def new_key() -> str:
    """A new API key: ``dt-`` and 32 random bytes (URL-safe base64)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What a keys file stores for ``key``: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


class AuthSpec(BaseModel):
    """``auth: {keys_file, admin_keys_file}``: files of hashed keys (paths relative to the pool
    config). ``keys_file``: the clients' keys (the completion routes need one); ``admin_keys_file``:
    the keys of the admin routes (``/metrics``, ``/duetime/*``)."""

    model_config = ConfigDict(extra="forbid")
    keys_file: str | None = None
    admin_keys_file: str | None = None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("must be the key's SHA-256 as 64 hex digits (`duetime keys new` "
                             "prints it)")
        return v


class AdminKeyEntry(_Entry):
    """One admin key: its name and hash."""


class KeyEntry(_Entry):
    """One client key: its name, hash, the models it may call (model names or aliases; all if
    absent) and its limits per minute (none if absent)."""

    models: list[str] | None = Field(None, min_length=1)
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A client key as the gateway knows it (never the key itself)."""

    name: str
    digest: str
    models: frozenset[str] | None  # None: every model and alias
    rpm: int | None
    tpm: int | None

    @property
    def short(self) -> str:
        """A hash prefix, enough to tell keys apart in a log."""
        return self.digest[:8]


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The resolved ``auth:``: client keys and admin keys by digest (None: not configured)."""

    keys: Mapping[str, ApiKey] | None = None
    admin: Mapping[str, str] | None = None  # digest -> name
    aliases: frozenset[str] = frozenset()


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "(top level)"


def _problem(path: Path, i: int, err: Any) -> str:
    """One pydantic error of entry ``i`` as ``FILE: [i].FIELD: reason``."""
    where = f"[{i}]" + (f".{_where(err['loc'])}" if err["loc"] else "")
    why = "unknown field" if err["type"] == "extra_forbidden" else \
        err["msg"].removeprefix("Value error, ")
    return f"{path}: {where}: {why}"


def _read_entries(path: Path, model: type[_Entry]) -> list[Any]:
    """The entries of a keys file (a YAML or JSON list); ValueError naming the file, the entry
    and the reason."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML or JSON ({' '.join(str(e).split())})") from None
    if data is None:
        data = []
    if not isinstance(data, list):
        raise ValueError(f"{path}: must be a list of keys (- name: ..., sha256: ...)")
    out, names, digests = [], set(), set()
    for i, raw in enumerate(data):
        try:
            e = model.model_validate(raw)
        except ValidationError as err:
            raise ValueError("; ".join(_problem(path, i, x) for x in err.errors())) from None
        if e.name in names:
            raise ValueError(f"{path}: [{i}].name: duplicate key name {e.name!r}")
        if e.sha256 in digests:
            raise ValueError(f"{path}: [{i}].sha256: the same key as an earlier entry")
        names.add(e.name)
        digests.add(e.sha256)
        out.append(e)
    return out


def resolve_auth(spec: AuthSpec | None, base: Path, models: list[str], aliases: list[str],
                 fail: Callable[[str, str], Exception]) -> AuthConfig | None:
    """Read the keys files of ``auth:`` (relative to ``base``, the pool config's folder);
    ``fail(field, reason)`` makes the error (the pool config's). A key's ``models`` must be
    the pool's models or aliases."""
    if spec is None or (spec.keys_file is None and spec.admin_keys_file is None):
        return None
    known = set(models) | set(aliases)
    keys = admin = None
    if spec.keys_file is not None:
        try:
            entries: list[KeyEntry] = _read_entries(base / spec.keys_file, KeyEntry)
        except ValueError as e:
            raise fail("auth.keys_file", str(e)) from None
        keys = {}
        for i, e in enumerate(entries):
            unknown = sorted(set(e.models or ()) - known)
            if unknown:
                raise fail("auth.keys_file", f"{base / spec.keys_file}: [{i}].models: unknown "
                           f"model(s) {unknown}; the pool's models and aliases: "
                           f"{', '.join(sorted(known))}")
            keys[e.sha256] = ApiKey(e.name, e.sha256, None if e.models is None
                                    else frozenset(e.models), e.rpm, e.tpm)
    if spec.admin_keys_file is not None:
        try:
            admins: list[AdminKeyEntry] = _read_entries(base / spec.admin_keys_file,
                                                        AdminKeyEntry)
        except ValueError as e:
            raise fail("auth.admin_keys_file", str(e)) from None
        admin = {e.sha256: e.name for e in admins}
    return AuthConfig(keys, admin, frozenset(aliases))
