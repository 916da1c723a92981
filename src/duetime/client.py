"""A small client for retry-until-correct against the duetime gateway.

The retry contract is stateless on the server: each response names the model that answered
(``x-duetime-model``); a retry sends the models already tried (``x-duetime-attempted``,
comma-separated), so retry-aware policies (``laar``, ``ttca``) can avoid a model that already
failed this request (decoding is deterministic: it would fail again). Time to the correct
answer (TTCA) is the sum of the attempts' latencies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class Attempt:
    model: str
    instance: str
    latency_s: float
    text: str
    correct: bool


@dataclass(slots=True)
class Outcome:
    """The attempts made, in order; ``answer`` is the first correct text (or None)."""

    attempts: list[Attempt] = field(default_factory=list)

    @property
    def answer(self) -> str | None:
        return self.attempts[-1].text if self.attempts and self.attempts[-1].correct else None

    @property
    def ttca_s(self) -> float:
        """Σ latencies up to the first correct attempt (all of them if none was correct)."""
        return sum(a.latency_s for a in self.attempts)


def _text(body: dict[str, Any]) -> str:
    choice = (body.get("choices") or [{}])[0]
    if "message" in choice:
        return str((choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


def ask_until_correct(base_url: str, messages: list[dict[str, Any]],
                      correct: Callable[[str], bool], *, model: str = "auto",
                      max_attempts: int = 10, max_tokens: int | None = None,
                      session: str | None = None, ttft_ms: float | None = None,
                      client: httpx.Client | None = None, timeout_s: float = 600.0,
                      **extra: Any) -> Outcome:
    """Ask ``messages`` via ``base_url`` (``.../v1``) until ``correct(text)`` holds or
    ``max_attempts`` were made; every retry tells the router which models were tried."""
    own = client is None
    http = client or httpx.Client(timeout=timeout_s)
    out = Outcome()
    tried: list[str] = []
    try:
        for _ in range(max_attempts):
            headers = {}
            if tried:
                headers["x-duetime-attempted"] = ",".join(dict.fromkeys(tried))
            if session:
                headers["x-session-id"] = session
            if ttft_ms is not None:
                headers["x-duetime-ttft-ms"] = str(ttft_ms)
            payload: dict[str, Any] = {"model": model, "messages": messages, **extra}
            if max_tokens is not None:
                payload["max_tokens"] = max_tokens
            t0 = time.perf_counter()
            resp = http.post(f"{base_url.rstrip('/')}/chat/completions", json=payload,
                             headers=headers)
            latency = time.perf_counter() - t0
            resp.raise_for_status()
            text = _text(resp.json())
            used = resp.headers.get("x-duetime-model") or str(resp.json().get("model", ""))
            ok = bool(correct(text))
            out.attempts.append(Attempt(used, resp.headers.get("x-duetime-instance", ""),
                                        latency, text, ok))
            if ok:
                break
            tried.append(used)
    finally:
        if own:
            http.close()
    return out
