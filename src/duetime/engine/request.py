"""One request's scheduling state, as vLLM's V1 scheduler sees it."""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class Request:
    """Mutable per-request state (``docs/scheduling-rules.md``, "A request and an instance").

    ``prompt`` P, ``output`` O (tokens produced so far), ``stop`` T (the output length it stops
    at: predicted in a forecast, true in a simulation), ``computed`` C (with asynchronous
    scheduling, tokens scheduled in a step whose output is not applied yet count), ``blocks``
    B (KV blocks held). ``first_token`` / ``finished`` are stamped with the end time of the step
    that made them.

    With prefix caching, ``hashes`` are the keys of the full blocks of its sequence (prompt, then
    output, as far as the caller knows them; vLLM's chained block hashes, or any keys equal
    exactly when the tokens up to the block's end are); a full block past them gets a key of its
    own (``(id, index)``: nobody else can hit it, but the request itself can after a
    preemption). ``block_ids`` are the blocks it holds, in order, and ``num_cached`` how many of
    them are registered in the cache (the block ledger keeps both).

    ``lora`` is its LoRA adapter (vLLM's ``lora_int_id``; 0: the base model). With
    ``max_loras`` set, the scheduler caps the distinct adapters of one step
    (``docs/scheduling-rules.md``, "LoRA adapters"); with prefix caching the adapter is part of
    its block keys (the caller's: vLLM's hashes carry it as an extra key).
    """

    __slots__ = ("arrival", "block_ids", "blocks", "computed", "finished", "first_token",
                 "hashes", "id", "lora", "num_cached", "output", "pending", "prompt", "stale",
                 "stop")

    def __init__(self, id: str, prompt: int, stop: int, *, output: int = 0, computed: int = 0,
                 blocks: int = 0, arrival: float = 0.0,
                 hashes: Sequence[Hashable] = (), lora: int = 0) -> None:
        self.id = id
        self.prompt = prompt
        self.stop = stop
        self.output = output
        self.computed = computed
        self.blocks = blocks
        self.arrival = arrival
        self.lora = lora
        self.first_token: float | None = None
        self.finished: float | None = None
        # asynchronous scheduling: tokens scheduled for sampling whose output is not applied
        # yet (vLLM's num_output_placeholders), and whether the output in flight at a
        # preemption is stale (applied, but not counted against ``pending``)
        self.pending = 0
        self.stale = False
        self.hashes = hashes
        self.block_ids: list[int] = []
        self.num_cached = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.output

    @property
    def is_decoding(self) -> bool:
        return self.output >= 1 and self.prompt + self.output - self.computed == 1

    def __repr__(self) -> str:
        return (f"Request({self.id!r}, P={self.prompt}, O={self.output}, T={self.stop}, "
                f"C={self.computed}, B={self.blocks}"
                + (f", lora={self.lora})" if self.lora else ")"))
