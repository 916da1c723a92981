"""What an estimator may look at: an instance's live view."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from duetime.engine.forecasting import Forecaster, forecaster
from duetime.engine.snapshot import Snapshot


@dataclass(slots=True)
class InstanceStats:
    """Time-averaged observations of an instance (what a metrics scraper can know)."""

    elapsed_s: float = 0.0        # observation window
    arrivals: int = 0             # requests sent to it in the window
    ttft_s_sum: float = 0.0       # Σ first-token latency of its requests that got one
    ttft_count: int = 0
    e2e_s_sum: float = 0.0        # Σ end-to-end latency of its finished requests
    e2e_count: int = 0
    prompt_tokens_sum: int = 0    # Σ prompt tokens of its requests in the window
    output_tokens_sum: int = 0    # Σ output tokens of its finished requests

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_ttft(self) -> float:
        return self.ttft_s_sum / self.ttft_count if self.ttft_count else 0.0

    @property
    def mean_e2e(self) -> float:
        return self.e2e_s_sum / self.e2e_count if self.e2e_count else 0.0

    @property
    def mean_prompt(self) -> float:
        return self.prompt_tokens_sum / self.arrivals if self.arrivals else 0.0

    @property
    def mean_output(self) -> float:
        return self.output_tokens_sum / self.e2e_count if self.e2e_count else 0.0


class InstanceView(Protocol):
    """The live state of one instance, as the router sees it.

    A view may also carry a ``prefix_index`` attribute (a
    :class:`~duetime.estimate.prefix_index.PrefixIndex`: its prefix cache as the router knows
    it); it is not part of the protocol, so read it with
    :func:`~duetime.estimate.prefix_index.prefix_index_of` (``None`` where absent)."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def stats(self) -> InstanceStats: ...

    @property
    def request_overhead_s(self) -> float:
        """Time a request spends outside the engine loop before its first token reaches the
        router (HTTP, tokenisation, detokenisation): added to the engine's forecast. 0 in
        simulation; calibrated per instance for a real server (``duetime calibrate``)."""
        ...

    def snapshot(self) -> Snapshot: ...


def forecaster_of(view: InstanceView) -> Forecaster:
    """The forecaster of the view's current state: the view's own (a ``forecaster()``
    method: one its engine keeps across decisions, :mod:`duetime.engine.live_forecast`) where
    it has one, else its snapshot's. Either answers as ``forecast(view.snapshot(), ...)``."""
    own = getattr(view, "forecaster", None)
    return own() if own is not None else forecaster(view.snapshot())


# a request's prompt block keys for a block size (see RoutingRequest.prompt_hashes)
PromptHashes = Callable[[int], Sequence[int]]


class KeysByBlockSize:
    """A prompt's block keys per block size, each size computed once (by ``keys``) and kept as
    an int64 array (what the forecasts take without a conversion): a ``PromptHashes``."""

    __slots__ = ("_by_size", "_keys")

    def __init__(self, keys: Callable[[int], Sequence[int] | np.ndarray]) -> None:
        self._keys = keys
        self._by_size: dict[int, np.ndarray] = {}

    def __call__(self, block_size: int) -> np.ndarray:
        got = self._by_size.get(block_size)
        if got is None:
            got = self._by_size[block_size] = np.asarray(self._keys(block_size),
                                                         dtype=np.int64)
        return got


class Estimator(Protocol):
    """Forecast seconds from ``now`` until a new request's first token at an instance."""

    name: str

    def ttft(self, view: InstanceView, prompt_tokens: int, now: float, *,
             hashes: PromptHashes | None = None, lora: int = 0) -> float:
        """``hashes``: the request's prompt block keys for a block size (with prefix caching,
        an estimator that replays the cache uses them; the others ignore them). ``lora``: the
        request's adapter (an estimator that replays the ``max_loras`` cap uses it)."""
        ...


def lora_kw(lora: int) -> dict[str, int]:
    """``{"lora": lora}`` for a request on an adapter, else nothing: an estimator written
    before adapters (without the keyword) still serves base-model requests."""
    return {"lora": lora} if lora else {}


def with_gateway(view: object, ttft_s: float) -> float:
    """A TTFT forecast no shorter than the view's gateway delay (``gateway_delay_s``, where the
    view has one: the time the router's own loop needs for the work ahead of a request sent
    now, :mod:`duetime.gateway.state.load`). The client sees the first token once the engine
    has made it and the router's loop has got to it, whichever is later: the two run side by
    side, so adding them would count a loaded engine's queue twice. Where the loop is the later
    one every instance's forecast would be the same; a thousandth of the engine's forecast on
    top keeps the faster engine first (a tie would otherwise go to whichever the policy lists
    first, whatever its engine's queue)."""
    g = getattr(view, "gateway_delay_s", None)
    return ttft_s if g is None or g <= ttft_s else g + GATEWAY_TIE * ttft_s


GATEWAY_TIE = 1e-3  # (see with_gateway)

