"""Looking up a DNS group's addresses: the replicas behind a name (a Kubernetes headless
Service answers with one A/AAAA record per ready pod).

With ``discovery.dns_servers`` the named servers are asked directly (dnspython: the system's
resolver cannot be pointed at a server, and a pool may name the cluster's DNS); otherwise the
system's resolver (``getaddrinfo``). A name that does not exist or has no address has no
replicas now (all its members drain); a lookup that fails (timeout, a server error) changes
nothing: the members stay as they were until a lookup answers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from urllib.parse import urlsplit

from duetime.gateway.config import DiscoverySpec, dns_server_address

log = logging.getLogger("duetime.gateway")


def endpoint_address(url: str) -> tuple[str, int]:
    """Host and port of an instance URL (the scheme's default port when none is given)."""
    u = urlsplit(url)
    if u.hostname is None:
        raise ValueError(f"instance URL without a host: {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


class LookupFailed(Exception):
    """No answer (timeout, server failure): keep what was known."""


class DnsLookup:
    """Addresses of host names, from ``spec.dns_servers`` or the system's resolver."""

    def __init__(self, spec: DiscoverySpec) -> None:
        self.spec = spec
        self._resolver = None
        if spec.dns_servers:
            import dns.asyncresolver
            import dns.nameserver

            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers = [dns.nameserver.Do53Nameserver(*dns_server_address(s))
                             for s in spec.dns_servers]
            r.timeout = r.lifetime = spec.dns_timeout_s
            r.cache = None  # (each lookup asks: the group's membership is what it says now)
            self._resolver = r

    async def addresses(self, host: str, port: int) -> list[str]:
        """The host's IPv4 and IPv6 addresses, sorted; [] if it has none; LookupFailed if no
        server answered."""
        if self._resolver is None:
            return await self._system(host, port)
        import dns.asyncresolver
        import dns.exception
        import dns.resolver

        found: set[str] = set()
        answered = False
        for rtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(host, rtype, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                answered = True
                continue
            except dns.exception.DNSException as e:  # (timeout, no server answered, ...)
                raise LookupFailed(f"{host} {rtype}: {e}") from None
            answered = True
            found.update(r.address for r in answer)
        assert answered
        return sorted(found)

    async def _system(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self.spec.dns_timeout_s)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return []
            raise LookupFailed(f"{host}: {e}") from None
        except (OSError, TimeoutError) as e:
            raise LookupFailed(f"{host}: {e or 'timed out'}") from None
        return sorted({str(i[4][0]) for i in infos})
