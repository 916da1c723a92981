"""One compiled pass over a prompt's UTF-8 bytes: the counts every predictor feature needs.

Why one pass: routing featurises every request on the hot path, and a Python loop over a
1,000-token prompt's words alone costs more than the whole 200 us budget. The scan produces

* counts (characters, lines, sentences, words, digits, punctuation, CJK ideographs, kana,
  Hangul, other non-ASCII letters) for the token estimate and the length features;
* the script classes of a short *sample* (the first and last ``SAMPLE_BYTES`` bytes) for the
  language rule, as LAAR infers language from character classes of a sampled substring;
* a hashed bag of tokens: 512 buckets of word counts (ASCII-lowercased alphanumeric runs,
  runs of other alphabetic scripts; every CJK ideograph, kana or Hangul syllable on its own).

The hash is FNV-1a (32 bit) over a token's bytes plus a final avalanche step, in integer
arithmetic that gives the same buckets in every process, platform, and with or without numba
(unlike Python's salted ``hash``). Changing it changes every trained model: the trained
artefact records ``HASH_NAME`` and loading refuses another.
"""

from __future__ import annotations

import numpy as np

from duetime.engine._jit import njit

N_BUCKETS = 512
SAMPLE_BYTES = 768
HASH_NAME = "fnv1a32-avalanche-512"

_MASK32 = 0xFFFFFFFF
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193

# Indices into the stats vector that `scan` fills.
CHARS = 0          # Unicode code points
NEWLINES = 1
SENTENCES = 2      # terminated runs (. ! ? 。 ！ ？) plus an unterminated tail
WORDS = 3          # alphabetic words (ASCII or other alphabetic scripts), not CJK characters
WORD_EXTRA = 4     # letters beyond the 6th in each word (long words split into more tokens)
DIGITS = 5         # digit characters
PUNCT = 6          # non-space, non-alphanumeric characters (ASCII or not)
CJK = 7            # CJK ideographs
KANA = 8           # hiragana and katakana
HANGUL = 9         # Hangul syllables and jamo
OTHER_LETTERS = 10  # non-ASCII letters inside words (accented Latin, Cyrillic, Greek, ...)
S_LATIN = 11       # --- the same classes within the sample, for the language rule
S_CJK = 12
S_KANA = 13
S_HANGUL = 14
S_OTHER = 15       # letters of other scripts (Cyrillic, Arabic, Thai, ...)
N_STATS = 16

# Character classes of a non-ASCII code point.
_PUNCT, _LATIN, _CJK, _KANA, _HANGUL, _OTHER, _TERMINATOR = 0, 1, 2, 3, 4, 5, 6


@njit(cache=True, nogil=True)
def _code_class(cp: int) -> int:
    """The class of a non-ASCII code point (see the constants above)."""
    if cp == 0x3002 or cp == 0xFF01 or cp == 0xFF1F or cp == 0xFF0E:  # 。！？．
        return _TERMINATOR
    if 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF \
            or 0x20000 <= cp <= 0x2FFFF:
        return _CJK
    if 0x3040 <= cp <= 0x30FF or 0x31F0 <= cp <= 0x31FF or 0xFF66 <= cp <= 0xFF9F:
        return _KANA
    if 0xAC00 <= cp <= 0xD7AF or 0x1100 <= cp <= 0x11FF or 0x3130 <= cp <= 0x318F:
        return _HANGUL
    if (0x00C0 <= cp <= 0x024F and cp != 0xD7 and cp != 0xF7) or 0x1E00 <= cp <= 0x1EFF \
            or 0xFF21 <= cp <= 0xFF3A or 0xFF41 <= cp <= 0xFF5A:
        return _LATIN
    if cp < 0xC0 or 0x2000 <= cp <= 0x2BFF or 0x3000 <= cp <= 0x303F \
            or 0xFE30 <= cp <= 0xFE4F or 0xFF00 <= cp <= 0xFF65 or 0xFFE0 <= cp <= 0xFFFF \
            or 0x1F000 <= cp <= 0x1FAFF:
        return _PUNCT
    return _OTHER


@njit(cache=True, nogil=True)
def _bucket(h: int) -> int:
    """Final avalanche of a 32-bit FNV state, then its low 9 bits (512 buckets)."""
    h = h ^ (h >> 16)
    h = (h * 0x045D9F3B) & _MASK32
    h = h ^ (h >> 16)
    return h & (N_BUCKETS - 1)


