"""Request features: the byte scan, language by character class, token counts (estimate and
a real tokenizer.json), hashing stability, length buckets, the PCA projection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from duetime.predict import (
    FAST,
    HFTokenizer,
    bucket_label,
    detect_language,
    length_bucket,
    text_features,
)
from duetime.predict import text_scan as ts
from duetime.predict.pca import N_COMPONENTS, HashedPCA
from duetime.workload.synth import synth_rows

# -- language -----------------------------------------------------------------------------------

UUID = "6ab6ea3e-f288-4f33-ba46-7f42bb75b03f"


@pytest.mark.parametrize(("text", "language"), [
    ("The weather is nice today.", "en"),
    ("Explain recursion to a beginner in three sentences!", "en"),
    ("今天天气很好，我们去公园散步吧。", "zh"),
    ("请总结上述报告。", "zh"),
    ("今日はいい天気ですね。公園に行きましょう。", "ja"),
    ("コンピュータ", "ja"),
    ("오늘은 날씨가 좋네요. 공원에 갑시다.", "ko"),
    ("위 보고서를 요약해 주세요.", "ko"),
    ("Сегодня хорошая погода, пойдём гулять.", "other"),
    ("مرحبا بالعالم، كيف حالك؟", "other"),
    ("Ça coûte très cher, n'est-ce pas ?", "en"),      # Latin with accents
    ("", "en"),
    ("12345 + 678 = ???", "en"),
    ("We flew to 北京 last spring and stayed for two long weeks in a small hotel.", "en"),
    ("我的の东西很好看，这是真的，大家都很喜欢。", "zh"),  # one stray kana does not make it ja
    ("你好", "zh"),
    ("は", "ja"),
])
def test_language_of_short_samples(text, language):
    assert text_features(text).language == language


def test_japanese_question_after_an_ascii_json_context_is_japanese():
    """LAAR's KV lookups: the context is ASCII JSON, the translated question decides."""
    context = "JSON data: {" + ", ".join(f'"{UUID}": "{UUID}"' for _ in range(400)) + "}"
    ja = context + f"\nキー: {UUID}。指定されたキーに関連付けられた値は何ですか："
    zh = context + f"\n键: {UUID}。与指定键关联的值是什么："
    assert text_features(ja).language == "ja"
    assert text_features(zh).language == "zh"
    assert text_features(context + f"\nKey: {UUID}. The value is:").language == "en"


def test_language_uses_a_sample_of_head_and_tail_only():
    middle = "这是中文。" * 2000
    text = "Read this. " * 200 + middle + " Now answer in English. " * 200
    assert text_features(text).language == "en"  # the Chinese is outside both samples
    assert text_features(middle + " Answer briefly.").language == "zh"


def test_detect_language_reads_sample_counts():
    stats = [0] * ts.N_STATS
    stats[ts.S_HANGUL] = 5
    assert detect_language(stats) == "ko"
    stats[ts.S_HANGUL], stats[ts.S_KANA], stats[ts.S_CJK] = 0, 3, 10
    assert detect_language(stats) == "ja"


# -- the scan's counts --------------------------------------------------------------------------

def test_scan_counts_sentences_lines_words_and_scripts():
    text = ("Hello world. This is a test! Is 3.14 pi? e.g. fine\n"
            "北京是中国的首都。東京はにほんのしゅとです。서울은 수도입니다. Привет café")
    tf = text_features(text)
    st = tf.stats
    assert tf.lines == 2
    assert tf.chars == len(text)
    # Hello world. | This is a test! | Is 3.14 pi? | e.g. (counts) | fine 北京…首都。 |
    # 東京…です。 | 서울은 수도입니다. | Привет café
    assert tf.sentences == 8
    assert st[ts.DIGITS] == 3
    assert st[ts.CJK] == 10 and st[ts.KANA] == 10 and st[ts.HANGUL] == 8
    assert st[ts.WORDS] == 13  # alphabetic runs incl. e, g, Привет, café; digits are not words
    assert st[ts.OTHER_LETTERS] == 7  # Привет (6) + é


def test_scan_of_empty_and_whitespace_text():
    for text in ("", "   \n\t "):
        tf = text_features(text)
        assert tf.tokens == 0 and tf.sentences == 0 and tf.words == 0
        assert not tf.counts.any()
    assert text_features("").lines == 0
    assert text_features("\n\n").lines == 3


def test_words_are_hashed_case_insensitively_and_cjk_per_character():
    counts, _ = ts.scan_text("Hello hello HELLO")
    assert counts.sum() == 3 and counts[ts.token_bucket("hello")] == 3
    counts, _ = ts.scan_text("北京北京")
    assert counts.sum() == 4
    assert counts[ts.token_bucket("北")] >= 2 and counts[ts.token_bucket("京")] >= 2


# -- hashing stability --------------------------------------------------------------------------

STABILITY_TEXT = ("Summarize the report above. 北京是中国的首都。東京はにほんです。"
                  "서울은 수도입니다. Привет café 2024 step-by-step!")


def test_bucket_values_are_pinned():
    """Changing the hash silently would invalidate every trained model: pin a few buckets."""
    assert [ts.token_bucket(w) for w in ("hello", "the", "summarize", "北", "café")] == \
        PINNED_BUCKETS
    assert ts.HASH_NAME == "fnv1a32-avalanche-512"


PINNED_BUCKETS = [193, 428, 73, 61, 407]


