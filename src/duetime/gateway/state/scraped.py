"""Scraped load gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` from an instance's ``/metrics`` (as llm-d scrapes them), for the
load balancers; and, where LoRA is on, ``vllm:lora_requests_info``: the adapters with
requests and ``max_lora``. Used as scraped while fresh."""

from __future__ import annotations

import math
import re


class ScrapedLoad:
    """The last scrape. ``serves``: None until known, False once ``/metrics`` answered 404."""

    def __init__(self) -> None:
        self.serves: bool | None = None
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.lora_names: tuple[str, ...] | None = None  # None: no vllm:lora_requests_info
        self.max_lora = 0
        self._at = -math.inf

    def set(self, text: str, received: float) -> None:
        """Read the gauges from a Prometheus text exposition (summed over label sets; the
        KV usage is the largest; vLLM's older ``gpu_cache_usage_perc`` name is read too)."""
        running = waiting = kv = 0.0
        lora: tuple[float, str] | None = None  # the newest vllm:lora_requests_info series
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:lora_requests_info":
                value = float(line.rsplit(" ", 1)[1])
                if lora is None or value > lora[0]:
                    lora = (value, line)
            elif name == "vllm:num_requests_running":
                running += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:num_requests_waiting":
                waiting += float(line.rsplit(" ", 1)[1])
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                kv = max(kv, float(line.rsplit(" ", 1)[1]))
        self.running, self.waiting, self.kv_usage = running, waiting, kv
        self.lora_names, self.max_lora = (None, 0) if lora is None else _lora_info(lora[1])
        self._at = received
        self.serves = True

    def fresh(self, now: float, max_age_s: float) -> bool:
        return self._at > -math.inf and now - self._at <= max_age_s


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _lora_info(line: str) -> tuple[tuple[str, ...], int]:
    """A ``vllm:lora_requests_info`` sample's adapters and ``max_lora``. vLLM keeps every label
    set it ever set, valued with the Unix time it last reported it: the newest is the current
    state. Its running and waiting lists are one list on vLLM 0.32 (the adapters of the
    requests scheduled and not finished): read as their union."""
    labels = dict(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0])) if "{" in line \
        else {}
    names: dict[str, None] = {}
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        for n in labels.get(key, "").split(","):
            if n:
                names.setdefault(n)
    try:
        max_lora = int(labels.get("max_lora", "0"))
    except ValueError:
        max_lora = 0
    return tuple(names), max_lora
