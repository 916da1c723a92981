"""Scheduler configuration of one vLLM instance (the knobs the V1 scheduler reads)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

NULL_BLOCKS = 1  # vLLM's BlockPool keeps one block back (the null block): never allocated


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The V1 scheduler's limits, with vLLM's names and defaults (the snapshot format's
    example for the sizes).

    ``long_prefill_token_threshold`` of 0 means "off", as in vLLM. ``num_gpu_blocks`` is what
    vLLM reports (``vllm:cache_config_info``); one of them is the null block, so
    ``usable_blocks`` = ``num_gpu_blocks`` - 1 hold tokens. ``scheduler_reserve_full_isl``
    (vLLM's default: on) admits a waiting request only if blocks for its whole sequence fit;
    ``watermark`` keeps that fraction of ``num_gpu_blocks`` free when admitting waiting or
    preempted requests while others run; ``async_scheduling`` schedules step k+1 before step
    k's output is applied (vLLM's default on GPUs; the CPU platform turns it off);
    ``enable_prefix_caching`` reuses cached full blocks of shared prefixes (vLLM's default is on;
    here off, the form of snapshots of version 1, until a caller gives the requests' block
    hashes); ``max_loras`` > 0 is vLLM's ``--enable-lora --max-loras``: at most that many
    distinct LoRA adapters in one step, a waiting request whose adapter would exceed it is
    skipped (0: LoRA off, vLLM without ``--enable-lora``; adapters are then not capped).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    block_size: int = 16
    num_gpu_blocks: int = 100_000
    long_prefill_token_threshold: int = 0
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "num_gpu_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name}: must be a positive integer, got {value!r}")
        if self.num_gpu_blocks <= NULL_BLOCKS:
            raise ValueError(f"config.num_gpu_blocks: must be at least {NULL_BLOCKS + 1} (one "
                             f"is vLLM's null block), got {self.num_gpu_blocks}")
        thr = self.long_prefill_token_threshold
        if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
            raise ValueError(
                f"config.long_prefill_token_threshold: must be an integer >= 0, got {thr!r}")
        loras = self.max_loras
        if not isinstance(loras, int) or isinstance(loras, bool) or loras < 0:
            raise ValueError(f"config.max_loras: must be an integer >= 0 (0: LoRA off), got "
                             f"{loras!r}")
        for name in ("scheduler_reserve_full_isl", "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name}: must be true or false, got "
                                 f"{getattr(self, name)!r}")
        wm = self.watermark
        if isinstance(wm, bool) or not isinstance(wm, int | float) or not 0.0 <= wm < 1.0:
            raise ValueError(f"config.watermark: must be a number in [0, 1), got {wm!r}")

    @property
    def chunk_cap(self) -> int:
        """Largest chunk one request may get in a step (the threshold, or the whole budget)."""
        thr = self.long_prefill_token_threshold
        return thr if 0 < thr < self.max_num_batched_tokens else self.max_num_batched_tokens

    @property
    def usable_blocks(self) -> int:
        """KV blocks that can hold tokens (all but the null block)."""
        return self.num_gpu_blocks - NULL_BLOCKS

    @property
    def watermark_blocks(self) -> int:
        """Blocks kept free when admitting waiting requests while others run (vLLM's
        ``int(watermark * num_blocks)``)."""
        return int(self.watermark * self.num_gpu_blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_size

    def refusal(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """Why this instance can never serve a request (vLLM's 400), or None: it does not fit
        ``max_model_len``, or its whole sequence — up to ``max_tokens``, by default up to
        ``max_model_len`` as in vLLM — needs more KV blocks than the instance has (it would
        block the queue for ever; vLLM refuses to start when ``max_model_len`` does not fit
        its cache)."""
        limit = self.max_model_len
        need = prompt_tokens + (max_tokens or 1)
        if need > limit:
            return (f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {need} tokens ({prompt_tokens} in the messages, "
                    f"{max_tokens or 1} in the completion). Please reduce the length of the "
                    "messages or completion.")
        out = max_tokens if max_tokens is not None else limit - prompt_tokens
        kv = prompt_tokens + out - 1  # the last token is sampled, never stored
        if -(-kv // self.block_size) > self.usable_blocks:
            return (f"This request needs {kv} tokens of KV cache ({prompt_tokens} in the "
                    f"messages, up to {out} in the completion), more than the instance's "
                    f"{self.kv_capacity_tokens} ({self.usable_blocks} blocks of "
                    f"{self.block_size}). Please reduce the length of the messages or "
                    "completion.")
        return None

    def to_dict(self) -> dict[str, int | float | bool]:
        """The fields by name; ``max_loras`` only when LoRA is on (the form before it)."""
        out = asdict(self)
        if not self.max_loras:
            del out["max_loras"]
        return out
