"""Access checks both servers here share: whether a bind address is loopback (only this machine
can reach it), and reading and comparing bearer tokens in constant time."""

from __future__ import annotations

import hmac
import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str | None) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only (None: the
    servers' default, 127.0.0.1). A name other than localhost counts as reachable from
    elsewhere: it may resolve to any address."""
    if host is None:
        return True
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value, or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def same_secret(given: str | None, expected: str) -> bool:
    """``given == expected`` in time that does not depend on where they differ."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())
