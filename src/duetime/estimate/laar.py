"""LAAR's latency term: L(m, x) = c(m) · (T(x) + alpha · R(m)).

c(m): seconds per token from the instance's offline profile (its prefill rate: LAAR's
long-context requests are prefill-bound, :func:`~duetime.estimate.throughput.profile_rates`);
T(x): the request's tokens (prompt + predicted output); R(m): the tokens queued or in process
at the instance (remaining prefill of every resident request plus its predicted remaining
output, from its snapshot); alpha weighs the queue (the LAAR paper: 0.7).
"""

from __future__ import annotations

import numpy as np

from duetime.estimate.base import InstanceView
from duetime.estimate.throughput import profile_rates


def queued_tokens(view: InstanceView) -> int:
    """Tokens being processed or waiting at an instance: remaining prefill of every resident
    request plus the predicted remaining outputs (from its snapshot)."""
    snap = view.snapshot()
    total = 0
    for tab in (snap.running_table, snap.waiting_table):
        total += int((tab.prompt + tab.output - tab.computed).sum())
        total += int(np.maximum(tab.predicted - tab.output, 0).sum())
    return total


class LaarLatency:
    """L(m, x) for one request at one instance (seconds, up to the profile's scale)."""

    name = "laar"

    def __init__(self, alpha: float = 0.7) -> None:
        self.alpha = alpha

    def latency(self, view: InstanceView, prompt_tokens: int, output_tokens: float) -> float:
        snap = view.snapshot()
        per_token = 1.0 / profile_rates(snap.model, snap.config)[0]
        return per_token * (prompt_tokens + output_tokens + self.alpha * queued_tokens(view))
