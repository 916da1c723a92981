"""Batch-time models: a step's duration as a linear function of its composition.

Both models are linear in integer features of the batch, so the reference loop and the fast
replay compute *the same integers* and the same float formula: their step durations agree to the
last bit, and a stretch of identical decode steps sums in closed form (``stretch``).

Features of one batch (sums over the requests scheduled in the step):

==========  ===============================================================
n_dec       decode tokens (one per decoding request)
n_pre       prefill tokens scheduled
pre_sq      sum of pre**2
pre_attn    sum of pre*c + pre*(pre+1)/2 (c = computed tokens before the step)
dec_ctx     sum of c over decoding requests
len_sum     sum of L = prompt + output tokens so far, over all scheduled requests
len_sq      sum of L**2
==========  ===============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class BatchTimeModel:
    """Base class: a named feature set with coefficients (seconds per unit)."""

    name: ClassVar[str] = ""
    coefficient_names: ClassVar[tuple[str, ...]] = ()

    def duration(self, n_dec: int, n_pre: int, pre_sq: int, pre_attn: int, dec_ctx: int,
                 len_sum: int, len_sq: int) -> float:
        """Seconds for one non-empty step with these features."""
        raise NotImplementedError  # pragma: no cover - abstract

    def stretch(self, n: int, s1: int, s2: int, m: int) -> float:
        """Seconds for ``m`` consecutive decode-only steps of ``n`` decoding requests.

        At the first step the decoders' contexts sum to ``s1`` and their squares to ``s2``;
        every step adds one token to each context.
        """
        raise NotImplementedError  # pragma: no cover - abstract

    @property
    def coefficients(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.coefficient_names}

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.name, "coefficients": self.coefficients}


@dataclass(frozen=True, slots=True)
class Paper4(BatchTimeModel):
    """SFS paper eq. 11: ``b0 + b1·Σ(pre+dec) + b2·Σ c·dec + b3·Σ(pre·c + pre(pre+1)/2)``."""

    b0: float
    b1: float
    b2: float
    b3: float

    name: ClassVar[str] = "paper4"
    coefficient_names: ClassVar[tuple[str, ...]] = ("b0", "b1", "b2", "b3")

    def duration(self, n_dec: int, n_pre: int, pre_sq: int, pre_attn: int, dec_ctx: int,
                 len_sum: int, len_sq: int) -> float:
        return self.b0 + self.b1 * (n_pre + n_dec) + self.b2 * dec_ctx + self.b3 * pre_attn

    def stretch(self, n: int, s1: int, s2: int, m: int) -> float:
        # Σ_j (s1 + j·n) for j < m
        ctx = m * s1 + n * (m * (m - 1) // 2)
        return m * (self.b0 + self.b1 * n) + self.b2 * ctx


@dataclass(frozen=True, slots=True)
class Sfs6(BatchTimeModel):
    """Released SFS code ("legacy"): ``c0 + cp·P + cpsq·Σpre² + cd·D + cs·ΣL + css·ΣL²``."""

    c0: float
    cp: float
    cpsq: float
    cd: float
    cs: float
    css: float

    name: ClassVar[str] = "sfs6"
    coefficient_names: ClassVar[tuple[str, ...]] = ("c0", "cp", "cpsq", "cd", "cs", "css")

    def duration(self, n_dec: int, n_pre: int, pre_sq: int, pre_attn: int, dec_ctx: int,
                 len_sum: int, len_sq: int) -> float:
        return (self.c0 + self.cp * n_pre + self.cpsq * pre_sq + self.cd * n_dec
                + self.cs * len_sum + self.css * len_sq)

    def stretch(self, n: int, s1: int, s2: int, m: int) -> float:
        # A decoder's L is its context + 1; at step j its context is c + j.
        # Σ_j Σ_i (c_i + j + 1) and Σ_j Σ_i (c_i + j + 1)² for j < m, in exact integers.
        tri = m * (m + 1) // 2
        sq = m * (m + 1) * (2 * m + 1) // 6
        lsum = m * s1 + n * tri
        lsq = m * s2 + 2 * s1 * tri + n * sq
        return m * (self.c0 + self.cd * n) + self.cs * lsum + self.css * lsq


MODELS: dict[str, type[BatchTimeModel]] = {Paper4.name: Paper4, Sfs6.name: Sfs6}


def model_from_dict(d: Mapping[str, Any], where: str = "batch_time") -> BatchTimeModel:
    """Build a model from ``{"model": name, "coefficients": {...}}``; errors name the field."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be an object with 'model' and 'coefficients'")
    name = d.get("model")
    if name not in MODELS:
        raise ValueError(f"{where}.model: unknown batch-time model {name!r}; "
                         f"expected one of {sorted(MODELS)}")
    cls = MODELS[name]
    coeffs = d.get("coefficients")
    if not isinstance(coeffs, Mapping):
        raise ValueError(f"{where}.coefficients: must be an object of numbers")
    missing = [k for k in cls.coefficient_names if k not in coeffs]
    extra = [k for k in coeffs if k not in cls.coefficient_names]
    if missing:
        raise ValueError(f"{where}.coefficients: missing {missing} for model {name!r}")
    if extra:
        raise ValueError(f"{where}.coefficients: unknown {extra} for model {name!r} "
                         f"(expected {list(cls.coefficient_names)})")
    values = {}
    for k in cls.coefficient_names:
        v = coeffs[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v in (
                float("inf"), float("-inf")):
            raise ValueError(f"{where}.coefficients.{k}: must be a finite number, got {v!r}")
        if v < 0:
            raise ValueError(f"{where}.coefficients.{k}: must be >= 0 (a step cannot get "
                             f"faster with more work), got {v!r}")
        values[k] = float(v)
    return cls(**values)
