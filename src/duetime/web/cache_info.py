"""vLLM's ``vllm:cache_config_info`` metric: an instance's KV cache as it reports it.

vLLM exports its ``CacheConfig`` as the labels of one info gauge on ``/metrics`` (the emulator
does the same): ``block_size``, ``num_gpu_blocks`` (KV blocks, on CPU too) and
``enable_prefix_caching`` among others, all as label strings. A router sizes its view of the
instance's cache from them (the calibration reads them too).
"""

from __future__ import annotations

import re

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
INFO = "vllm:cache_config_info{"


def cache_config_info(text: str) -> dict[str, int | bool]:
    """``block_size`` and ``num_gpu_blocks`` (ints) and ``enable_prefix_caching`` (bool), as
    far as a Prometheus text exposition's ``vllm:cache_config_info`` gives them (empty when it
    has none, or values that do not parse)."""
    for line in text.splitlines():
        if not line.startswith(INFO):
            continue
        labels = dict(_LABEL.findall(line.split("}", 1)[0]))
        out: dict[str, int | bool] = {}
        for key in ("block_size", "num_gpu_blocks"):
            v = labels.get(key, "")
            if v.isdigit() and int(v) > 0:
                out[key] = int(v)
        flag = labels.get("enable_prefix_caching", "").lower()
        if flag in ("true", "false"):
            out["enable_prefix_caching"] = flag == "true"
        return out
    return {}