@njit(cache=True, nogil=True)
def scan(buf: np.ndarray, counts: np.ndarray, stats: np.ndarray) -> None:
    """Fill ``counts`` (float64[N_BUCKETS], zeroed) and ``stats`` (int64[N_STATS], zeroed)
    from ``buf``, the UTF-8 bytes of one text (uint8).

    Counters are locals written once at the end (array stores in the loop cost ~2x)."""
    n = buf.shape[0]
    chars = newlines = sentences = words = word_extra = digits = punct = 0
    cjk = kana = hangul = other_letters = 0
    s_latin = s_cjk = s_kana = s_hangul = s_other = 0
    h = _FNV_OFFSET
    in_word = False
    letters = 0
    has_letter = False
    open_sentence = False
    sample_end = SAMPLE_BYTES
    sample_start = n - SAMPLE_BYTES
    i = 0
    while i < n:
        b = int(buf[i])
        if b < 0x80:
            chars += 1
            lower = b | 0x20
            if 0x61 <= lower <= 0x7A:
                if not in_word:
                    in_word = True
                    h = _FNV_OFFSET
                    letters = 0
                # The whole run of ASCII letters in a tight loop (most of any English text).
                start = i
                while True:
                    h = ((h ^ lower) * _FNV_PRIME) & _MASK32
                    i += 1
                    if i >= n:
                        break
                    lower = int(buf[i]) | 0x20
                    if not 0x61 <= lower <= 0x7A:
                        break
                run = i - start
                chars += run - 1  # the first was counted above
                letters += run
                has_letter = True
                open_sentence = True
                if sample_start <= sample_end:  # the samples cover the whole text
                    s_latin += run
                else:
                    s_latin += max(0, min(i, sample_end) - start) \
                        + max(0, i - max(start, sample_start))
                continue
            elif 0x30 <= b <= 0x39:
                if not in_word:
                    in_word = True
                    h = _FNV_OFFSET
                    letters = 0
                    has_letter = False
                h = ((h ^ b) * _FNV_PRIME) & _MASK32
                digits += 1
                open_sentence = True
            else:
                if in_word:
                    counts[_bucket(h)] += 1.0
                    if has_letter:
                        words += 1
                        if letters > 6:
                            word_extra += letters - 6
                    in_word = False
                    has_letter = False
                if b == 0x0A:
                    newlines += 1
                elif b == 0x2E or b == 0x21 or b == 0x3F:  # . ! ?
                    punct += 1
                    nxt = int(buf[i + 1]) if i + 1 < n else 0x20
                    if open_sentence and (nxt == 0x20 or nxt == 0x0A or nxt == 0x09
                                          or nxt == 0x0D or nxt == 0x22 or nxt == 0x27
                                          or nxt == 0x29):
                        sentences += 1
                        open_sentence = False
                elif b > 0x20 and b != 0x7F:
                    punct += 1
            i += 1
            continue
        # A multi-byte character: decode its code point.
        if b >= 0xF0:
            width = 4
            cp = b & 0x07
        elif b >= 0xE0:
            width = 3
            cp = b & 0x0F
        elif b >= 0xC0:
            width = 2
            cp = b & 0x1F
        else:  # a stray continuation byte (str.encode never makes one): skip it
            i += 1
            continue
        for j in range(1, width):
            if i + j < n:
                cp = (cp << 6) | (int(buf[i + j]) & 0x3F)
        chars += 1
        cls = _code_class(cp)
        sampled = i < sample_end or i >= sample_start
        if cls in (_LATIN, _OTHER):  # a letter that continues (or starts) a word
            if not in_word:
                in_word = True
                h = _FNV_OFFSET
                letters = 0
            for j in range(width):
                if i + j < n:
                    h = ((h ^ int(buf[i + j])) * _FNV_PRIME) & _MASK32
            letters += 1
            has_letter = True
            other_letters += 1
            open_sentence = True
            if sampled:
                if cls == _LATIN:
                    s_latin += 1
                else:
                    s_other += 1
        else:
            if in_word:
                counts[_bucket(h)] += 1.0
                if has_letter:
                    words += 1
                    if letters > 6:
                        word_extra += letters - 6
                in_word = False
                has_letter = False
            if cls in (_CJK, _KANA, _HANGUL):  # a token of its own
                g = _FNV_OFFSET
                for j in range(width):
                    if i + j < n:
                        g = ((g ^ int(buf[i + j])) * _FNV_PRIME) & _MASK32
                counts[_bucket(g)] += 1.0
                open_sentence = True
                if cls == _CJK:
                    cjk += 1
                    if sampled:
                        s_cjk += 1
                elif cls == _KANA:
                    kana += 1
                    if sampled:
                        s_kana += 1
                else:
                    hangul += 1
                    if sampled:
                        s_hangul += 1
            elif cls == _TERMINATOR:
                punct += 1
                if open_sentence:
                    sentences += 1
                    open_sentence = False
            else:
                punct += 1
        i += width
    if in_word:
        counts[_bucket(h)] += 1.0
        if has_letter:
            words += 1
            if letters > 6:
                word_extra += letters - 6
    if open_sentence:
        sentences += 1
    stats[CHARS] = chars
    stats[NEWLINES] = newlines
    stats[SENTENCES] = sentences
    stats[WORDS] = words
    stats[WORD_EXTRA] = word_extra
    stats[DIGITS] = digits
    stats[PUNCT] = punct
    stats[CJK] = cjk
    stats[KANA] = kana
    stats[HANGUL] = hangul
    stats[OTHER_LETTERS] = other_letters
    stats[S_LATIN] = s_latin
    stats[S_CJK] = s_cjk
    stats[S_KANA] = s_kana
    stats[S_HANGUL] = s_hangul
    stats[S_OTHER] = s_other


def scan_text(text: str) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, stats)`` of one text: hashed token counts (float64[512]) and the stats."""
    counts = np.zeros(N_BUCKETS, dtype=np.float64)
    stats = np.zeros(N_STATS, dtype=np.int64)
    scan(np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8), counts, stats)
    return counts, stats


def token_bucket(token: str) -> int:
    """The bucket of one token as `scan` hashes it (ASCII letters lowercased); for tests/docs."""
    h = _FNV_OFFSET
    for byte in token.encode("utf-8"):
        if 0x41 <= byte <= 0x5A:
            byte |= 0x20
        h = ((h ^ byte) * _FNV_PRIME) & _MASK32
    return int(_bucket(h))
