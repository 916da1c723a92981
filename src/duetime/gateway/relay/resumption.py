"""Mid-stream failover: a streamed answer whose instance broke after the client got part of it
continues on another instance of the same model, and the client sees one stream.

The continuation is an ordinary completion request that carries what was already sent: for a
chat, the text as a final assistant message that the model continues (vLLM's
``continue_final_message: true``, ``add_generation_prompt: false``); for a completion, the
text appended to the prompt. Its sampling parameters are the client's, its ``max_tokens``
(and ``min_tokens``) reduced by the tokens sent. Its events are rewritten so that the stream
reads as one: the chat's role chunk dropped, every chunk under the first answer's ``id``,
``created`` and ``model``, and ``usage`` counted over the whole answer (the prompt's tokens as
the first instance counted them where its stream said, else the gateway's own count).

Where a continuation could not be exact, the stream is not resumed and ends with an error
event, as before: log probabilities, ``echo`` or ``suffix``, guided or
structured output, a prompt other than one string (completions), or a chat that streamed tool
calls or text other than ``content`` (reasoning). (``n`` above 1 the gateway refuses at its
intake.) A stream that broke after the answer's end (its finish reason) was sent is not
continued but closed: its usage chunk, where the client asked for one, and ``[DONE]``
(:func:`closing`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from duetime.estimate.base import KeysByBlockSize
from duetime.gateway.intake.request import RequestContext
from duetime.gateway.relay.reassembly import Reassembly
from duetime.web.prefix_keys import prompt_block_keys
from duetime.web.sse import DONE, Kind, chunk_of, classified, tokens_so_far

# request fields whose output a continuation cannot reproduce from text alone
_INEXACT = ("logprobs", "top_logprobs", "echo", "suffix", "response_format", "guided_json",
            "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
            "prompt_logprobs")


def not_resumable(ctx: RequestContext) -> str | None:
    """Why a request's stream could not be resumed exactly (None: it could), judged before
    it starts."""
    body = ctx.req.body
    if not ctx.req.stream:
        return "not a stream (a non-streaming request is retried whole)"
    for k in _INEXACT:
        v = body.get(k)
        if v not in (None, False, 0) and not (k == "response_format"
                                             and isinstance(v, dict)
                                             and v.get("type") == "text"):
            return f"{k} requested"
    if not ctx.chat and not _single_prompt(body.get("prompt")):
        return "a prompt other than one string"
    return None


def _single_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                       and isinstance(prompt[0], str))


@dataclasses.dataclass(slots=True)
class Sent:
    """What the client has received of the answer so far, over every attempt."""

    text: str = ""
    tokens: int = 0
    prompt_tokens: int | None = None  # the first instance's count, where its stream said
    id: str | None = None
    created: int | None = None
    model: str | None = None
    why_not: str | None = None  # set when what was sent cannot be continued exactly
    ended: bool = False  # the answer's end (a finish reason) was sent: nothing to continue

    def add(self, events: list[bytes], *, chat: bool) -> None:
        """Take in an attempt's forwarded token and role events."""
        answer = Reassembly()
        made = 0  # this attempt's tokens (its own count where its chunks carry one)
        for _, data, kind in classified(events):
            if kind in (Kind.TOKEN, Kind.ROLE):
                chunk = chunk_of(data)
                answer.add(chunk)
                u = chunk.get("usage")
                if isinstance(u, dict) and self.prompt_tokens is None:
                    self.prompt_tokens = u.get("prompt_tokens")
                if kind == Kind.TOKEN:
                    so_far = tokens_so_far(data)
                    made = made + 1 if so_far is None else so_far
        self.tokens += made
        self.id, self.created = self.id or answer.id, self.created or answer.created
        self.model = self.model or answer.model
        c = answer.choices.get(0)
        if c is None:
            return
        text_key = "content" if chat else "text"
        others = [k for k, v in c.texts.items() if k != text_key and "".join(v)]
        if c.tool_calls:
            self.why_not = "tool calls were streamed"
        elif others:
            self.why_not = f"{others[0]} was streamed"
        self.ended = self.ended or bool(c.finish_reason)
        self.text += "".join(c.texts.get(text_key, ()))


