"""Why a policy chose what it chose: the per-candidate numbers behind one decision, as plain
data (``POST /duetime/route``, the ``x-duetime-explain`` header, the dashboard).

Every candidate gets the same keys, ``None`` where the policy does not weigh that number:
what the policy weighed (:meth:`~duetime.policy.base.Policy.describe`: forecasts, utility,
score), what the router predicted for the request (quality, success probability, output
tokens, the cost at the instance's prices) and the instance's load as the router sees it
(running, waiting, KV use, prompt blocks its prefix cache holds as far as known). Building an
explanation reads and never writes: a dry run leaves later decisions as they would have been.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from duetime.estimate.prefix_index import prefix_index_of
from duetime.policy.base import Candidate, Decision, Policy, RoutingRequest, prices_of

KEYS = ("instance", "model", "forecast_ttft_ms", "forecast_e2e_ms", "target_ms", "feasible",
        "quality", "success", "output_tokens", "cost", "utility", "score", "running",
        "waiting", "kv_usage", "cached_blocks", "chosen")


def _num(x: Any, scale: float = 1.0, digits: int = 6) -> float | None:
    """A JSON number (None for a missing or non-finite one: an instance that cannot serve
    the request has an infinite forecast)."""
    if x is None or isinstance(x, bool):
        return x
    x = float(x) * scale
    return round(x, digits) if math.isfinite(x) else None


def _cached_blocks(req: RoutingRequest, cand: Candidate) -> int | None:
    """The prompt's leading blocks the instance's prefix index holds (None: no index)."""
    index = prefix_index_of(cand.view)
    if index is None or req.prompt_hashes is None:
        return None
    hashes = req.prompt_hashes(index.block_size)
    return index.match(hashes) if len(hashes) else 0


def explain(policy: Policy, req: RoutingRequest, cands: Sequence[Candidate], now: float,
            decision: Decision) -> dict[str, Any]:
    """The explanation of ``decision`` (made by ``policy`` over ``cands`` for ``req`` at
    ``now``): ``{"policy", "chosen", "rule", "score", "better", "target_ms",
    "prompt_tokens", "candidates": [...]}``, candidates in the order given."""
    cands = list(cands)
    d = policy.describe(req, cands, now, decision.index)
    col = d.columns
    prices = prices_of(cands)
    out = []
    for i, c in enumerate(cands):
        def at(name: str, i: int = i) -> Any:
            values = col.get(name)
            return None if values is None else values[i]

        view = c.view
        tokens = int(req.output_tokens[i])
        cost_usd = (prices[i, 0] * req.prompt_tokens + prices[i, 1] * tokens) / 1e6
        forecast = at("forecast_ttft_s")
        if i == decision.index and decision.forecast is not None and "forecast_e2e_s" not in col:
            forecast = decision.forecast
        feasible = at("feasible")
        if feasible is None and forecast is not None:
            feasible = bool(forecast <= req.ttft_target)
        out.append({
            "instance": c.name, "model": c.model,
            "forecast_ttft_ms": _num(forecast, 1e3, 3),
            "forecast_e2e_ms": _num(at("forecast_e2e_s"), 1e3, 3),
            "target_ms": _num(req.ttft_target, 1e3, 3),
            "feasible": feasible,
            "quality": None if req.quality is None else _num(req.quality[i]),
            "success": None if req.success is None else _num(req.success[i]),
            "output_tokens": tokens,
            "cost": _num(cost_usd, digits=9),
            "utility": _num(at("utility")),
            # (what it ranks by: its own score, or the column it names, such as utility)
            "score": _num(at("score") if "score" in col else at(d.score or "score")),
            "running": int(view.num_running), "waiting": int(view.num_waiting),
            "kv_usage": _num(view.kv_usage, digits=4),
            "cached_blocks": _cached_blocks(req, c),
            "chosen": i == decision.index,
            **{k: _num(v[i]) for k, v in col.items()
               if k not in ("forecast_ttft_s", "forecast_e2e_s", "feasible", "utility",
                            "score")},
        })
    return {"policy": policy.name, "chosen": cands[decision.index].name,
            "rule": d.rule, "score": d.score, "better": d.better,
            "target_ms": _num(req.ttft_target, 1e3, 3), "prompt_tokens": req.prompt_tokens,
            "candidates": out}
