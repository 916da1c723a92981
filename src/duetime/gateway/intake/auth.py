"""The intake's key checks: who sends a request (401), whether its key may call the model
(403) and whether it is within its limits (429); the admin routes' key; and the metering of
each key's output tokens (all optional: without ``auth:`` in the pool config the gateway
answers anyone). The keys themselves, as the config names them: :mod:`duetime.gateway.keys`.

A client sends ``Authorization: Bearer KEY`` (what every OpenAI client sends; ``x-api-key``, the
Anthropic clients' header, is not read: one way to send a key is one way to audit). The
completion routes then answer 401 ``invalid_api_key`` (no or unknown key), 403
``model_not_allowed`` and 429 ``rate_limit_exceeded`` (with ``Retry-After`` and OpenAI's
``x-ratelimit-*`` headers; limits in :mod:`duetime.gateway.intake.ratelimit`). With admin keys,
the admin routes (``/metrics``, ``/duetime/*``) need one. Logs and metrics name a key by its
name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from duetime.gateway.intake.ratelimit import Draw, Level, Limiter
from duetime.gateway.keys import ApiKey, AuthConfig, key_digest
from duetime.gateway.state.lifecycle import Attempt, Subscriber
from duetime.web.access import bearer, is_loopback
from duetime.web.asgi import Scope, Send, header
from duetime.web.errors import ApiError

log = logging.getLogger("duetime.gateway")

ADMIN_PATHS = ("/metrics", "/duetime/")  # a path equal to the first, or under the second


# -- admission ----------------------------------------------------------------------------------

class RateLimited(ApiError):
    """429 with the headers that say when to come back."""

    def __init__(self, message: str, type_: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(429, message, code="rate_limit_exceeded", type_=type_, headers=headers)


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


@dataclass(slots=True)
class Grant:
    """An admitted request: its key (None: no keys configured, or a caller that does not
    check them) and the headers its response carries (its limits' levels)."""

    key: ApiKey | None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

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


NO_GRANT = Grant(None)


class KeyMetering(Subscriber):
    """The attempt lifecycle's subscriber that charges each attempt's output tokens (as
    streamed) to its key's token bucket when the attempt ends: a key's ``tpm`` counts prompt
    tokens at admission and output tokens once known (the bucket may go into debt; the key's
    next request then waits for the refill)."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    def on_end(self, a: Attempt) -> None:
        key = a.key
        if key is not None and key.tpm is not None and a.flight.tokens:
            self.limiter.charge(Draw(f"{key.name}:tokens", key.tpm, a.flight.tokens))


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
        grant = Grant(key)
        if draws:
            ok, levels = await self.limiter.acquire(draws)
            by_kind = dict(zip(kinds, levels, strict=True))
            headers = _limit_headers(by_kind)
            if not ok:
                self._refuse(key, by_kind, draws, headers)
            grant.headers = headers
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
