"""Token counts: a HuggingFace ``tokenizers`` tokenizer.json when one is given, else a fast
estimate from the byte scan's counts.

Why an estimate: an exact count needs the serving model's tokenizer, which a router may not
have (and encoding a 1,000-token prompt costs more than the whole prediction budget). The
estimate is a linear function of counts the scan makes anyway::

    tokens ~ 1.0*words + 0.25*letters beyond a word's 6th + 0.5*digits + 0.8*punctuation
             + 1.0*CJK ideographs + 1.0*kana + 1.0*Hangul + 0.4*other non-ASCII letters

rules of thumb for modern byte-level BPE vocabularies (a common word is one token, long words
split, a CJK character is about one token). Its measured error against a real tokenizer is in
docs/predict.md (``benchmarks/predict_speed.py --tokenizer FILE`` measures it again).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from duetime.predict import text_scan as ts


@runtime_checkable
class Tokenizer(Protocol):
    """Anything that counts a text's tokens."""

    name: str

    def count(self, text: str, stats: Sequence[int]) -> int:
        """Tokens in ``text``; ``stats`` is its scan as a list (an estimate needs only that)."""
        ...


# (stat index, tokens per unit): see the module docstring.
DEFAULT_COEFFICIENTS: dict[str, float] = {
    "words": 1.0, "word_extra": 0.25, "digits": 0.5, "punct": 0.8, "cjk": 1.0, "kana": 1.0,
    "hangul": 1.0, "other_letters": 0.4,
}
_STAT_INDEX = {"words": ts.WORDS, "word_extra": ts.WORD_EXTRA, "digits": ts.DIGITS,
               "punct": ts.PUNCT, "cjk": ts.CJK, "kana": ts.KANA, "hangul": ts.HANGUL,
               "other_letters": ts.OTHER_LETTERS}


class FastEstimate:
    """The default: a linear estimate from the scan's counts (no tokenizer needed)."""

    name = "estimate"

    def __init__(self, coefficients: dict[str, float] | None = None) -> None:
        coef = dict(DEFAULT_COEFFICIENTS if coefficients is None else coefficients)
        unknown = set(coef) - set(_STAT_INDEX)
        if unknown:
            raise ValueError(f"unknown token-estimate terms: {sorted(unknown)}")
        self.coefficients = coef
        self._index = np.array([_STAT_INDEX[k] for k in coef], dtype=np.int64)
        self._weights = np.array(list(coef.values()), dtype=np.float64)
        self._pairs = list(zip(self._index.tolist(), self._weights.tolist(), strict=True))

    def count(self, text: str, stats: Sequence[int]) -> int:
        """``stats``: the scan's counts as a Python list (indexing a numpy array per term
        would cost ten times more than the sum itself)."""
        total = 0.0
        for i, w in self._pairs:  # 8 terms: a Python loop beats a numpy call here
            total += w * stats[i]
        if total > 0:
            return max(1, round(total))
        return 1 if text.strip() else 0  # control characters only: still a token


class HFTokenizer:
    """Exact counts with a HuggingFace ``tokenizers`` tokenizer.json (special tokens, padding
    and truncation off: a prompt's own tokens)."""

    name = "tokenizer"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF  # optional at import time: only when used

        self.path = Path(path)
        try:
            self._tok = _HF.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own Exception subclasses
            raise ValueError(f"{self.path}: not a tokenizer.json ({e})") from None
        self._tok.no_truncation()
        self._tok.no_padding()

    def count(self, text: str, stats: Sequence[int] | None = None) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


FAST = FastEstimate()
