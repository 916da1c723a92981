"""A streamed completion put back together as the one JSON body a non-streaming client expects.

The gateway always streams from upstream (to observe the first token), so a client that asked
``stream: false`` gets the chunks merged here. The oracle is vLLM's own non-streaming answer
(vLLM 0.32's ``chat_completion_full_generator`` and ``request_output_to_completion_response``):

* text deltas (``content``, ``reasoning``, ...; a completion's ``text``) are concatenated;
* ``tool_calls`` deltas are merged by their ``index``: the first delta of a call carries its
  ``id``, ``type`` and ``function.name``, every delta a piece of ``function.arguments``;
* ``logprobs`` lists are concatenated (chat: ``content``; completions: ``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset``, whose offsets vLLM already numbers
  across the whole output);
* ``token_ids`` (vLLM's ``return_token_ids``) are concatenated; ``prompt_token_ids`` (the first
  chunk's, top-level in chat, per choice in completions) and every other field the stream
  carries (``stop_reason``, ``system_fingerprint``, ``usage``, ...) are kept as last sent.

Fields that vLLM's non-streaming body holds as ``null`` and its stream leaves out (``refusal``,
``audio``, ``kv_transfer_params``, ...) are left out: the stream does not say which of them the
upstream's schema has, and ``null`` and absent mean the same to an OpenAI client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

_UNSET: Any = object()

# the keys of a chunk, or of one of its choices, that the reassembly handles itself; any other
# key with a value is relayed as the stream last gave it
_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage"})
_CHOICE_KEYS = frozenset({"index", "delta", "text", "logprobs", "finish_reason", "stop_reason",
                          "token_ids"})


@dataclass(slots=True)
class _Choice:
    """One choice's merged deltas."""

    index: int
    role: str | None = None
    texts: dict[str, list[str]] = field(default_factory=dict)  # delta key -> pieces
    message_extras: dict[str, Any] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by delta index
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: Any = _UNSET  # vLLM's: the stop string or token id that ended the output
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Reassembly:
    """Accumulates the chunks of one streamed (chat) completion; :meth:`body` is the answer."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    usage: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    choices: dict[int, _Choice] = field(default_factory=dict)

    def add(self, chunk: dict[str, Any]) -> None:
        """Merge one decoded stream chunk (the usage chunk included)."""
        self.id = self.id or chunk.get("id")
        self.created = self.created or chunk.get("created")
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        _keep_extras(self.extras, chunk, _CHUNK_KEYS)
        for ch in chunk.get("choices") or ():
            if isinstance(ch, dict):
                self._add_choice(ch)

    def _add_choice(self, ch: dict[str, Any]) -> None:
        index = ch.get("index", 0)
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = _Choice(index)
        if isinstance(ch.get("delta"), dict):
            _merge_delta(c, ch["delta"])
        if isinstance(ch.get("text"), str):
            c.texts.setdefault("text", []).append(ch["text"])
        if isinstance(ch.get("logprobs"), dict):
            c.logprobs = _merge_logprobs(c.logprobs, ch["logprobs"])
        if isinstance(ch.get("token_ids"), list):
            c.token_ids = [*(c.token_ids or ()), *ch["token_ids"]]
        if ch.get("finish_reason"):
            c.finish_reason = ch["finish_reason"]
        # vLLM sends stop_reason (null until the end) on every chunk of a completion stream and
        # on the last of a chat stream; a value, once sent, is the one that ended the output
        if "stop_reason" in ch and (ch["stop_reason"] is not None or c.stop_reason is _UNSET):
            c.stop_reason = ch["stop_reason"]
        _keep_extras(c.extras, ch, _CHOICE_KEYS)

    def body(self, *, chat: bool, model: str, tool_choice: Any = None) -> dict[str, Any]:
        """The non-streaming response. ``model`` stands in for an upstream that named none;
        ``tool_choice`` is the request's (it decides whether empty content is ``null``)."""
        choices = self.choices or {0: _Choice(0)}
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created or int(time.time()),
            "model": self.model or model,
            "choices": [_chat_choice(c, tool_choice) if chat else _completion_choice(c)
                        for _, c in sorted(choices.items())],
            "usage": self.usage,
        }
        body.update(self.extras)
        return body


