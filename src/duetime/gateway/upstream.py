"""HTTP to the instances: one aiohttp client session for completions, scrapes and probes.

Why aiohttp and not httpx (which :mod:`duetime.client` uses): the upstream call is on every
request's critical path, twice (the request out, the first chunk back). On this project's
2-core test machine, streaming an 8-token chat completion from an emulator cost the calling
process 0.65-0.85 ms of CPU per request with aiohttp's client (C HTTP parser, headers and a
small body written in one send) against 1.1-1.5 ms through httpx's bare transport (httpcore over
anyio, headers and body in two sends), and its time to first token was ~1 ms lower; measured
side by side with ``python benchmarks/gateway_overhead.py`` and a two-client script.

Errors are mapped to the gateway's retry kinds here, so that the router never sees a library
type: ``connect`` (nothing accepted the connection), ``timeout`` and ``broken`` (the connection
or the stream failed after it was made).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from yarl import URL

from duetime.web.limits import INSTANCE_KEEP_ALIVE_S


class UpstreamError(Exception):
    """An upstream call failed; ``kind`` is ``connect``, ``timeout`` or ``broken``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def classify(e: BaseException) -> UpstreamError:
    """The retry kind and a one-line message for an aiohttp (or socket) exception."""
    if isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return UpstreamError("connect", f"connect error: {e}")
    if isinstance(e, TimeoutError):  # aiohttp's socket timeouts are TimeoutErrors
        return UpstreamError("timeout", f"{type(e).__name__}: {e or 'timed out'}")
    return UpstreamError("broken", f"{type(e).__name__}: {e}")


@dataclass(frozen=True, slots=True)
class Reply:
    """A small, fully read answer (scrapes and probes)."""

    status: int
    headers: dict[str, str]
    body: bytes


class Upstream:
    """A pooled HTTP/1.1 client for the gateway (keep-alive connections per instance)."""

    def __init__(self, *, connect_s: float, read_s: float, max_connections: int = 4096) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s,
                                              sock_read=read_s)
        self._limit = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0,
                                         keepalive_timeout=INSTANCE_KEEP_ALIVE_S,
                                         ttl_dns_cache=None, enable_cleanup_closed=False)
        # no cookies, no decompression, no default headers beyond what HTTP/1.1 needs:
        # the gateway relays bytes (aiohttp turns Nagle off on its connections by itself)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",),
            trust_env=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, url: str) -> URL:
        u = self._urls.get(url)
        if u is None:
            u = self._urls[url] = URL(url)
        return u

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the upstream client is not started")
        return self._session

    async def post_stream(self, url: str, payload: bytes,
                          headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send a POST and return once the response's status line and headers are in (the
        body is read with :func:`chunks`). Raises :class:`UpstreamError`."""
        try:
            return await self.session.post(self._url(url), data=payload, headers=headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise classify(e) from None

    async def get(self, url: str, timeout_s: float) -> Reply:
        """A GET read to its end within ``timeout_s``. Raises :class:`UpstreamError`."""
        try:
            async with self.session.get(self._url(url), timeout=aiohttp.ClientTimeout(
                    total=timeout_s)) as r:
                body = await r.read()
                return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, body)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise classify(e) from None


async def chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body of a response as it arrives (de-chunked). Raises :class:`UpstreamError`."""
    content = resp.content
    while True:
        try:
            data = await content.readany()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise classify(e) from None
        if not data:
            return
        yield data


async def read_all(resp: aiohttp.ClientResponse, limit: int = 1 << 20) -> bytes:
    """A (short) error body, at most ``limit`` bytes."""
    out = bytearray()
    try:
        while len(out) < limit:
            data = await resp.content.read(limit - len(out))
            if not data:
                break
            out += data
        return bytes(out)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise classify(e) from None


async def finish(resp: aiohttp.ClientResponse, timeout_s: float = 1.0) -> None:
    """Read what is left of a response whose last event came (the chunked terminator), so that
    its connection goes back to the pool instead of being closed."""
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
        async with asyncio.timeout(timeout_s):
            while await resp.content.readany():
                pass
    resp.release()

