"""Batch-time models: a step's duration as a linear function of its composition.

Both models are linear in integer features of the batch, so the reference loop and the compiled
replay compute *the same integers* and the same float sum: their step durations agree to the
last bit.

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

LoRA. On an instance with adapters (``max_loras``), a step that holds any request on an adapter
costs ``lora_step + lora_prefill·n_pre + lora_decode·n_dec`` more, over *all* its tokens,
base-model ones too: measured on vLLM's CPU build (``benchmarks/lora_cost_vllm.py``), the
adapter kernels run over every token of such a step, whatever the number of distinct adapters
(1 adapter + 3 base requests cost as 4 on the adapter; k distinct adapters as one); loading an
adapter costs under half a decode step once, so it is not a term. Every model has the three
coefficients, 0 unless fitted (``duetime calibrate --lora``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

LORA_COEFFICIENTS = ("lora_step", "lora_prefill", "lora_decode")
# (what bounds each on a GPU: see BatchTimeModel.term_kinds)
LORA_TERM_KINDS = {"lora_step": "step", "lora_prefill": "compute", "lora_decode": "compute"}


@dataclass(frozen=True)
class BatchTimeModel:
    """Base class: a named feature set with coefficients (seconds per unit).

    Every model is ``w0 + Σ w_i · feature_i`` over the seven features above, in that order;
    :attr:`weights` gives ``(w0, w_n_dec, w_n_pre, w_pre_sq, w_pre_attn, w_dec_ctx, w_len_sum,
    w_len_sq)``. The reference loop and the compiled replay evaluate exactly this sum, in this
    order, so their step durations are bit-identical; a step holding a LoRA request then adds
    :meth:`lora_duration` (module doc), in the same order in both.
    """

    # a step that holds a request on a LoRA adapter (module doc); keyword-only, default 0
    lora_step: float = field(default=0.0, kw_only=True)
    lora_prefill: float = field(default=0.0, kw_only=True)
    lora_decode: float = field(default=0.0, kw_only=True)

    name: ClassVar[str] = ""
    coefficient_names: ClassVar[tuple[str, ...]] = ()
    # what bounds each coefficient's work on a GPU, for a profile derived on other hardware
    # (duetime.engine.derive): "step" (a step's fixed cost: host overhead plus one read of the
    # weights), "compute" (matrix products, per token: the weights' FLOPs), "attention" (the
    # attention's products over token pairs), "kv" (reading the KV cache, per cached token)
    term_kinds: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", self._weights())
        object.__setattr__(self, "lora_weights",
                           (self.lora_step, self.lora_prefill, self.lora_decode))

    def _weights(self) -> tuple[float, ...]:
        raise NotImplementedError  # pragma: no cover - abstract

    def duration(self, n_dec: int, n_pre: int, pre_sq: int, pre_attn: int, dec_ctx: int,
                 len_sum: int, len_sq: int) -> float:
        """Seconds for one non-empty step with these features."""
        w = self.weights  # type: ignore[attr-defined]
        return (w[0] + w[1] * n_dec + w[2] * n_pre + w[3] * pre_sq + w[4] * pre_attn
                + w[5] * dec_ctx + w[6] * len_sum + w[7] * len_sq)

    def lora_duration(self, n_dec: int, n_pre: int) -> float:
        """Seconds a step with these decode and prefill tokens costs more when it holds a
        request on a LoRA adapter."""
        return self.lora_step + self.lora_prefill * n_pre + self.lora_decode * n_dec

    @property
    def prices_lora(self) -> bool:
        """Whether a step with LoRA costs more (any LoRA coefficient > 0)."""
        return any(self.lora_weights)  # type: ignore[attr-defined]

    @property
    def intercept(self) -> float:
        """Fixed cost of a non-empty step."""
        return self.weights[0]  # type: ignore[attr-defined]

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients by name; the LoRA ones only when fitted (> 0: the form before
        them otherwise)."""
        out = {k: getattr(self, k) for k in self.coefficient_names}
        if self.prices_lora:
            out.update({k: getattr(self, k) for k in LORA_COEFFICIENTS})
        return out

    def scaled(self, speed: float) -> BatchTimeModel:
        """The model of an instance ``speed`` times faster (every coefficient / ``speed``)."""
        if speed == 1.0:
            return self
        return type(self)(**{k: v / speed for k, v in self.coefficients.items()})

    def with_lora(self, step: float, prefill: float, decode: float) -> BatchTimeModel:
        """This model with these LoRA coefficients."""
        return type(self)(**{k: getattr(self, k) for k in self.coefficient_names},
                          lora_step=step, lora_prefill=prefill, lora_decode=decode)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.name, "coefficients": self.coefficients}


@dataclass(frozen=True)
class Paper4(BatchTimeModel):
    """SFS paper eq. 11: ``b0 + b1·Σ(pre+dec) + b2·Σ c·dec + b3·Σ(pre·c + pre(pre+1)/2)``."""

    b0: float
    b1: float
    b2: float
    b3: float

    name: ClassVar[str] = "paper4"
    coefficient_names: ClassVar[tuple[str, ...]] = ("b0", "b1", "b2", "b3")
    term_kinds: ClassVar[dict[str, str]] = {"b0": "step", "b1": "compute", "b2": "kv",
                                            "b3": "attention", **LORA_TERM_KINDS}

    def _weights(self) -> tuple[float, ...]:
        return (self.b0, self.b1, self.b1, 0.0, self.b3, self.b2, 0.0, 0.0)


@dataclass(frozen=True)
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
    term_kinds: ClassVar[dict[str, str]] = {"c0": "step", "cp": "compute",
                                            "cpsq": "attention", "cd": "compute", "cs": "kv",
                                            "css": "attention", **LORA_TERM_KINDS}

    def _weights(self) -> tuple[float, ...]:
        return (self.c0, self.cd, self.cp, self.cpsq, 0.0, 0.0, self.cs, self.css)


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
    extra = [k for k in coeffs if k not in cls.coefficient_names and k not in LORA_COEFFICIENTS]
    if missing:
        raise ValueError(f"{where}.coefficients: missing {missing} for model {name!r}")
    if extra:
        raise ValueError(f"{where}.coefficients: unknown {extra} for model {name!r} "
                         f"(expected {list(cls.coefficient_names)}, optionally "
                         f"{list(LORA_COEFFICIENTS)})")
    values = {}
    for k in (*cls.coefficient_names, *(c for c in LORA_COEFFICIENTS if c in coeffs)):
        v = coeffs[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v in (
                float("inf"), float("-inf")):
            raise ValueError(f"{where}.coefficients.{k}: must be a finite number, got {v!r}")
        if v < 0:
            raise ValueError(f"{where}.coefficients.{k}: must be >= 0 (a step cannot get "
                             f"faster with more work), got {v!r}")
        values[k] = float(v)
    return cls(**values)
