"""Scheduler configuration of one vLLM instance (the knobs the V1 scheduler reads)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The V1 scheduler's limits. Defaults follow the snapshot format's example.

    ``long_prefill_token_threshold`` of 0 means "off", as in vLLM.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    block_size: int = 16
    num_gpu_blocks: int = 100_000
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "num_gpu_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name}: must be a positive integer, got {value!r}")
        thr = self.long_prefill_token_threshold
        if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
            raise ValueError(
                f"config.long_prefill_token_threshold: must be an integer >= 0, got {thr!r}")

    @property
    def chunk_cap(self) -> int:
        """Largest chunk one request may get in a step (the threshold, or the whole budget)."""
        thr = self.long_prefill_token_threshold
        return thr if 0 < thr < self.max_num_batched_tokens else self.max_num_batched_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
