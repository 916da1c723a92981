"""OpenAI completion requests as every server here reads them: validation of
``/v1/chat/completions``, ``/v1/completions`` and vLLM's ``/tokenize`` bodies, with
:class:`~duetime.web.errors.ApiError` for bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from duetime.web.errors import ApiError
from duetime.web.limits import check_json_depth, json_depth_limit, too_deep
from duetime.web.tokens import chat_tokens, content_text, text_tokens


@dataclass(slots=True)
class CompletionRequest:
    """What the emulator and the gateway need from a (chat) completion request."""

    chat: bool
    model: str | None
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False
    # the client asked for the tokens so far in every chunk (vLLM's continuous_usage_stats)
    continuous_usage: bool = False
    max_tokens: int | None = None
    ignore_eos: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    # the prompt's token ids, where the gateway's tokenizer made them (as the server will)
    token_ids: list[int] | None = None


def parse_json(raw: bytes) -> Any:
    """The body's JSON; a 400 if it is not JSON or nests deeper than the server's limit."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep(json_depth_limit.get()) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    check_json_depth(value, raw)
    return value


def _opt_int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ApiError(400, f"{key} must be an integer >= {lo}, got {v!r}", param=key,
                       code="invalid_value")
    return v


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean, got {v!r}", param=key,
                       code="invalid_type")
    return v


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return _prompt_tokens(prompt[0])
        raise ApiError(400, "only one prompt per request is supported (a string or a list of "
                       "token ids)", param="prompt", code="invalid_value")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids",
                   param="prompt", code="invalid_value")


def parse_completion(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", param="model",
                       code="invalid_type")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages is required", param="messages",
                           code="missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages",
                           code="invalid_value")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string role",
                               param=f"messages[{i}]", code="invalid_value")
            c = m.get("content")
            if c is not None and not isinstance(c, str | list):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of "
                               "parts", param=f"messages[{i}].content", code="invalid_type")
        prompt_tokens = chat_tokens(messages)
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt",
                           code="missing_required_parameter")
        prompt_tokens = _prompt_tokens(body["prompt"])
    for key in ("n", "best_of"):  # one answer per request: the router routes one output
        v = _opt_int(body, key, 1)
        if v is not None and v != 1:
            raise ApiError(400, f"only {key} = 1 is supported", param=key, code="invalid_value")
    max_tokens = _opt_int(body, "max_tokens", 1)
    if chat:
        mct = _opt_int(body, "max_completion_tokens", 1)
        max_tokens = mct if mct is not None else max_tokens
    stream = _opt_bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options",
                           code="invalid_type")
        include_usage = _opt_bool(opts, "include_usage")
        continuous = include_usage and _opt_bool(opts, "continuous_usage_stats")
    return CompletionRequest(chat, model, prompt_tokens, stream, include_usage, continuous,
                             max_tokens, _opt_bool(body, "ignore_eos"), body)


def parse_tokenize(raw: bytes) -> int:
    """Prompt tokens of a vLLM ``/tokenize`` body (``prompt`` or chat ``messages``)."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_type")
    if "messages" in body:
        return parse_completion(raw, chat=True).prompt_tokens
    if "prompt" in body:
        return _prompt_tokens(body["prompt"])
    raise ApiError(400, "prompt or messages is required", param="prompt",
                   code="missing_required_parameter")


def prompt_texts(req: CompletionRequest) -> list[str]:
    """The prompt's text: one string per chat message (text parts joined), or the prompt."""
    body = req.body
    if req.chat:  # (parse_completion has checked that messages is a list of objects)
        return [content_text(m.get("content")) for m in body.get("messages") or []]
    prompt = body.get("prompt")
    return [prompt if isinstance(prompt, str) else " ".join(
        x for x in prompt or [] if isinstance(x, str))]
