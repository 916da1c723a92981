"""API keys, per-key limits and the admin key of the gateway (all optional: without ``auth:``
in the pool config the gateway answers anyone, as before).

Keys are stored as the SHA-256 of the key, never the key: a key is 32 random bytes
(:func:`new_key`), so a fast hash is as safe as a slow one (no dictionary to try, 2^256
guesses), and it lets a request be checked with one dictionary look-up instead of a slow hash
per request (tens of ms of CPU each with bcrypt or argon2, and a lever for anyone who can send
requests). A key someone chose by hand would need a slow hash; ``duetime keys new`` makes them.

A client sends ``Authorization: Bearer KEY`` (what every OpenAI client sends; ``x-api-key``, the
Anthropic clients' header, is not read: one way to send a key is one way to audit). The
completion routes then answer 401 ``invalid_api_key`` (no or unknown key), 403
``model_not_allowed`` and 429 ``rate_limit_exceeded`` (with ``Retry-After`` and OpenAI's
``x-ratelimit-*`` headers; limits in :mod:`duetime.gateway.ratelimit`). With admin keys, the
admin routes (``/metrics``, ``/duetime/*``) need one. Logs and metrics name a key by its name.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duetime.gateway.inflight import Flight, FlightStore
from duetime.gateway.ratelimit import Draw, Level, Limiter
from duetime.web.access import bearer, is_loopback
from duetime.web.asgi import Scope, Send, header
from duetime.web.errors import ApiError

log = logging.getLogger("duetime.gateway")

KEY_PREFIX = "dt-"
ADMIN_PATHS = ("/metrics", "/duetime/")  # a path equal to the first, or under the second


def new_key() -> str:
    """A new API key: ``dt-`` and 32 random bytes (URL-safe base64)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    """What a keys file stores for ``key``: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


# -- the config ---------------------------------------------------------------------------------

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


# -- admission ----------------------------------------------------------------------------------

class RateLimited(ApiError):
    """429 with the headers that say when to come back."""

    def __init__(self, message: str, type_: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(429, message, code="rate_limit_exceeded", type_=type_)
        self.headers = headers


def _duration(s: float) -> str:
    """A reset time as OpenAI writes it: ``120ms``, ``1.5s``, ``6m0s``."""
    if s < 1.0:
        return f"{math.ceil(s * 1000)}ms"
    m, sec = divmod(round(s, 3), 60.0)
    return f"{int(m)}m{sec:g}s" if m else f"{sec:g}s"


def _limit_headers(levels: Mapping[str, Level]) -> list[tuple[bytes, bytes]]:
    out = []
    for kind, lv in levels.items():  # kind: requests, tokens
        out += [(f"x-ratelimit-limit-{kind}".encode(), str(lv.per_minute).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(),
                 str(max(0, math.floor(lv.remaining))).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), _duration(lv.reset_s).encode())]
    return out


_current: contextvars.ContextVar[Grant | None] = contextvars.ContextVar("duetime_grant",
                                                                       default=None)


@dataclass(slots=True)
class Grant:
    """An admitted request: the headers its response carries, and the upstream attempts it made
    (their output tokens are charged to the key's token bucket by :meth:`settle`)."""

    key: ApiKey | None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    flights: list[Flight] = field(default_factory=list)
    auth: Auth | None = None
    token: contextvars.Token[Grant | None] | None = None

    def wrap(self, send: Send) -> Send:
        """``send`` with this grant's headers added to the response's start."""
        if not self.headers:
            return send
        extra = self.headers

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)
        return with_headers

    def settle(self) -> None:
        """The request ended: charge its output tokens (as streamed, all attempts)."""
        if self.token is not None:
            _current.reset(self.token)
            self.token = None
        if self.auth is not None and self.key is not None and self.key.tpm is not None:
            out = sum(f.tokens for f in self.flights)
            if out:
                self.auth.limiter.charge(Draw(f"{self.key.name}:tokens", self.key.tpm, out))


NO_GRANT = Grant(None)