class Continuation:
    """The request that continues an answer after ``sent``, and the rewriting of its events."""

    def __init__(self, ctx: RequestContext, sent: Sent) -> None:
        self.ctx = ctx
        self.sent = sent
        self._tokens_before = sent.tokens  # (the continuation's own are added to ``sent``)

    def context(self) -> RequestContext:
        """The continuation's request context: its body, prompt and output lengths."""
        ctx, n = self.ctx, self.sent.tokens
        body = copy.deepcopy(ctx.req.body)
        if ctx.chat:
            _continue_chat(body, self.sent.text)
        else:
            p = body["prompt"]
            body["prompt"] = (p if isinstance(p, str) else p[0]) + self.sent.text
        for k in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if isinstance(body.get(k), int) and not isinstance(body[k], bool):
                body[k] = max(body[k] - n, 1 if k != "min_tokens" else 0)
        req = dataclasses.replace(ctx.req, body=body, prompt_tokens=ctx.req.prompt_tokens + n,
                                  max_tokens=None if ctx.req.max_tokens is None
                                  else max(ctx.req.max_tokens - n, 1), token_ids=None)
        return dataclasses.replace(
            ctx, req=req, predicted=max(ctx.predicted - n, 1),
            keys=KeysByBlockSize(lambda block_size: prompt_block_keys(req, block_size)))

    def room(self) -> bool:
        """Whether the answer may grow (a client's ``max_tokens`` not yet reached)."""
        cap = self.ctx.req.max_tokens
        return cap is None or self.sent.tokens < cap

    def rewrite(self, events: list[bytes]) -> list[bytes]:
        """The continuation's events as the first answer's: its role chunk dropped, the first
        answer's id, created time and model, usage over the whole answer."""
        out = []
        for ev, data, kind in classified(events):
            if kind == Kind.ROLE:
                continue
            if kind in (Kind.TOKEN, Kind.USAGE):
                chunk = chunk_of(data)
                if chunk:
                    self._as_first(chunk)
                    ev = b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
            out.append(ev)
        return out

    def _as_first(self, chunk: dict[str, Any]) -> None:
        s = self.sent
        for k, v in (("id", s.id), ("created", s.created), ("model", s.model)):
            if v is not None and k in chunk:
                chunk[k] = v
        u = chunk.get("usage")
        if isinstance(u, dict):
            prompt = s.prompt_tokens if s.prompt_tokens is not None else self.ctx.req.prompt_tokens
            completion = self._tokens_before + int(u.get("completion_tokens") or 0)
            chunk["usage"] = {**u, "prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}


def closing(ctx: RequestContext, sent: Sent) -> bytes:
    """The end of a stream whose answer had ended when it broke: the usage chunk (where the
    client asked for one; the prompt counted as in :meth:`Continuation.rewrite`) and
    ``[DONE]``."""
    out = b""
    if ctx.req.include_usage:
        prompt = sent.prompt_tokens if sent.prompt_tokens is not None else ctx.req.prompt_tokens
        chunk = {"id": sent.id, "object": "chat.completion.chunk" if ctx.chat
                 else "text_completion", "created": sent.created, "model": sent.model,
                 "choices": [], "usage": {"prompt_tokens": prompt,
                                          "completion_tokens": sent.tokens,
                                          "total_tokens": prompt + sent.tokens}}
        out = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return out + DONE


def _continue_chat(body: dict[str, Any], text: str) -> None:
    """The chat's messages with ``text`` as the assistant's answer to continue."""
    msgs = list(body.get("messages") or ())
    last = msgs[-1] if msgs else None
    if (body.get("continue_final_message") and isinstance(last, dict)
            and last.get("role") == "assistant" and isinstance(last.get("content"), str)):
        msgs[-1] = {**last, "content": last["content"] + text}
    else:
        msgs.append({"role": "assistant", "content": text})
    body["messages"] = msgs
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False

