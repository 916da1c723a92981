"""Where the picker sends requests: each instance's ``ip:port``, as Envoy's ``ORIGINAL_DST``
cluster dials it (the ``x-gateway-destination-endpoint`` header)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from urllib.parse import urlsplit

from duetime.gateway.state.instance import InstanceState

log = logging.getLogger("duetime.gateway")

RESOLVE_INTERVAL_S = 10.0  # instance host names are looked up again this often


def endpoint_address(url: str) -> tuple[str, int]:
    """Host and port of an instance URL (the scheme's default port when none is given)."""
    u = urlsplit(url)
    if u.hostname is None:
        raise ValueError(f"instance URL without a host: {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def join(host: str, port: int) -> str:
    """``ip:port`` (an IPv6 address in brackets, as Go's ``net.JoinHostPort``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoints:
    """Each instance's ``ip:port``: its URL's host if that is an address, else the host's
    address looked up (at start, then every :data:`RESOLVE_INTERVAL_S`: a pod that comes
    back has a new IP under its stable DNS name)."""

    def __init__(self, instances: list[InstanceState]) -> None:
        self.instances = instances
        self.by_name: dict[str, str] = {}
        self.by_endpoint: dict[str, InstanceState] = {}
        for s in instances:
            host, port = endpoint_address(s.url)
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(host)
                self._set(s, join(host, port))

    def _set(self, s: InstanceState, endpoint: str) -> None:
        old = self.by_name.get(s.name)
        if old is not None and self.by_endpoint.get(old) is s:
            del self.by_endpoint[old]
        self.by_name[s.name] = endpoint
        self.by_endpoint[endpoint] = s

    async def resolve(self) -> None:
        loop = asyncio.get_running_loop()
        for s in self.instances:
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

