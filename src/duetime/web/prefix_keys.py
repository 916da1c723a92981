"""Block keys of a prompt without a tokenizer: what prefix caching shares between requests.

vLLM's automatic prefix caching keys every full block of ``block_size`` tokens by a hash of
its tokens chained to the previous block's key, so two requests share a block exactly when
their tokens agree up to its end. The servers here have no tokenizer, so they key blocks the
way they estimate prompt lengths (:mod:`duetime.web.tokens`):

* a prompt of token ids, or one a tokenizer turned into them (``CompletionRequest.token_ids``:
  the gateway's :mod:`~duetime.web.prompt_tokens`): the ids, ``block_size`` per block
  (exact, as vLLM);
* a text prompt, or chat messages: the prompt's text, ``block_size * CHARS_PER_TOKEN``
  characters per block (64 characters stand in for 16 tokens). Chat messages are rendered in
  order as ``<|role|>\\n`` + content + ``\\n``, then the generation prompt ``<|assistant|>\\n``;
  so a conversation's next turn (the same messages, the answer, a new message) starts with the
  same text and shares the blocks of the turn before.

``key_k = H(key_{k-1}, block k)`` with H = blake2b of 8 bytes read as a signed int64 (the same
in every process); a request's ``cache_salt`` (vLLM's field) goes into the first block's key,
so salted requests share blocks only with the same salt. Only full blocks get keys, and at
most ``prompt_tokens // block_size`` of them (the estimate's full blocks).

A conversation comes back a turn longer each time: the keys of a token prompt's full blocks
are kept (:class:`KeptChains`, per process, the most recent prompts by their first block), and
a later prompt that shares whole blocks with a kept one takes their keys and hashes only the
blocks after them (a block's key depends only on the blocks up to it: exact).

What the text estimate costs: text that a tokenizer would cut into the same tokens keys
alike here, and text that differs keys apart, but a block boundary falls every 64 characters
rather than every 16 tokens, so the cached prefix a hit reuses is as long as the shared text
rounded down to 64 characters, estimated at 4 characters a token; two prompts that differ
only in, say, whitespace that a tokenizer would merge never share here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from duetime.web.requests import CompletionRequest
from duetime.web.tokens import CHARS_PER_TOKEN, content_text

_TOKENS, _TEXT = b"t", b"c"  # the two kinds of block content never share a key


def _key(parent: bytes, kind: bytes, content: bytes) -> tuple[int, bytes]:
    d = hashlib.blake2b(parent + kind + content, digest_size=8).digest()
    return int.from_bytes(d, "little", signed=True), d


def _chain(blocks: Sequence[bytes], kind: bytes, salt: str | None,
           parent_key: int | None = None) -> list[int]:
    if parent_key is not None:
        parent = parent_key.to_bytes(8, "little", signed=True)
    else:
        parent = b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=8).digest()
    out = []
    for content in blocks:
        key, parent = _key(parent, kind, content)
        out.append(key)
    return out


class KeptChains:
    """The block keys of recent token prompts, by their first block's ids (with the block size
    and salt): up to ``per_first`` prompts each, ``size`` first blocks in all, least recently
    used out. Prompts are compared as lists of ids (a returning conversation's ids are largely
    the same int objects, so the comparison is mostly pointer checks); only the blocks after
    the shared run are packed and hashed."""

    def __init__(self, size: int = 256, per_first: int = 4) -> None:
        self.size, self.per_first = size, per_first
        self._by_first: OrderedDict[tuple, list[tuple[list[int], list[int]]]] = OrderedDict()
        self.hits = 0

    @staticmethod
    def _shared_blocks(a: Sequence[int], b: Sequence[int], bs: int) -> int:
        """How many whole blocks of ``bs`` ids ``a`` and ``b`` share from the start: all of
        the shorter one's (a conversation that came back: one comparison), else block by
        block (another prompt: it shares few)."""
        hi = min(len(a), len(b)) // bs
        if a[:hi * bs] == b[:hi * bs]:
            return hi
        k = 0
        while a[k * bs:(k + 1) * bs] == b[k * bs:(k + 1) * bs]:
            k += 1
        return k

    def keys(self, ids: Sequence[int], n: int, bs: int, salt: str | None) -> list[int]:
        """The chained keys of the first ``n`` blocks of ``bs`` ids, reusing the kept keys of
        the longest shared run of whole blocks. Raises OverflowError or TypeError for ids
        that are not int64 (the caller keys those another way)."""
        ids = list(ids[:n * bs])
        first = (bs, salt, *ids[:bs])
        kept = self._by_first.get(first)
        best, best_keys = 0, None
        for old_ids, old_keys in kept or ():
            k = self._shared_blocks(ids, old_ids, bs)
            if k > best:
                best, best_keys = k, old_keys
                if k == min(len(ids), len(old_ids)) // bs:
                    break  # (a whole kept prompt, the most recent first: taken as it is)
        raw = array("q", ids[best * bs:]).tobytes()
        step = 8 * bs
        blocks = [raw[i * step:(i + 1) * step] for i in range(n - best)]
        if best_keys is not None:
            self.hits += 1
            keys = best_keys[:best]
            if blocks:
                keys += _chain(blocks, _TOKENS, salt, parent_key=keys[-1])
        else:
            keys = _chain(blocks, _TOKENS, salt)
        entries = self._by_first.setdefault(first, [])
        self._by_first.move_to_end(first)
        entries[:] = [(ids, keys), *[e for e in entries if e[0] != ids][:self.per_first - 1]]
        while len(self._by_first) > self.size:
            self._by_first.popitem(last=False)
        return list(keys)  # (the kept list is not the caller's to change)


_KEPT = KeptChains()


def token_block_keys(ids: Sequence[int], block_size: int, *, salt: str | None = None,
                     limit: int | None = None, parent: int | None = None) -> list[int]:
    """Chained keys of the full blocks of a prompt of token ids (at most ``limit``); with
    ``parent`` (a key this function returned), the keys of blocks that follow that block
    (what a KV event's stored blocks chain to)."""
    n = len(ids) // block_size
    if limit is not None:
        n = min(n, limit)
    if n <= 0:
        return []
    try:
        if parent is None:  # (a prompt's keys: a returning conversation's are kept)
            return _KEPT.keys(ids, n, block_size, salt)
        raw = array("q", ids[:n * block_size]).tobytes()
        step = 8 * block_size
        blocks = [raw[i * step:(i + 1) * step] for i in range(n)]
    except (OverflowError, TypeError):  # ids past int64 (no tokenizer has them): by digits
        blocks = [",".join(map(str, ids[i * block_size:(i + 1) * block_size])).encode()
                  for i in range(n)]
    return _chain(blocks, _TOKENS, salt, parent)


def text_block_keys(text: str, block_size: int, *, salt: str | None = None,
                    limit: int | None = None) -> list[int]:
    """Chained keys of the full blocks of a text, ``block_size * CHARS_PER_TOKEN`` characters
    each (at most ``limit``)."""
    width = block_size * CHARS_PER_TOKEN
    n = len(text) // width
    if limit is not None:
        n = min(n, limit)
    if n <= 0:
        return []
    return _chain([text[i * width:(i + 1) * width].encode() for i in range(n)], _TEXT, salt)


def chat_text(messages: Sequence[dict[str, Any]]) -> str:
    """Chat messages as one text: ``<|role|>\\n`` + content + ``\\n`` per message, in order,
    then ``<|assistant|>\\n`` (the generation prompt)."""
    parts = [f"<|{m.get('role')}|>\n{content_text(m.get('content'))}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _token_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt  # (parse_completion has checked every element)
    return None


def prompt_block_keys(req: CompletionRequest, block_size: int) -> list[int]:
    """The block keys of a parsed (chat) completion request's prompt (see the module doc)."""
    body = req.body
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    limit = req.prompt_tokens // block_size
    if req.token_ids is not None:  # the server's own tokens (the gateway's tokenizer)
        return token_block_keys(req.token_ids, block_size, salt=salt, limit=limit)
    if req.chat:
        return text_block_keys(chat_text(body.get("messages") or []), block_size, salt=salt,
                               limit=limit)
    prompt = body.get("prompt")
    ids = _token_ids(prompt)
    if ids is not None:
        return token_block_keys(ids, block_size, salt=salt, limit=limit)
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_block_keys(prompt, block_size, salt=salt, limit=limit)
    return []


def adapter_block_keys(keys: Sequence[int], adapter: str | None) -> list[int]:
    """``keys`` of a request on LoRA adapter ``adapter`` (None: the base model's, as they
    are): vLLM puts the adapter in every block's hash, so a prompt cached under one adapter
    misses under another and under the base model. A key already depends on every block up to
    it, so hashing each one with the adapter's name keeps the prefix property (same adapter,
    same prefix: same keys). The emulator and the gateway key alike with this."""
    if adapter is None:
        return list(keys)
    seed = hashlib.blake2b(b"lora\x00" + adapter.encode(), digest_size=8).digest()
    return [int.from_bytes(hashlib.blake2b(seed + k.to_bytes(8, "little", signed=True),
                                           digest_size=8).digest(), "little", signed=True)
            for k in keys]
