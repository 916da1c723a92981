"""llm-d's predicted-latency SLO scorer, reimplemented from its published rule: ``slo-headroom``.

llm-d's predicted-latency routing (its "well-lit path", the Gateway API Inference Extension's
``slo-scorer``) predicts each pod's TTFT and TPOT for the request and compares them with the
request's SLOs (``x-slo-ttft-ms``, ``x-slo-tpot-ms``):

* headroom: ``TTFT SLO - predicted TTFT`` and ``TPOT SLO x buffer - predicted TPOT`` (buffer
  ``SLO_BUFFER_FACTOR``, 1.0 by default); a pod is in the *positive* bucket when both are > 0,
  else in the *negative* one;
* with pods in both buckets it draws from the positive one with probability 0.99 (0.01: the
  negative one);
* positive bucket, strategy ``least`` (the default, "better packing"): each headroom is scaled
  to [0, 1] within the bucket (0.5 when all are equal), blended ``0.8 x TTFT + 0.2 x TPOT``
  (``HEADROOM_TTFT_WEIGHT`` / ``HEADROOM_TPOT_WEIGHT``), and a pod drawn with weight
  ``int((1 - blended) x 99) + 2`` — the tighter fit is likelier;
* negative bucket: pods with no running request first (strictly); then the deficits
  (``max(0, -headroom)``) scaled to [0, 1] within each class (both negative, TTFT only, TPOT
  only), blended 0.8 / 0.2 (``NEG_HEADROOM_*_WEIGHT``), weight ``int((1 - blended) x 80) + 2``;
  a pod with no deficit left in that bucket (a headroom exactly 0) weight 1.

The predictions here are duetime's engine forecasts (TTFT, and the TPOT of a finish forecast at
the predicted median output length), where llm-d asks a learnt p90 predictor: the comparison
with ``sfs-deadline`` is then one of rules, not of predictors. Like llm-d's scorer it knows
no quality or price (its pools are one model) and no end-to-end deadline: a request's
``deadline`` is not read. Left out: the tightening of the TPOT SLO to the smallest one among a
pod's running requests (the views do not carry other requests' SLOs).
"""

from __future__ import annotations

import math

import numpy as np

from duetime.estimate import SfsEstimator
from duetime.policy.base import Candidate, Decision, Described, Policy, RoutingRequest
from duetime.policy.registry import OUTPUT_LENGTH, SEED, SNAPSHOT, Param, PolicyError

TTFT_WEIGHT = Param("ttft_weight", "ttft_weight", float, 0.8, "the TTFT headroom's weight in "
                    "the blend (the TPOT headroom's: 1 - it), as llm-d's HEADROOM_TTFT_WEIGHT "
                    "and NEG_HEADROOM_TTFT_WEIGHT", min=0.0)
POSITIVE_SHARE = 0.99   # the chance of drawing from the positive bucket when both exist
POSITIVE_RANGE = 99     # positive weights: int((1 - blended) x 99) + 2, in 2..101
NEGATIVE_RANGE = 80     # negative weights: int((1 - blended) x 80) + 2, in 2..82


def _scaled(x: np.ndarray) -> np.ndarray:
    """Values scaled to [0, 1] within the group (NaN where they are all equal: the caller
    fills in its neutral value, 0.5 for headroom as llm-d does, 0 for deficits)."""
    lo, hi = float(x.min()), float(x.max())
    if hi - lo <= 1e-9:
        return np.full(len(x), np.nan)
    return (x - lo) / (hi - lo + 1e-9)


