"""Language from the character classes of a short sample of the text (as LAAR does).

Labels: ``en`` (Latin/ASCII), ``zh`` (CJK ideographs), ``ja`` (kana, with or without
ideographs), ``ko`` (Hangul), ``other`` (mostly letters of another script: Cyrillic, Arabic,
Thai, ...). The sample is the first and last 768 bytes (``text_scan.SAMPLE_BYTES``): the
question of a long-context prompt is usually at its end, the instruction at its start.

Why thresholds rather than a majority: a Japanese question after an ASCII JSON context (LAAR's
KV lookups) has more ASCII letters than kana in the sample, yet it is Japanese. One East Asian
character counts like a Latin *word* (about five letters) here. A text is East Asian when at
least half of it is, or when it has at least four East Asian characters making up a tenth of
it: a Chinese name in an English sentence does not make the sentence Chinese, a two-character
Chinese prompt is Chinese.
"""

from __future__ import annotations

from collections.abc import Sequence

from duetime.predict import text_scan as ts

LANGUAGES: tuple[str, ...] = ("en", "zh", "ja", "ko", "other")

MIN_EAST_ASIAN = 4          # characters in the sample, when they are a minority ...
MIN_EAST_ASIAN_SHARE = 0.1  # ... of East Asian characters + Latin words (letters / 5)
LATIN_LETTERS_PER_WORD = 5.0


def detect_language(stats: Sequence[int]) -> str:
    """The language label from a scan's sample counts (``text_scan`` stats)."""
    latin = float(stats[ts.S_LATIN])
    cjk = float(stats[ts.S_CJK])
    kana = float(stats[ts.S_KANA])
    hangul = float(stats[ts.S_HANGUL])
    other = float(stats[ts.S_OTHER])
    east = cjk + kana + hangul
    units = east + latin / LATIN_LETTERS_PER_WORD + other / LATIN_LETTERS_PER_WORD
    if east > 0 and (east >= 0.5 * units
                     or (east >= MIN_EAST_ASIAN and east >= MIN_EAST_ASIAN_SHARE * units)):
        if hangul > cjk + kana:
            return "ko"
        if kana >= min(2.0, cjk + kana) and kana >= 0.05 * (cjk + kana):
            return "ja"
        if cjk >= hangul:
            return "zh"
        return "ko"
    if other > latin:
        return "other"
    return "en"
