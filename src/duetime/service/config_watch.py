"""The pool config file, followed while serving: re-read when it changes (checked every
``discovery.watch_s``) and on ``SIGHUP``; a new config that loads is applied without a
restart (its instances join, drain or change: :meth:`~duetime.gateway.app.Gateway.apply`),
one that does not is refused with one log line naming the file, the field and the reason, and
the running pool is kept.

The file is compared by content, not by its time stamp alone: an editor that rewrites it
unchanged, or a ConfigMap volume's symlink swap that lands the same bytes, changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from duetime.gateway.changes import InstanceChanges
from duetime.gateway.config import ConfigError, Pool
from duetime.gateway.prometheus import GatewayMetrics

log = logging.getLogger("duetime.gateway")


class ConfigWatch:
    """Follows ``path``: ``load()`` reads and validates it (raising ConfigError), ``apply``
    applies what it read. :meth:`start` watches every ``watch_s`` seconds (0: on SIGHUP
    only) and installs the SIGHUP handler; :meth:`reload` reads it now."""

    def __init__(self, path: str | Path, load: Callable[[], Pool],
                 apply: Callable[[Pool], Awaitable[InstanceChanges]], *, watch_s: float,
                 metrics: GatewayMetrics | None = None) -> None:
        self.path = Path(path)
        self.load = load
        self.apply = apply
        self.watch_s = watch_s
        self.metrics = metrics
        self._seen = self._digest()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._hup = False

    def _digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self.path.read_bytes()).digest()
        except OSError:
            return None

    async def reload(self, why: str) -> bool:
        """Read the file and apply it; whether it was applied (a refusal is logged)."""
        async with self._lock:
            self._seen = self._digest()
            try:
                changes = await self.apply(self.load())
            except ConfigError as e:
                self._count("refused")
                log.error(f"pool config not applied: {e}", extra={"fields": {
                    "event": "config_refused", "file": str(self.path), "why": why}})
                return False
            self._count("applied")
            log.info(f"pool config applied: {changes.describe()}", extra={"fields": {
                "event": "config_applied", "file": str(self.path), "why": why}})
            return True

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.config_reloads.labels(outcome).inc()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # (not the main thread)
            loop.add_signal_handler(signal.SIGHUP, self._on_hup)
            self._hup = True
        self._task = loop.create_task(self._watch())

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
