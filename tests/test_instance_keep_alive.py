"""duetime's clients of an instance close an idle connection before the instance does.

vLLM's API server closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by
default; ``tests/e2e/test_vllm_keep_alive.py`` reads it from vLLM); a client that holds it
longer may write a request as the server closes it and get a bare connection reset (once in 60
requests of ``duetime validate`` in CI, when its session held idle connections for aiohttp's
default 15 s).
"""

from __future__ import annotations

import asyncio

import aiohttp

from duetime.calibrate.endpoint import instance_session
from duetime.gateway.upstream import Upstream
from duetime.web.limits import DEFAULT_LIMITS, INSTANCE_KEEP_ALIVE_S

VLLM_DEFAULT_KEEP_ALIVE_S = 5.0


def _held(connector: aiohttp.BaseConnector) -> float:
    return connector._keepalive_timeout  # (aiohttp keeps it private)


def test_the_gateway_and_the_probes_close_idle_connections_first() -> None:
    async def go() -> tuple[float, float]:
        up = Upstream(connect_s=1.0, read_s=1.0)
        await up.start()
        try:
            gateway = _held(up._session.connector)
        finally:
            await up.close()
        async with instance_session(aiohttp.ClientTimeout(total=1.0)) as s:
            probes = _held(s.connector)
        return gateway, probes

    gateway, probes = asyncio.run(go())
    assert gateway == probes == INSTANCE_KEEP_ALIVE_S
    assert min(VLLM_DEFAULT_KEEP_ALIVE_S, DEFAULT_LIMITS.keep_alive_s) > INSTANCE_KEEP_ALIVE_S