_CHILD = """
import json, sys
from duetime.predict import text_scan as ts
counts, stats = ts.scan_text(sys.argv[1])
print(json.dumps({"counts": counts.tolist(), "stats": stats.tolist(), "hash": hash("x")}))
"""


@pytest.mark.parametrize("env", [{"PYTHONHASHSEED": "1"}, {"PYTHONHASHSEED": "12345"},
                                 {"PYTHONHASHSEED": "7", "DUETIME_NO_JIT": "1"}],
                         ids=["seed1", "seed12345", "pure-python"])
def test_hashing_is_the_same_in_other_processes(env):
    counts, stats = ts.scan_text(STABILITY_TEXT)
    out = subprocess.run([sys.executable, "-c", _CHILD, STABILITY_TEXT], capture_output=True,
                         text=True, check=True, env={**os.environ, **env})
    child = json.loads(out.stdout)
    assert child["counts"] == counts.tolist()
    assert child["stats"] == stats.tolist()


# -- length buckets -----------------------------------------------------------------------------

@pytest.mark.parametrize(("tokens", "bucket"), [
    (0, 0), (1, 0), (16, 0), (22, 0), (23, 1), (128, 3), (4000, 8), (4096, 8), (4200, 8),
    (5792, 8), (5793, 9), (8192, 9), (65536, 12), (131072, 13), (10**7, 13)])
def test_length_buckets_are_nearest_powers_of_two(tokens, bucket):
    assert length_bucket(tokens) == bucket


def test_bucket_labels():
    assert bucket_label(0) == "~16" and bucket_label(8) == "~4096" and bucket_label(13) == "~131072"


# -- token counts -------------------------------------------------------------------------------

def _corpus(n: int, seed: int) -> list[str]:
    return [r.get("prompt") or r["messages"][1]["content"]
            for r in synth_rows(n, seed) if r["model"] == "qwen3-8b"]


@pytest.fixture(scope="module")
def tiny_bpe(tmp_path_factory):
    """A small byte-level BPE trained offline on synthetic English (no hub download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [t for t in _corpus(120, 3) if text_features(t).language == "en"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=3000,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_counts_exactly(tiny_bpe):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_bpe))
    tok = HFTokenizer(tiny_bpe)
    for text in ("Summarize the report above.", "The early noodle examines the oven. " * 50):
        assert tok.count(text) == len(raw.encode(text, add_special_tokens=False).ids)
        assert text_features(text, tok).tokens == tok.count(text)


def test_fast_estimate_is_close_to_a_trained_bpe(tiny_bpe):
    """On held-out English prompts the estimate is within 20% of a BPE that learned the
    vocabulary (it overcounts a little: this BPE holds long words whole). The error against a
    real tokenizer is measured by benchmarks/predict_speed.py."""
    tok = HFTokenizer(tiny_bpe)
    texts = [t for t in _corpus(60, 9) if text_features(t).language == "en"]
    ratios = np.array([text_features(t).tokens / tok.count(t) for t in texts])
    assert len(texts) >= 30
    assert np.all(np.abs(ratios - 1) < 0.2), ratios
    assert abs(np.median(ratios) - 1) < 0.15


def test_hf_tokenizer_rejects_a_non_tokenizer_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"not a tokenizer\.json"):
        HFTokenizer(bad)


def test_fast_estimate_counts_scripts():
    assert FAST.count("", [0] * ts.N_STATS) == 0
    assert text_features("hi").tokens == 1
    assert text_features("北京是中国的首都").tokens == 8
    assert text_features("one two three four five").tokens == 5


# -- PCA ----------------------------------------------------------------------------------------

def test_compiled_projection_matches_numpy():
    rng = np.random.default_rng(0)
    counts = rng.poisson(0.5, size=(50, ts.N_BUCKETS)).astype(float)
    counts[0] = 0.0
    counts[1, :5] = [300.0, 1000.0, 2.5, 7.0, 0.0]  # beyond the log1p table, non-integer
    pca = HashedPCA.fit(counts)
    assert pca.components.shape == (N_COMPONENTS, ts.N_BUCKETS)
    for row in counts:
        out = np.empty(N_COMPONENTS)
        pca.project_into(row, out)
        np.testing.assert_allclose(out, pca.project(row), atol=1e-12)
    assert np.allclose(pca.project(counts[0]), -pca.components @ pca.mean)


def test_pca_round_trip_and_small_fits():
    pca = HashedPCA.fit(np.ones((1, ts.N_BUCKETS)))  # one prompt: no components, no error
    assert not pca.components.any()
    rng = np.random.default_rng(1)
    pca = HashedPCA.fit(rng.poisson(1.0, size=(5, ts.N_BUCKETS)))
    assert np.count_nonzero(np.abs(pca.components).sum(axis=1)) == 4  # n - 1 components
    back = HashedPCA.from_dict(json.loads(json.dumps(pca.to_dict())))
    np.testing.assert_array_equal(back.components, pca.components)
    with pytest.raises(ValueError, match="pca: expected"):
        HashedPCA.from_dict({**pca.to_dict(), "mean": [0.0] * 3})


def test_odd_text_does_not_break_the_scan():
    for text in ("a\ud800b", "\x00\x01\x02", "🙂" * 50 + " ok", "x" * 100_000,
                 "é" * 5 + "\u3000" + "ｱｲｳ"):
        tf = text_features(text)
        assert tf.chars >= 1 and tf.tokens >= 1
    assert text_features("ｱｲｳｴｵ").language == "ja"  # half-width katakana