def _keep_extras(into: dict[str, Any], obj: dict[str, Any], handled: frozenset[str]) -> None:
    """Remember the fields with a value that the reassembly does not merge (last sent wins)."""
    for k, v in obj.items():
        if k not in handled and v is not None:
            into[k] = v


def _merge_delta(c: _Choice, delta: dict[str, Any]) -> None:
    """A chat delta: the role, string pieces (content, reasoning, ...), tool-call pieces."""
    for k, v in delta.items():
        if v is None:
            continue
        if k == "role":
            c.role = v
        elif k == "tool_calls":
            for call in v or ():
                if isinstance(call, dict):
                    _merge_tool_call(c.tool_calls, call)
        elif isinstance(v, str):
            c.texts.setdefault(k, []).append(v)
        else:
            c.message_extras[k] = v


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """One streamed piece of a tool call: its ``index`` says which call it continues; the
    ``arguments`` are concatenated, the id, type and function name kept as first sent."""
    call = calls.setdefault(delta.get("index", len(calls)), {})
    for k, v in delta.items():
        if k == "index" or v is None:
            continue
        if k == "function" and isinstance(v, dict):
            fn = call.setdefault("function", {})
            for fk, fv in v.items():
                if fv is None:
                    continue
                if fk == "arguments":
                    fn["arguments"] = fn.get("arguments", "") + fv
                else:
                    fn.setdefault(fk, fv)
        else:
            call.setdefault(k, v)


def _merge_logprobs(have: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Logprobs of consecutive chunks: their lists concatenated, key by key."""
    out = dict(have or {})
    for k, v in more.items():
        if isinstance(v, list):
            out[k] = [*(out.get(k) or ()), *v]
        elif v is not None or k not in out:
            out[k] = v
    return out


def _finished_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A merged tool call in the non-streaming shape: ``id``, ``type``, ``function``."""
    fn = call.get("function", {})
    return {"id": call.get("id"), "type": call.get("type", "function"),
            **{k: v for k, v in call.items() if k not in ("id", "type", "function")},
            "function": {"name": fn.get("name"), "arguments": fn.get("arguments", ""),
                         **{k: v for k, v in fn.items() if k not in ("name", "arguments")}}}


def _auto_tool_choice(tool_choice: Any) -> bool:
    """Whether the model chose to call tools itself (``auto``, the default), rather than being
    made to (``required`` or a named function)."""
    return tool_choice is None or tool_choice == "auto"


def _chat_choice(c: _Choice, tool_choice: Any) -> dict[str, Any]:
    content = "".join(c.texts["content"]) if "content" in c.texts else None
    calls = [_finished_tool_call(c.tool_calls[i]) for i in sorted(c.tool_calls)]
    if calls and _auto_tool_choice(tool_choice) and not (content or "").strip():
        content = None  # vLLM: tool calls the model chose, with no text around them
    message: dict[str, Any] = {"role": c.role or "assistant", "content": content}
    message.update({k: "".join(v) for k, v in c.texts.items() if k != "content"})
    message.update(c.message_extras)
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": c.index, "message": message, "logprobs": c.logprobs,
                              "finish_reason": c.finish_reason}
    return _with_vllm_fields(choice, c)


def _completion_choice(c: _Choice) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": c.index, "text": "".join(c.texts.get("text", ())),
                              "logprobs": c.logprobs, "finish_reason": c.finish_reason}
    return _with_vllm_fields(choice, c)


def _with_vllm_fields(choice: dict[str, Any], c: _Choice) -> dict[str, Any]:
    """vLLM's additions to a choice, where the stream carried them."""
    if c.stop_reason is not _UNSET:
        choice["stop_reason"] = c.stop_reason
    if c.token_ids is not None:
        choice["token_ids"] = c.token_ids
    choice.update(c.extras)
    return choice
