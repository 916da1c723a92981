"""Set-up every test shares: the engine's compiled kernels are loaded (or, with a fresh numba
cache, compiled: ~20 s on a 2-core machine) once, before the first test, so that no gateway or
emulator started inside a test pays that within the test's own timeouts."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _warm_kernels() -> None:
    from duetime.engine.warmup import warm_up

    warm_up()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server of the test's own, on a free loopback port (tests/redis_server.py)."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
