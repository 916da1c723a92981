"""Arrival processes: when requests arrive (open loop), from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Poisson:
    """Exponential inter-arrival times at ``rate`` requests per second."""

    rate: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate, n))


@dataclass(frozen=True, slots=True)
class Deterministic:
    """Evenly spaced arrivals at ``rate`` requests per second."""

    rate: float

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return (np.arange(n) + 1.0) / self.rate


@dataclass(frozen=True, slots=True)
class MMPP2:
    """A two-state Markov-modulated Poisson process with mean ``rate``.

    The high state's rate is ``ratio`` x the low state's; the process spends ``high_fraction``
    of the time in it; ``correlation_time`` (s) = 1 / (total switching rate). Defaults are the
    released SFS code's (ratio 4, 20% high, 2 s).
    """

    rate: float
    ratio: float = 4.0
    high_fraction: float = 0.2
    correlation_time: float = 2.0

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        f, tau = self.high_fraction, self.correlation_time
        low = self.rate / (f * self.ratio + 1.0 - f)
        rates = (low, low * self.ratio)
        leave = ((f / tau), ((1.0 - f) / tau))  # switching rate out of low, out of high
        out = np.empty(n)
        t = 0.0
        state = int(rng.random() < f)
        i = 0
        while i < n:
            dwell = rng.exponential(1.0 / leave[state])
            end = t + dwell
            k = rng.poisson(rates[state] * dwell)
            if k:
                ts = np.sort(rng.uniform(t, end, k))[: n - i]
                out[i:i + len(ts)] = ts
                i += len(ts)
            t = end
            state = 1 - state
        return out


def make_arrivals(kind: str, rate: float, **kw) -> Poisson | Deterministic | MMPP2:
    """``poisson``, ``deterministic`` or ``mmpp2`` (keyword args: ratio, high_fraction,
    correlation_time)."""
    if rate <= 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    if kind == "poisson":
        return Poisson(rate)
    if kind == "deterministic":
        return Deterministic(rate)
    if kind == "mmpp2":
        return MMPP2(rate, **kw)
    raise ValueError(f"arrivals: unknown process {kind!r} (poisson, deterministic, mmpp2)")
