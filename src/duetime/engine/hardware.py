"""What a model instance runs on: the GPU catalogue, the models' architectures, and a
deployment option (model, GPU, tensor-parallel size).

The catalogue (``profiles/gpus.yaml``) holds each GPU's published memory, dense BF16 FLOPs,
memory bandwidth and a list price per hour, with their sources; the architectures
(``profiles/models.yaml``) hold what scales a model's work: its parameters, layers, attention
heads. :mod:`duetime.engine.derive` reads both to derive a profile for hardware nobody
measured; a capacity plan prices its pools by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import cache
from importlib.resources import files

import yaml

BYTES_PER_PARAM = 2  # bf16 weights


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU type: datasheet figures (decimal units, as published) and a list price."""

    name: str
    description: str
    memory_gb: float
    bf16_tflops: float
    bandwidth_tbps: float
    price_per_hour: float

    @property
    def flops(self) -> float:
        """Dense BF16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        """Memory bandwidth, bytes/s."""
        return self.bandwidth_tbps * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True, slots=True)
class ModelArch:
    """What scales a model's work per token: weights, attention shape, KV cache size."""

    name: str
    params: float
    params_non_embedding: float
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool

    @property
    def weight_bytes(self) -> float:
        """The weights held in GPU memory."""
        return self.params * BYTES_PER_PARAM

    @property
    def active_params(self) -> float:
        """Parameters every token multiplies by (and a step reads once): the layers and the
        output head (the embedding table is looked up, not multiplied)."""
        return self.params_non_embedding + self.vocab_size * self.hidden_size

    @property
    def attention_width(self) -> int:
        """Attention's products per pair of tokens scale by layers x query heads x head dim."""
        return self.num_layers * self.num_q_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (bf16)."""
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * BYTES_PER_PARAM


@dataclass(frozen=True, slots=True)
class Option:
    """A deployment option: ``model`` on ``tp`` GPUs of type ``gpu`` (one replica)."""

    model: str
    gpu: str
    tp: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tensor-parallel size: must be an integer >= 1, got {self.tp!r}")

    @property
    def name(self) -> str:
        """``model@gpu`` or ``model@gpuxN`` (N GPUs with tensor parallelism)."""
        return f"{self.model}@{self.gpu}" + (f"x{self.tp}" if self.tp > 1 else "")

    @classmethod
    def parse(cls, text: str) -> Option:
        """``MODEL@GPU[xN]``, e.g. ``qwen3-8b@l40s`` or ``qwen3-32b@h100x2``."""
        model, sep, hw = text.partition("@")
        if not sep or not model or not hw:
            raise ValueError(f"{text!r}: want MODEL@GPU or MODEL@GPUxN (e.g. qwen3-32b@h100x2)")
        gpu, tp = hw, 1
        head, x, tail = hw.rpartition("x")
        if x and head and tail.isdigit():
            gpu, tp = head, int(tail)
        return cls(model, gpu, tp)

    def price_per_hour(self, prices: Mapping[str, float] | None = None) -> float:
        """USD per hour of one replica: its GPUs at the catalogue's (or ``prices``') rate."""
        return self.tp * gpu(self.gpu, prices).price_per_hour


def _read(resource: str) -> dict:
    return yaml.safe_load(files("duetime.engine.profiles").joinpath(resource).read_text())


@cache
def _gpus() -> dict[str, Gpu]:
    return {name: Gpu(name, **d) for name, d in _read("gpus.yaml").items()}


@cache
def _archs() -> dict[str, ModelArch]:
    names = {f.name for f in fields(ModelArch)}
    out = {}
    for name, d in _read("models.yaml").items():
        assert set(d) <= names, f"models.yaml: {name}: unknown fields {set(d) - names}"
        out[name] = ModelArch(name, **{k: (float(v) if k.startswith("params") else v)
                                       for k, v in d.items()})
    return out


def gpu_names() -> list[str]:
    return list(_gpus())


def gpu(name: str, prices: Mapping[str, float] | None = None) -> Gpu:
    """A catalogue GPU by name, at ``prices[name]`` USD per hour where given."""
    try:
        g = _gpus()[name]
    except KeyError:
        raise KeyError(f"unknown GPU {name!r}; the catalogue has {', '.join(_gpus())}") from None
    if prices and name in prices:
        price = prices[name]
        if isinstance(price, bool) or not isinstance(price, int | float) or not price >= 0:
            raise ValueError(f"price of {name}: must be a number >= 0 (USD per GPU-hour), "
                             f"got {price!r}")
        g = replace(g, price_per_hour=float(price))
    return g


def model_names() -> list[str]:
    return list(_archs())


def model_arch(name: str) -> ModelArch:
    try:
        return _archs()[name]
    except KeyError:
        raise KeyError(f"no architecture for model {name!r}; known: "
                       f"{', '.join(_archs())}") from None
