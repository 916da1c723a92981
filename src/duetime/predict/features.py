"""Request features: what the text gives (counts, language, hashed tokens), and the vector the
trained models read (with the PCA projection, task and language indicators).

Layout of the model-independent vector (``base_names``)::

    log1p(tokens), log1p(chars), log1p(lines), log1p(sentences), log1p(words), length bucket,
    pca_0 .. pca_15, task=<t> for each training task, lang=<l> for each language

The regressors add one indicator per model (``model=<m>``) after these; the tree evaluator
reads them implicitly from the model index, so a request is featurised once for all models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from duetime.predict import text_scan as ts
from duetime.predict.buckets import length_bucket
from duetime.predict.language import LANGUAGES, detect_language
from duetime.predict.pca import N_COMPONENTS, HashedPCA
from duetime.predict.tokens import FAST, Tokenizer

N_NUMERIC = 6  # log counts (5) and the length bucket, before the PCA columns
LANG_INDEX = {lang: i for i, lang in enumerate(LANGUAGES)}


@dataclass(slots=True)
class TextFeatures:
    """What the text alone gives: no trained part is involved."""

    tokens: int
    chars: int
    lines: int
    sentences: int
    words: int
    language: str
    bucket: int
    counts: np.ndarray = field(repr=False)  # hashed token counts, float64[512]
    stats: np.ndarray = field(repr=False)   # the scan's counts (text_scan indices)


def text_features(text: str, tokenizer: Tokenizer = FAST,
                  tokens: int | None = None) -> TextFeatures:
    """Scan ``text`` once and count its tokens (estimate unless ``tokenizer`` is exact).
    ``tokens``: a count the caller already has (a gateway that tokenized the prompt)."""
    counts, stats = ts.scan_text(text)
    st = stats.tolist()  # Python ints: cheaper to index than numpy scalars
    if tokens is None:
        tokens = tokenizer.count(text, st)
    chars = st[ts.CHARS]
    return TextFeatures(tokens=tokens, chars=chars, lines=st[ts.NEWLINES] + 1 if chars else 0,
                        sentences=st[ts.SENTENCES], words=st[ts.WORDS],
                        language=detect_language(st), bucket=length_bucket(tokens),
                        counts=counts, stats=stats)


def base_names(tasks: tuple[str, ...]) -> list[str]:
    """Column names of the model-independent vector."""
    return (["log_tokens", "log_chars", "log_lines", "log_sentences", "log_words",
             "length_bucket"] + [f"pca_{i}" for i in range(N_COMPONENTS)]
            + [f"task={t}" for t in tasks] + [f"lang={lang}" for lang in LANGUAGES])


def numeric_block(tf: TextFeatures, pca: HashedPCA) -> np.ndarray:
    """The first ``N_NUMERIC + N_COMPONENTS`` columns (no task, no language)."""
    out = np.empty(N_NUMERIC + N_COMPONENTS)
    out[0] = math.log1p(tf.tokens)
    out[1] = math.log1p(tf.chars)
    out[2] = math.log1p(tf.lines)
    out[3] = math.log1p(tf.sentences)
    out[4] = math.log1p(tf.words)
    out[5] = tf.bucket
    pca.project_into(tf.counts, out[N_NUMERIC:])
    return out


def base_vector(numeric: np.ndarray, task_index: int, language: str,
                n_tasks: int) -> np.ndarray:
    """The whole model-independent vector; ``task_index`` -1 = no known task."""
    n = numeric.shape[0]
    out = np.zeros(n + n_tasks + len(LANGUAGES))
    out[:n] = numeric
    if task_index >= 0:
        out[n + task_index] = 1.0
    out[n + n_tasks + LANG_INDEX[language]] = 1.0
    return out


@dataclass(slots=True)
class RequestFeatures:
    """Everything the trained predictors read about one request."""

    text: TextFeatures
    task: str | None      # given, or inferred (``task_inferred``), or None when unknown
    task_index: int       # into the trained task vocabulary; -1 = unknown
    task_inferred: bool
    vector: np.ndarray = field(repr=False)  # the model-independent vector (base_names)

    @property
    def tokens(self) -> int:
        return self.text.tokens

    @property
    def language(self) -> str:
        return self.text.language

    @property
    def bucket(self) -> int:
        return self.text.bucket
