"""The prompt-token estimate every server here shares, and a request's prompt text.

Neither the emulator nor the gateway needs a tokenizer: a prompt's length in tokens is
estimated as ``ceil(characters / 4)`` (at least 1) for text, the list's length for token ids,
and for chat ``3 + Σ (4 + tokens(content))`` over the messages (role and template overhead, as
OpenAI's cookbook counts it). It is cheap (no round trip, no model files) and the two sides
agree, so the gateway's shadow state sees the same prompt lengths as the emulator. Against a
real vLLM the estimate is off by the tokenizer's ratio (English prose is ~4 characters per
token for Qwen3); the gateway can count exactly with a tokenizer (docs/gateway.md).
"""

from __future__ import annotations

import math
from typing import Any

CHARS_PER_TOKEN = 4


def text_tokens(text: str) -> int:
    """Estimated tokens of a text: ceil(characters / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def content_text(content: Any) -> str:
    """A chat message's text: the string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # a list of parts: [{"type": "text", "text": ...}, {"type": "image_url", ...}]
    return "".join(p.get("text", "") for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))


def chat_tokens(messages: list[dict[str, Any]]) -> int:
    """Estimated prompt tokens of chat messages: 3 + Σ (4 + tokens(content))."""
    total = 3
    for m in messages:
        text = content_text(m.get("content"))
        total += 4 + (math.ceil(len(text) / CHARS_PER_TOKEN) if text else 0)
    return total
