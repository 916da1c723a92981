"""Scraped load gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` from an instance's ``/metrics`` (as llm-d scrapes them), for the
load balancers; used as scraped while fresh."""

from __future__ import annotations

import math


class ScrapedLoad:
    """The last scrape. ``serves``: None until known, False once ``/metrics`` answered 404."""

    def __init__(self) -> None:
        self.serves: bool | None = None
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self._at = -math.inf

    def set(self, text: str, received: float) -> None:
        """Read the gauges from a Prometheus text exposition (summed over label sets; the
        KV usage is the largest; vLLM's older ``gpu_cache_usage_perc`` name is read too)."""
        running = waiting = kv = 0.0
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:num_requests_running":
                running += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:num_requests_waiting":
                waiting += float(line.rsplit(" ", 1)[1])
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv = max(kv, float(line.rsplit(" ", 1)[1]))
        self.running, self.waiting, self.kv_usage = running, waiting, kv
        self._at = received
        self.serves = True

    def fresh(self, now: float, max_age_s: float) -> bool:
        return self._at > -math.inf and now - self._at <= max_age_s
