"""The LPS estimator: a limited-processor-sharing queue from time-averaged rates only.

Up to ``k`` requests are served at once; with arrival rate alpha and service capacity mu
(rho = alpha/mu < 1) the SFS paper approximates the expected wait as (alpha/mu)^k / (mu - alpha)
and adds the service time to the first token. It needs no view inside the engine: alpha and the
mean prompt and output lengths are time-averaged observations (``InstanceStats``), and the
capacity comes from the instance's offline batch-time profile at k concurrent requests:

    mu = 1 / (mean output x step(k decoders at the mean context) / k + prefill(mean prompt))

The service time to a first token is an idle prefill of the mean prompt (one step). The paper
observed k ~ 25 on Qwen3-0.6B. Here k is fitted from the instance's config unless given: the
concurrency it can hold, min(max_num_seqs, KV tokens / mean (prompt + output)).
"""

from __future__ import annotations

from duetime.estimate.base import InstanceView, PromptHashes, with_gateway

SATURATED_S = 60.0  # the forecast of an instance whose arrivals exceed its capacity


class LpsEstimator:
    name = "lps"

    def __init__(self, k: float | None = None) -> None:
        self.k = k

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float, *,
             hashes: PromptHashes | None = None, lora: int = 0) -> float:
        s = view.stats
        snap = view.snapshot()
        model, cfg = snap.model, snap.config
        p = int(s.mean_prompt or prompt_tokens)
        o = s.mean_output or 1.0
        if self.k is None:
            k = max(1, min(cfg.max_num_seqs, int(cfg.kv_capacity_tokens / (p + o))))
        else:
            k = max(round(self.k), 1)
        c = int(p + o / 2)
        step_k = model.duration(k, 0, 0, 0, k * c, k * (c + 1), k * (c + 1) ** 2)
        prefill = model.duration(0, p, p * p, p * (p + 1) // 2, 0, p, p * p)
        mu = 1.0 / (o * step_k / k + prefill - model.intercept)
        service = prefill + view.request_overhead_s
        alpha = s.arrival_rate
        if alpha <= 0:
            return with_gateway(view, service)
        if alpha >= mu:
            return SATURATED_S
        return with_gateway(view, (alpha / mu) ** k / (mu - alpha) + service)
