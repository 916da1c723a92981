"""The SYNTHETIC judged data set: labelled, seeded, lengths from the workload profile, and a
quality that depends on the prompt, so a predictor has something to learn."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np
import pytest

from duetime.predict import parse_row, text_features
from duetime.workload import load_workload
from duetime.workload.synth import synth_rows


@pytest.fixture(scope="module")
def rows():
    return list(synth_rows(400, 5))


def test_every_row_is_labelled_synthetic_and_valid(rows):
    assert len(rows) == 400 * 3
    assert all(r["synthetic"] is True for r in rows)
    parsed = [parse_row(r) for r in rows]
    assert all(p.synthetic and p.score is not None and p.output_tokens is not None
               and p.correct is not None for p in parsed)
    assert all(0.0 <= p.score <= 1.0 and p.output_tokens >= 1 for p in parsed)


def test_seeded(rows):
    assert list(synth_rows(20, 5)) == rows[:60]
    assert list(synth_rows(20, 6)) != rows[:60]


def test_the_mix_of_tasks_languages_and_forms(rows):
    one = [r for r in rows if r["model"] == "qwen3-8b"]
    tasks = Counter(r.get("task") for r in one)
    assert set(tasks) == {"alpaca", "hotpotqa", "govreport", "writingprompts", None}
    assert 0 < tasks[None] < 0.15 * len(one)  # a few rows leave the task out
    langs = Counter(r["meta"]["language"] for r in one)
    assert set(langs) == {"en", "zh", "ja", "ko"} and langs["en"] > 0.75 * len(one)
    assert 0.1 < sum("messages" in r for r in one) / len(one) < 0.3
    for r in one[:40]:  # the language the features see is the one generated
        text = r.get("prompt") or r["messages"][1]["content"]
        assert text_features(text).language == r["meta"]["language"]


def test_prompt_lengths_follow_the_workload_profile(rows):
    profile = load_workload("paper")
    for task, spec in profile.tasks.items():
        got = [t for r in rows if r["model"] == "qwen3-8b" and r.get("task") == task
               for t in [r["meta"]["prompt_tokens_estimate"]]]
        assert len(got) > 40
        median = statistics.median(got)
        assert 0.7 * spec.prompt.median < median < 1.4 * spec.prompt.median, task
        assert min(got) >= 0.5 * spec.prompt.lo and max(got) <= 1.3 * spec.prompt.hi, task


def test_quality_depends_on_length_and_content_within_a_task(rows):
    """What a learner can find: the small model's score falls with length within a task and
    with a hard keyword; the big model's falls less."""
    def corr(model):  # log length vs score, both centred within each task
        xs, ys = [], []
        for task in ("alpaca", "hotpotqa", "govreport", "writingprompts"):
            sel = [r for r in rows if r["model"] == model and r.get("task") == task]
            x = np.log([r["meta"]["prompt_tokens_estimate"] for r in sel])
            y = np.array([r["score"] for r in sel])
            xs.append(x - x.mean())
            ys.append(y - y.mean())
        return np.corrcoef(np.concatenate(xs), np.concatenate(ys))[0, 1]

    assert corr("qwen3-0.6b") < -0.2
    assert corr("qwen3-0.6b") < corr("qwen3-8b") < corr("qwen3-32b") < 0
    small = [r for r in rows if r["model"] == "qwen3-0.6b"]
    hard = np.mean([r["score"] for r in small if r["meta"]["hard_keywords"]])
    easy = np.mean([r["score"] for r in small if not r["meta"]["hard_keywords"]])
    assert hard < easy - 0.05
    by_model = {m: np.mean([r["score"] for r in rows if r["model"] == m])
                for m in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")}
    assert by_model["qwen3-0.6b"] < by_model["qwen3-8b"] < by_model["qwen3-32b"]


def test_output_lengths_depend_on_task_and_prompt(rows):
    def median_out(pred):
        return statistics.median(r["output_tokens"] for r in rows if pred(r))

    assert median_out(lambda r: r.get("task") == "hotpotqa") < \
        median_out(lambda r: r.get("task") == "writingprompts")
    text = {id(r): r.get("prompt") or r["messages"][1]["content"] for r in rows}
    brief = median_out(lambda r: r.get("task") == "alpaca" and "briefly" in text[id(r)])
    plain = median_out(lambda r: r.get("task") == "alpaca" and "briefly" not in text[id(r)])
    assert brief < 0.6 * plain


def test_a_custom_workload_profile(tmp_path):
    profile = tmp_path / "w.yaml"
    profile.write_text("""
name: tiny
models:
  small: {profile: qwen3-0.6b, price_usd_per_mtok: {prompt: 0.1, output: 0.2}}
  large: {profile: qwen3-8b, price_usd_per_mtok: {prompt: 0.3, output: 0.6}}
tasks:
  chat:
    share: 1
    prompt_tokens: {median: 30, sigma: 0.3, min: 8, max: 64}
    output_tokens: {median: 100, sigma: 0.3, min: 10, max: 300}
    accuracy: {small: 0.4, large: 0.8}
""")
    rows = list(synth_rows(10, 0, str(profile)))
    assert len(rows) == 20 and {r["model"] for r in rows} == {"small", "large"}
    assert {r.get("task") for r in rows} <= {"chat", None}