class MeteredStore:
    """A :class:`FlightStore` that also tells the current request's :class:`Grant` which
    attempts it dispatched (the relay runs them in the request's task), so that their output
    tokens can be charged once the request ends."""

    def __init__(self, store: FlightStore) -> None:
        self.store = store

    def add(self, instance: str, flight: Flight) -> None:
        g = _current.get()
        if g is not None:
            g.flights.append(flight)
        self.store.add(instance, flight)

    def update(self, instance: str, flight: Flight) -> None:
        self.store.update(instance, flight)

    def remove(self, instance: str, flight_id: str, t: float) -> Flight | None:
        return self.store.remove(instance, flight_id, t)

    def flights(self, instance: str) -> Mapping[str, Flight]:
        return self.store.flights(instance)

    def done(self, instance: str) -> Mapping[str, float]:
        return self.store.done(instance)


class Auth:
    """The gateway's checks: :meth:`identify` (401) and :meth:`admit` (403, 429) on the
    completion routes, :meth:`protect` on the admin routes. ``host``: where the gateway listens
    (None: loopback), for the warning and for whether ``/duetime/instances`` shows URLs."""

    def __init__(self, config: AuthConfig | None, registry: CollectorRegistry, *,
                 host: str | None = None, limiter: Limiter | None = None) -> None:
        self.config = config or AuthConfig()
        self.keys = self.config.keys
        self.admin = self.config.admin
        self.host = host
        self.loopback = is_loopback(host)
        self.limiter = limiter if limiter is not None else Limiter()
        self.rejections = Counter("duetime_auth_rejections",
                                  "Requests refused by the API-key checks, by key name (empty: "
                                  "no or unknown key) and reason (invalid_api_key, "
                                  "model_not_allowed, rate_limit_exceeded, admin_key_required).",
                                  ["key", "reason"], registry=registry)

    # -- completion routes --------------------------------------------------------------------

    def meter(self, store: FlightStore) -> FlightStore:
        """The flight store to use: metered when some key has a token limit."""
        if self.keys and any(k.tpm is not None for k in self.keys.values()):
            return MeteredStore(store)
        return store

    def _lookup(self, token: str | None, table: Mapping[str, Any] | None) -> Any:
        if token is None or table is None:
            return None
        # (a dict look-up by digest: timing tells an attacker about digests of keys they
        # already hold, nothing about a key they do not)
        return table.get(key_digest(token))

    def identify(self, scope: Scope) -> ApiKey | None:
        """The request's key (None when no keys are configured); 401 if missing or unknown."""
        if self.keys is None:
            return None
        token = bearer(header(scope, b"authorization"))
        key = self._lookup(token, self.keys)
        if key is None:
            self.rejections.labels("", "invalid_api_key").inc()
            if token is None:
                raise ApiError(401, "You didn't provide an API key. Send it in an Authorization "
                               "header: Authorization: Bearer YOUR_KEY", code="invalid_api_key")
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return key

    async def admit(self, key: ApiKey | None, model: str | None, prompt_tokens: int) -> Grant:
        """Admit a request of ``key`` for ``model`` (None: the default, any model) with
        ``prompt_tokens``: 403 if the key may not call it, 429 past its limits."""
        if key is None:
            return NO_GRANT
        if key.models is not None:
            allowed = (any(a in key.models for a in self.config.aliases) if model is None
                       else model in key.models)
            if not allowed:
                self.rejections.labels(key.name, "model_not_allowed").inc()
                what = f"model `{model}`" if model is not None else "the default model"
                raise ApiError(403, f"This API key may not call {what}; it may call: "
                               f"{', '.join(sorted(key.models))}", param="model",
                               code="model_not_allowed", type_="invalid_request_error")
        kinds, draws = [], []
        if key.rpm is not None:
            kinds.append("requests")
            draws.append(Draw(f"{key.name}:requests", key.rpm, 1))
        if key.tpm is not None:
            kinds.append("tokens")
            draws.append(Draw(f"{key.name}:tokens", key.tpm, prompt_tokens))
        grant = Grant(key, auth=self)
        if draws:
            ok, levels = await self.limiter.acquire(draws)
            by_kind = dict(zip(kinds, levels, strict=True))
            headers = _limit_headers(by_kind)
            if not ok:
                self._refuse(key, by_kind, draws, headers)
            grant.headers = headers
        if key.tpm is not None:
            grant.token = _current.set(grant)
        return grant

    def _refuse(self, key: ApiKey, levels: dict[str, Level], draws: list[Draw],
                headers: list[tuple[bytes, bytes]]) -> None:
        self.rejections.labels(key.name, "rate_limit_exceeded").inc()
        kind, lv = max(levels.items(), key=lambda kv: kv[1].wait_s)
        cost = next(d.cost for d in draws if d.bucket.endswith(":" + kind))
        unit = "requests per min (RPM)" if kind == "requests" else "tokens per min (TPM)"
        used = max(0, lv.per_minute - math.floor(lv.remaining))
        if math.isinf(lv.wait_s):
            raise RateLimited(f"Request too large for this key on {unit}: Limit {lv.per_minute}"
                              f", Requested {cost:g}.", kind, headers)
        wait = max(1, math.ceil(lv.wait_s))
        log.info("rate limited", extra={"fields": {"event": "rate_limited", "key": key.name,
                                                   "limit": kind, "retry_after_s": wait}})
        raise RateLimited(f"Rate limit reached for key {key.name!r} on {unit}: Limit "
                          f"{lv.per_minute}, Used {used}, Requested {cost:g}. Please try again "
                          f"in {_duration(lv.wait_s)}.", kind,
                          [(b"retry-after", str(wait).encode()),
                           (b"retry-after-ms", str(math.ceil(lv.wait_s * 1000)).encode()),
                           *headers])

    # -- admin routes -------------------------------------------------------------------------

    def is_admin(self, request: Request) -> bool:
        return self._lookup(bearer(request.headers.get("authorization")), self.admin) is not None

    def protect(self, routes: list[Route]) -> list[Route]:
        """The routes, with ``/metrics`` and ``/duetime/*`` needing an admin key when admin keys
        are configured (the others, ``/health`` and ``/v1/models``, stay open)."""
        if self.admin is None:
            return routes
        out: list[Route] = []
        for r in routes:
            if isinstance(r, Route) and (r.path == ADMIN_PATHS[0]
                                         or r.path.startswith(ADMIN_PATHS[1])):
                r = Route(r.path, self._admin_only(r.endpoint), methods=r.methods, name=r.name)
            out.append(r)
        return out

    def _admin_only(self, endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            if self.is_admin(request):
                return await endpoint(request)
            client = self._lookup(bearer(request.headers.get("authorization")), self.keys)
            if client is not None:
                self.rejections.labels(client.name, "admin_key_required").inc()
                err = ApiError(403, "This route needs an admin key.", code="admin_key_required",
                               type_="invalid_request_error")
            else:
                self.rejections.labels("", "invalid_api_key").inc()
                err = ApiError(401, "This route needs an admin key: Authorization: Bearer "
                               "ADMIN_KEY", code="invalid_api_key")
            return JSONResponse(err.body(), status_code=err.status)
        return guarded

    def reveals_urls(self, request: Request) -> bool:
        """Whether ``/duetime/instances`` may show the upstream URLs to this caller: an admin,
        or anyone while the gateway listens on loopback only and has no admin keys."""
        if self.admin is not None:
            return self.is_admin(request)
        return self.loopback

    # -- start ----------------------------------------------------------------------------------

    def warning(self) -> str | None:
        """What to warn about at start: listening beyond loopback with no keys (anyone who can
        reach the port may use it), or with no admin keys (its metrics are open)."""
        if self.loopback:
            return None
        if self.keys is None:
            return (f"listening on {self.host} (reachable from other machines) without API "
                    "keys: anyone who reaches it can send requests; set auth.keys_file in the "
                    "pool config (docs/gateway.md, Keys and limits)")
        if self.admin is None:
            return (f"listening on {self.host} without admin keys: /metrics and /duetime/* "
                    "are open (upstream URLs are hidden); set auth.admin_keys_file")
        return None
