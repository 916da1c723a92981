"""Whether an instance is in rotation: ejected on failures, re-admitted by its health probe."""

from __future__ import annotations

import logging

from duetime.gateway.metrics import GatewayMetrics

log = logging.getLogger("duetime.gateway")


class HealthTracker:
    """One instance's health. A connect error ejects at once, other failures after
    ``eject_after`` in a row; a passing probe re-admits."""

    def __init__(self, name: str, eject_after: int, metrics: GatewayMetrics) -> None:
        self.name = name
        self.eject_after = eject_after
        self.metrics = metrics
        self.healthy = True
        self.failures = 0
        self.last_error = ""
        metrics.healthy.labels(name).set(1)

    def report_success(self) -> None:
        self.failures = 0

    def report_failure(self, kind: str, message: str) -> None:
        """An attempt or probe failed (``kind``: ``connect``, ``timeout``, ``status_5xx``,
        ``probe``...)."""
        self.failures += 1
        self.last_error = message
        if self.healthy and (kind == "connect" or self.failures >= self.eject_after):
            self.eject(message)

    def probe(self, ok: bool, why: str) -> None:
        """A health probe's outcome: re-admits an ejected instance on success; a failure
        counts against a healthy one (a connect failure ejects it)."""
        if ok:
            self.readmit()
        elif self.healthy:
            self.report_failure("connect" if why.startswith("connect") else "probe", why)
        else:
            self.last_error = why

    def eject(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        self.metrics.healthy.labels(self.name).set(0)
        self.metrics.ejections.labels(self.name).inc()
        log.warning("instance ejected", extra={"fields": {
            "event": "eject", "instance": self.name, "reason": reason}})

    def readmit(self) -> None:
        if self.healthy:
            return
        self.healthy = True
        self.failures = 0
        self.metrics.healthy.labels(self.name).set(1)
        log.info("instance back in rotation", extra={"fields": {
            "event": "readmit", "instance": self.name}})
