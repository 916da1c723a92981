"""Online correction of an instance's TTFT forecasts: what the instance really did corrects
what the model says it will do.

Why: a calibration is fitted once, on an idle server; the server then drifts (the same 512-token
prefill step took 151–228 ms within one run on the e2e machine) and a fixed model's error is
amplified by queueing (docs/gateway.md, "Validating"). So every observed first token teaches
the instance's correction: the ratio of the observed TTFT to the model's *raw* forecast
(the forecast before correction) joins a window of the last ``window`` ratios, and the factor
is their median, bounded to ``[low, high]``, once ``min_samples`` ratios are in (1 before).
A median over a window is robust to the few requests that a paused process makes many times
slower, does not wander on a stable instance (it moves only when most recent ratios move),
and follows a drift within about half a window of requests.

One implementation serves the gateway (:class:`~duetime.estimate.sfs.SfsEstimator` multiplies
its TTFT forecast by the view's ``ttft_correction`` factor, when the view has one) and
``duetime validate``'s replay (each request's prediction corrected with only the ratios of
requests whose first token came before it arrived).
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class TtftCorrection:
    """A bounded multiplicative correction learnt from observed / raw-forecast TTFT ratios."""

    __slots__ = ("_ratios", "enabled", "high", "low", "min_samples", "observed")

    def __init__(self, *, window: int = 32, min_samples: int = 8, low: float = 0.25,
                 high: float = 4.0, enabled: bool = True) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        if not 0 < low <= 1 <= high:
            raise ValueError(f"need 0 < low <= 1 <= high, got {low}, {high}")
        self._ratios: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self.low, self.high = low, high
        self.enabled = enabled
        self.observed = 0

    @property
    def factor(self) -> float:
        """What to multiply a raw forecast by (1 while disabled or still learning)."""
        r = self._ratios
        if not self.enabled or len(r) < self.min_samples:
            return 1.0
        s = sorted(r)
        n = len(s)
        med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
        return min(self.high, max(self.low, med))

    def observe(self, raw_forecast_s: float, observed_s: float) -> None:
        """A request's first token came ``observed_s`` after the decision that forecast
        ``raw_forecast_s`` (uncorrected) for it."""
        if raw_forecast_s > 0 and observed_s > 0 and math.isfinite(raw_forecast_s) \
                and math.isfinite(observed_s):
            self._ratios.append(observed_s / raw_forecast_s)
            self.observed += 1

    def reset(self) -> None:
        self._ratios.clear()

    def learn_from(self, other: TtftCorrection) -> None:
        """Start from what ``other`` learnt (a new replica of the same model on the same
        hardware is likely off the same way; its own first tokens replace these)."""
        self._ratios.clear()
        self._ratios.extend(other.ratios())

    def ratios(self) -> list[float]:
        """The observed / forecast ratios it learns from, oldest first."""
        return list(self._ratios)


def correction_factor(view: object) -> float:
    """The view's TTFT correction factor (its ``ttft_correction``), 1 where it has none."""
    c = getattr(view, "ttft_correction", None)
    return 1.0 if c is None else c.factor


SETTLE_MOVE = 0.01  # a replica's step factor changes when the learnt one moved this much


class StepCorrection:
    """A bounded multiplicative correction of an instance's step time, learnt from the tokens
    it streams: over each stretch of at least ``steps_per_sample`` steps (observed decode
    tokens per stream), how many tokens the replica (stepping with the model as corrected so
    far) produced for the same requests in the same time, against how many the instance did.
    The factor is the median of the last ``window`` samples, bounded to ``[low, high]``, once
    ``min_samples`` are in (1 before): what to multiply the model's step time by.

    Why beside the TTFT correction: that one scales whole forecasts and learns only from
    first tokens, so a queue of decoding requests is priced with the idle-server step time
    until enough first tokens arrive; loaded steps on vLLM's CPU backend cost 2-15% off what
    the idle probes say (issue 31's measurements), and on a shared machine drift with the
    load next door. Corrected step times move the replica's queue itself.

    Why a sample spans steps, not tokens: the replica and the instance are compared at one
    moment, when either may stand one step ahead of the other, and that step is the same for
    every stream of the batch -- over a stretch of k steps the sample is off by up to 1/k
    whatever the batch size, where 32 tokens summed over a batch of 30 would be one or two
    steps. (On the simulator, whose views are compared at decisions a fraction of a second
    apart, both rules gave samples as tight: 5th percentile 1.257 and 1.259, median 1.300 and
    1.298, for a pool 1.3x slower; the rule is for the gateway's 20 ms token syncs.)

    One implementation serves the gateway's shadow replicas
    (:class:`~duetime.gateway.state.shadow.ShadowReplica`), the simulator's router views
    (:class:`~duetime.sim.router_view.RouterView`) and ``duetime validate``'s replay.
    """

    __slots__ = ("_obs", "_samples", "_sim", "_steps", "applied", "high", "low", "min_samples",
                 "steps_per_sample")

    def __init__(self, *, window: int = 16, min_samples: int = 3, steps_per_sample: int = 32,
                 low: float = 0.25, high: float = 4.0) -> None:
        if window < 1 or not 1 <= min_samples <= window or steps_per_sample < 1:
            raise ValueError(f"need 1 <= min_samples <= window and steps_per_sample >= 1, "
                             f"got {min_samples}, {window}, {steps_per_sample}")
        self._samples: deque[float] = deque(maxlen=window)
        self.min_samples, self.steps_per_sample = min_samples, steps_per_sample
        self.low, self.high = low, high
        self.applied = 1.0  # the factor the replica steps with now
        self._sim = self._obs = 0  # tokens of the stretch so far: the replica's, the instance's
        self._steps = 0.0  # ... and its length in steps

    @property
    def factor(self) -> float:
        s = self._samples
        if len(s) < self.min_samples:
            return 1.0
        return min(self.high, max(self.low, statistics.median(s)))

    def observe(self, replica_tokens: int, observed_tokens: int, streams: int = 1) -> None:
        """Over one interval the replica (stepping with :attr:`applied`) produced
        ``replica_tokens`` for the ``streams`` requests the instance produced
        ``observed_tokens`` for."""
        if replica_tokens < 0 or observed_tokens < 0 or streams < 1:
            return
        self._sim += replica_tokens
        self._obs += observed_tokens
        self._steps += observed_tokens / streams
        if self._steps >= self.steps_per_sample and self._sim > 0:
            self._samples.append(self.applied * self._sim / self._obs)
            self._sim = self._obs = 0
            self._steps = 0.0

    def settle(self) -> float | None:
        """The factor a replica should now step with, when it moved by more than
        ``SETTLE_MOVE`` from :attr:`applied` (which it becomes); else None (a replica keeps
        its model: re-pricing its queue for every small wobble would cost a model change per
        sync and buy nothing measurable)."""
        factor = self.factor
        if abs(factor / self.applied - 1.0) <= SETTLE_MOVE:
            return None
        self.applied = factor
        return factor
