"""Where the picker sends requests: each instance's ``ip:port``, as Envoy's ``ORIGINAL_DST``
cluster dials it (the ``x-gateway-destination-endpoint`` header)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

from duetime.gateway.dns import endpoint_address
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Change, Membership

log = logging.getLogger("duetime.gateway")

RESOLVE_INTERVAL_S = 10.0  # instance host names are looked up again this often


def join(host: str, port: int) -> str:
    """``ip:port`` (an IPv6 address in brackets, as Go's ``net.JoinHostPort``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoints:
    """Each member's ``ip:port``: its URL's host if that is an address, else the host's
    address looked up (at start, then every :data:`RESOLVE_INTERVAL_S`: a pod that comes
    back has a new IP under its stable DNS name). It follows the pool's membership: a member
    that joins or moves is added, one that leaves is dropped."""

    def __init__(self, members: Membership) -> None:
        self.members = members
        self.by_name: dict[str, str] = {}
        self.by_endpoint: dict[str, InstanceState] = {}
        for s in members:
            self._literal(s)
        members.listeners.append(self._on_change)

    def _literal(self, s: InstanceState) -> None:
        """Its endpoint, where its URL's host is an address."""
        host, port = endpoint_address(s.url)
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
            self._set(s, join(host, port))

    def _on_change(self, c: Change, s: InstanceState) -> None:
        if c.change in ("join", "update", "leave"):
            self._drop(s)
        if c.change in ("join", "update"):
            self._literal(s)  # (a name is looked up at the next resolve)

    def _drop(self, s: InstanceState) -> None:
        old = self.by_name.pop(s.name, None)
        if old is not None and self.by_endpoint.get(old) is s:
            del self.by_endpoint[old]

    def _set(self, s: InstanceState, endpoint: str) -> None:
        self._drop(s)
        self.by_name[s.name] = endpoint
        self.by_endpoint[endpoint] = s

    async def resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for s in self.members:
            host, port = endpoint_address(s.url)
            try:
                ipaddress.ip_address(host)
                continue
            except ValueError:
                pass
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("instance host not resolved", extra={"fields": {
                    "instance": s.name, "host": host, "error": str(e)}})
                continue
            if infos:
                self._set(s, join(str(infos[0][4][0]), port))

    def of(self, s: InstanceState) -> str | None:
        return self.by_name.get(s.name)