class SloHeadroom(Policy):
    """llm-d's SLO scorer: a weighted draw that favours the tightest positive TTFT/TPOT
    headroom, else the least deficit (module doc)."""

    name = "slo-headroom"
    summary = ("llm-d's predicted-latency SLO scorer: pods whose TTFT and TPOT forecasts both "
               "have headroom first (99%), drawn favouring the least blended headroom (0.8 TTFT"
               " / 0.2 TPOT); else favouring the least deficit; no quality or price")
    params = (SEED, TTFT_WEIGHT)
    consumes = frozenset({SNAPSHOT, OUTPUT_LENGTH})

    def __init__(self, *, seed: int = 0, ttft_weight: float = TTFT_WEIGHT.default) -> None:
        super().__init__(seed=seed)
        if not 0.0 <= ttft_weight <= 1.0:
            raise PolicyError(f"policy.ttft_weight: must be in [0, 1], got {ttft_weight}")
        self.alpha = ttft_weight
        self.estimator = SfsEstimator()

    def predictions(self, req: RoutingRequest, cands: list[Candidate],
                    now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate: the forecast TTFT and TPOT (s), the TPOT over the finish at the
        predicted median length."""
        ttft = np.empty(len(cands))
        tpot = np.empty(len(cands))
        for i, c in enumerate(cands):
            n = max(2, int(req.output_tokens[i]))
            first, end = self.estimator.finishes(c.view, req.prompt_tokens, [1, n], now)
            ttft[i] = first
            tpot[i] = (end - first) / (n - 1) if math.isfinite(end) else math.inf
        return ttft, tpot

    def weights(self, req: RoutingRequest, cands: list[Candidate], ttft: np.ndarray,
                tpot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's draw weight within its bucket, and the positive-bucket mask."""
        h_ttft = req.ttft_target - ttft
        h_tpot = req.tpot_target - tpot  # (inf without a TPOT SLO: always positive)
        positive = (h_ttft > 0) & (h_tpot > 0)
        w = np.zeros(len(cands))
        a, b = self.alpha, 1.0 - self.alpha
        pos = np.flatnonzero(positive)
        if pos.size:
            n_t = _scaled(h_ttft[pos])
            n_p = _scaled(np.where(np.isfinite(h_tpot[pos]), h_tpot[pos], 0.0))
            blended = a * np.nan_to_num(n_t, nan=0.5) + b * np.nan_to_num(n_p, nan=0.5)
            w[pos] = np.floor((1.0 - blended) * POSITIVE_RANGE) + 2
        neg = np.flatnonzero(~positive)
        if neg.size:
            idle = [i for i in neg.tolist() if cands[i].view.num_running == 0]
            pool = np.array(idle if idle else neg.tolist())
            d_t = np.maximum(0.0, -h_ttft[pool])
            d_p = np.maximum(0.0, -np.where(np.isfinite(h_tpot[pool]), h_tpot[pool], 0.0))
            for cls in ((d_t > 0) & (d_p > 0), (d_t > 0) & (d_p == 0), (d_t == 0) & (d_p > 0)):
                k = np.flatnonzero(cls)
                if k.size:
                    n_t = np.nan_to_num(_scaled(d_t[k]), nan=0.0)
                    n_p = np.nan_to_num(_scaled(d_p[k]), nan=0.0)
                    w[pool[k]] = np.floor((1.0 - (a * n_t + b * n_p)) * NEGATIVE_RANGE) + 2
            rest = (d_t == 0) & (d_p == 0)
            w[pool[rest]] = 1.0
        return w, positive

    def _draw(self, w: np.ndarray, members: np.ndarray) -> int:
        p = w[members] / w[members].sum()
        return int(members[self.rng.choice(len(members), p=p)])

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        ttft, tpot = self.predictions(req, cands, now)
        w, positive = self.weights(req, cands, ttft, tpot)
        pos = np.flatnonzero(positive & (w > 0))
        neg = np.flatnonzero(~positive & (w > 0))
        if pos.size and (not neg.size or self.rng.random() >= 1.0 - POSITIVE_SHARE):
            i = self._draw(w, pos)
        else:
            i = self._draw(w, neg)
        return Decision(i, float(ttft[i]))

    def describe(self, req: RoutingRequest, cands: list[Candidate], now: float,
                 chosen: int) -> Described:
        ttft, tpot = self.predictions(req, cands, now)
        w, positive = self.weights(req, cands, ttft, tpot)
        return Described({"forecast_ttft_s": ttft.tolist(), "forecast_tpot_s": tpot.tolist(),
                          "positive_headroom": positive.tolist(), "weight": w.tolist()},
                         "weight", "higher",
                         "drawn from the pods with TTFT and TPOT headroom (99%), favouring the "
                         "least blended headroom" if positive[chosen] else
                         "no pod drawn has headroom: drawn favouring the least deficit")
