"""A request's prompt as the token ids vLLM will see: the served model's tokenizer and chat
template (the gateway counts prompts with it: :mod:`duetime.gateway.intake.request`).

Why: prefix caching shares KV blocks of ``block_size`` *tokens*. A router that keys blocks by
the same token ids as the server knows which of a prompt's blocks an instance holds, counts the
prompt exactly (the forecasts' prefill work), and can read vLLM's KV events, which carry token
ids, as keys of its own (:mod:`duetime.gateway.state.kv_events`).

The pool's ``tokenizer`` is a model folder (``tokenizer.json``, ``tokenizer_config.json`` and,
as transformers >= 4.43 saves it, ``chat_template.jinja``) or a ``tokenizer.json`` with those
files beside it; ``chat_template`` (a file) overrides the model's template. What vLLM 0.32 does
with a request, and what this module does the same way (``vllm/renderers/hf.py``,
``vllm/entrypoints/openai/*/protocol.py``, transformers' ``chat_template_utils.py``):

* a chat request's messages are rendered by the template with jinja2 in a sandbox with
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
  that does not escape HTML, and the globals ``raise_exception`` and ``strftime_now``; the
  variables are ``messages``, ``add_generation_prompt`` (the request's, default true),
  ``tools``, ``documents``, the tokenizer's special tokens
  (``bos_token``, ``eos_token``, ...) and the request's ``chat_template_kwargs``;
* a message's content given as a list of parts becomes its text parts joined by ``"\\n"``
  unless the template iterates over the parts itself (vLLM's "openai" content format, detected
  here by the template's source naming ``['content']`` in a ``for`` loop);
* a ``developer`` message becomes ``system`` when the template never names ``developer``;
* the rendered text is encoded without adding special tokens (``add_special_tokens`` defaults
  to false for chat), a completion's text prompt with them (true by default there); a prompt of
  token ids is taken as given.

A request the template rejects, or one with what this module cannot reproduce (images, a
request's own ``chat_template``, ``continue_final_message``), gets ``None``: the gateway then falls back to its estimate.

A conversation comes back with one more turn each time, its earlier turns rendered the same:
the token ids of each chat prompt's rendered text up to its last special token (``<|im_end|>``)
are kept (:class:`PrefixIds`, least recently used out), and a later prompt that starts with
such a text is encoded from there on only. Exact, not an approximation: the tokenizer splits a
text at its added tokens before it normalises, pre-tokenises and merges, so the ids of a text
cut just after a special token (one that does not strip the whitespace after it) are the ids
of the part before the cut followed by those of the part after it (tested against the whole
encoding on random conversations).
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

from duetime.web.requests import CompletionRequest

log = logging.getLogger("duetime.gateway")

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
            "mask_token")
# vLLM's "openai" content format: the template walks a message's content parts itself
_PARTS_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+\s*\[\s*['\"]content['\"]\s*\]"
                         r"|for\s+\w+\s+in\s+\w+\.content\b")


PREFIXES_KEPT = 256  # rendered conversation prefixes whose token ids are kept


class PrefixIds:
    """Token ids of rendered chat prompts up to a cut after a special token, by that text
    (least recently used out beyond ``size``)."""

    def __init__(self, size: int = PREFIXES_KEPT) -> None:
        self.size = size
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # (long prompts are encoded off the event loop)

    def longest(self, text: str, cuts: list[int]) -> tuple[int, list[int]]:
        """The longest kept prefix of ``text`` among those ending at ``cuts`` (ascending):
        (its length, its ids); (0, []) when none is kept."""
        with self._lock:
            kept = self._ids
            for c in reversed(cuts):
                ids = kept.get(text[:c])
                if ids is not None:
                    kept.move_to_end(text[:c])
                    self.hits += 1
                    return c, ids
            self.misses += 1
            return 0, []

    def keep(self, prefix: str, ids: list[int]) -> None:
        with self._lock:
            kept = self._ids
            kept[prefix] = ids
            kept.move_to_end(prefix)
            while len(kept) > self.size:
                kept.popitem(last=False)


class TokenizerError(ValueError):
    """The tokenizer folder or its files cannot be read."""


def _template_of(config: dict[str, Any]) -> str | None:
    """``chat_template`` of a tokenizer_config.json: a string, or a list of named templates
    (the one named ``default``)."""
    t = config.get("chat_template")
    if isinstance(t, str):
        return t
    if isinstance(t, list):
        for item in t:
            if isinstance(item, dict) and item.get("name") == "default":
                return item.get("template")
    return None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptTokenizer:
    """The pool's tokenizer (and chat template): request → token ids, as vLLM makes them."""

    def __init__(self, path: str | Path, chat_template: str | Path | None = None) -> None:
        from tokenizers import Tokenizer  # (a dependency; imported where used)

        p = Path(path)
        folder = p if p.is_dir() else p.parent
        file = p / TOKENIZER_FILE if p.is_dir() else p
        self.path = file
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception subclasses
            raise TokenizerError(f"{file}: not a tokenizer.json ({e})") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        # the special tokens a chat prompt may be cut after (see PrefixIds): special, matched
        # as written (not normalised) and not eating the whitespace after them
        self.cut_after = sorted({a.content for a in self._tok.get_added_tokens_decoder()
                                  .values() if a.special and not a.rstrip and not a.normalized
                                  and a.content}, key=len, reverse=True)
        self.prefixes = PrefixIds()
        config: dict[str, Any] = {}
        cfg_file = folder / CONFIG_FILE
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{cfg_file}: not readable JSON ({e})") from None
        source: str | None
        if chat_template is not None:
            source = self._read(Path(chat_template))
        elif (folder / TEMPLATE_FILE).is_file():
            source = self._read(folder / TEMPLATE_FILE)
        else:
            source = _template_of(config)
        self.template_source = source
        self.special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
        self._template = None
        self._parts = False
        self._developer = False
        if source is not None:
            self._template = self._compile(source)
            self._parts = bool(_PARTS_LOOP.search(source))
            self._developer = '"developer"' in source or "'developer'" in source
        self._warned = False

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read the chat template ({e})") from None

    @staticmethod
    def _compile(source: str) -> Any:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"the chat template does not compile: {e}") from None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, special: bool, release: bool = False) -> list[int]:
        """``text``'s token ids (``special``: add the tokenizer's special tokens, as vLLM's
        ``add_special_tokens``; ``release``: see :meth:`ids`)."""
        return self._encoding(text, special, release).ids

    def _encoding(self, text: str, special: bool, release: bool) -> Any:
        # (tokenizers' encode holds the GIL while it works, encode_batch lets it go: measured,
        # a thread spinning beside a 1.2 s encode ran 1.5M loops against 25M beside the
        # batch of one; the same ids and offsets)
        if release:
            return self._tok.encode_batch([text], add_special_tokens=special)[0]
        return self._tok.encode(text, add_special_tokens=special)

    def _cuts(self, text: str) -> list[int]:
        """Where ``text`` may be cut: just after each occurrence of a cut token, ascending."""
        cuts: list[int] = []
        for token in self.cut_after:
            k = text.find(token)
            while k >= 0:
                cuts.append(k + len(token))
                k = text.find(token, k + len(token))
        cuts.sort()
        return cuts

    def encode_chat(self, text: str, *, release: bool = False) -> list[int]:
        """A rendered chat prompt's ids (no special tokens added), encoded from its longest
        kept prefix on; its own prefix up to its last cut is kept for the next turn."""
        cuts = self._cuts(text)
        if not cuts:
            return self.encode(text, special=False, release=release)
        start, head = self.prefixes.longest(text, cuts)
        enc = self._encoding(text[start:], False, release)
        ids = head + enc.ids
        last = cuts[-1]
        if last > start:  # (the ids up to the last cut: the tokens that end by it)
            ends = [e for _, e in enc.offsets]
            k = bisect.bisect_right(ends, last - start)
            self.prefixes.keep(text[:last], ids[:len(head) + k])
        return ids

    def render(self, body: dict[str, Any]) -> str | None:
        """A chat request's prompt text, as the model's template renders it (None: no
        template, or a request it cannot reproduce or that the template rejects)."""
        if (self._template is None or body.get("chat_template") is not None
                or body.get("continue_final_message")):
            return None  # (transformers cuts a continued message's end: not reproduced)
        messages = []
        for m in body.get("messages") or []:
            m = dict(m)
            c = m.get("content")
            if isinstance(c, list):
                if any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in c):
                    return None  # images, audio: their placeholder tokens are the model's own
                if not self._parts:
                    m["content"] = "\n".join(p.get("text", "") for p in c
                                             if isinstance(p, dict))
            if m.get("role") == "developer" and not self._developer:
                m["role"] = "system"
            messages.append(m)
        kwargs = body.get("chat_template_kwargs")
        variables: dict[str, Any] = {**self.special, **(kwargs if isinstance(kwargs, dict)
                                                       else {})}
        variables.update(
            messages=messages, tools=body.get("tools"), documents=body.get("documents"),
            add_generation_prompt=body.get("add_generation_prompt", True))
        try:
            return self._template.render(**variables)
        except Exception as e:  # the template's raise_exception, or its own errors
            if not self._warned:
                self._warned = True
                log.warning("chat template failed; estimating prompt tokens", extra={
                    "fields": {"event": "chat_template_error", "error": str(e)[:200]}})
            return None

    def ids(self, req: CompletionRequest, *, release: bool = False) -> list[int] | None:
        """The request's prompt token ids as vLLM makes them, or None where unknown.
        ``release``: let other threads run while the text is encoded (a long prompt encoded
        off the gateway's event loop; safe beside calls on other threads)."""
        body = req.body
        if req.chat:
            text = self.render(body)
            if text is None:
                return None
            if body.get("add_special_tokens", False):
                return self.encode(text, special=True, release=release)
            return self.encode_chat(text, release=release)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encode(prompt, special=bool(body.get("add_special_tokens", True)),
                               release=release)
        if isinstance(prompt, list):  # token ids (parse_completion checked them)
            return prompt
        return None
