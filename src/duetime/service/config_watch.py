"""The pool config file, followed while serving: re-read when it changes (checked every
``discovery.watch_s``) and on ``SIGHUP``; a new config that loads is applied without a
restart (its instances join, drain or change: :meth:`~duetime.gateway.app.Gateway.apply`),
one that does not is refused with one log line naming the file, the field and the reason, and
the running pool is kept.

The file is compared by content, not by its time stamp alone: an editor that rewrites it
unchanged, or a ConfigMap volume's symlink swap that lands the same bytes, changes nothing.

With a shared store (``state.store``) the replicas agree: a config this replica applies is
published, and one another replica applied is applied here too
(:mod:`duetime.gateway.backends.redis_pool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from duetime.gateway.backends import PoolConfigFeed
from duetime.gateway.changes import InstanceChanges
from duetime.gateway.config import ConfigError, Pool
from duetime.gateway.prometheus import GatewayMetrics

log = logging.getLogger("duetime.gateway")


class ConfigWatch:
    """Follows ``path``: ``load(text)`` validates a config's text (raising ConfigError),
    ``apply`` applies it. :meth:`start` watches every ``watch_s`` seconds (0: on SIGHUP
    only), installs the SIGHUP handler and follows ``shared`` (the other replicas' configs;
    None: alone); :meth:`reload` reads the file now."""

    def __init__(self, path: str | Path, load: Callable[[str], Pool],
                 apply: Callable[[Pool], Awaitable[InstanceChanges]], *, watch_s: float,
                 metrics: GatewayMetrics | None = None,
                 shared: PoolConfigFeed | None = None) -> None:
        self.path = Path(path)
        self.load = load
        self.apply = apply
        self.watch_s = watch_s
        self.metrics = metrics
        self.shared = shared
        self._seen = self._digest()
        self.applied = self._seen  # the digest of the config text applied last
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        self._hup = False

    def _digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    async def reload(self, why: str) -> bool:
        """Read the file and apply it; whether it was applied (a refusal is logged)."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            async with self._lock:
                self._refused(ConfigError(f"{self.path}: cannot read: {e.strerror or e}"), why)
            return False
        self._seen = hashlib.sha256(data).digest()
        try:
            text = data.decode()
        except UnicodeDecodeError:
            async with self._lock:
                self._refused(ConfigError(f"{self.path}: not UTF-8 text"), why)
            return False
        return await self._apply(text, why, publish=True)

    async def _apply(self, text: str, why: str, *, publish: bool) -> bool:
        async with self._lock:
            try:
                changes = await self.apply(self.load(text))
            except ConfigError as e:
                self._refused(e, why)
                return False
            self.applied = hashlib.sha256(text.encode()).digest()
            self._count("applied")
            log.info(f"pool config applied: {changes.describe()}", extra={"fields": {
                "event": "config_applied", "file": str(self.path), "why": why}})
            if publish and self.shared is not None:
                await self.shared.publish(text)
            return True

    async def _from_replica(self, text: str, replica: str) -> None:
        """Another replica applied ``text``: apply it here too (unless it is this one's)."""
        if hashlib.sha256(text.encode()).digest() != self.applied:
            await self._apply(text, f"replica {replica}", publish=False)

    def _refused(self, e: ConfigError, why: str) -> None:
        self._count("refused")
        log.error(f"pool config not applied: {e}", extra={"fields": {
            "event": "config_refused", "file": str(self.path), "why": why}})

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.config_reloads.labels(outcome).inc()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # (not the main thread)
            loop.add_signal_handler(signal.SIGHUP, self._on_hup)
            self._hup = True
        self._tasks = [loop.create_task(self._watch())]
        if self.shared is not None:
            self._tasks.append(loop.create_task(self.shared.follow(self._from_replica)))

    def _on_hup(self) -> None:
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.reload("SIGHUP"))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _watch(self) -> None:
        if self.watch_s <= 0:
            return
        while True:
            await asyncio.sleep(self.watch_s)
            digest = self._digest()
            if digest is not None and digest != self._seen:
                await self.reload("file changed")

    async def stop(self) -> None:
        if self._hup:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._hup = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
