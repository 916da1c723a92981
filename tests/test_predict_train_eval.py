"""Training, evaluation, persistence and the quality sources, on small SYNTHETIC data sets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from duetime.predict import (
    Oracle,
    Predictor,
    PredictorFormatError,
    Query,
    TaskTable,
    Trained,
    UnknownModelError,
    length_bucket,
    parse_row,
    remaining_tokens,
)
from duetime.predict.evaluation import evaluate
from duetime.predict.training import TrainingError, TrainOptions, train
from duetime.workload.synth import synth_rows

MODELS = ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]


def _rows(n, seed):
    return [parse_row(r, "<synth>", i + 1) for i, r in enumerate(synth_rows(n, seed))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A predictor trained on 300 synthetic prompts (900 rows)."""
    out = tmp_path_factory.mktemp("predict") / "model"
    summary = train(_rows(300, 11), out, TrainOptions(rounds=200))
    return out, summary


@pytest.fixture(scope="module")
def predictor(trained):
    return Predictor.load(trained[0])


@pytest.fixture(scope="module")
def held_out():
    return _rows(400, 12)


# -- quality of the predictions -----------------------------------------------------------------

def test_trained_predictors_beat_the_per_task_model_baselines(predictor, held_out):
    r = evaluate(predictor, held_out)
    assert r["quality"]["mae"] < 0.95 * r["quality"]["baseline_mae"]
    assert r["quality"]["rmse"] < r["quality"]["baseline_rmse"]
    assert r["length"]["mae"] < 0.97 * r["length"]["baseline_mae"]
    assert r["success"]["brier"] < r["success"]["baseline_brier"]
    assert 0.75 < r["length"]["p90_coverage"] < 0.97
    assert r["synthetic_training_data"] is True
    assert r["quality"]["n"] == r["length"]["n"] == r["success"]["n"] == len(held_out)


def test_inferred_tasks_and_languages_match_the_generator(predictor):
    raw = [r for r in synth_rows(200, 13) if r["model"] == "qwen3-8b"]
    hits = langs = 0
    for r in raw:
        text = r.get("prompt") or r["messages"][1]["content"]
        f = predictor.features(text)
        langs += f.language == r["meta"]["language"]
        if "task" in r:
            hits += f.task == r["task"] and f.task_inferred
    assert langs == len(raw)
    assert hits >= 0.9 * sum("task" in r for r in raw)


# -- the hot-path API ---------------------------------------------------------------------------

def test_predictions_for_several_models_at_once(predictor):
    f = predictor.features("Summarize the report above.\n" + "The audit found a deficit. " * 300,
                           "govreport")
    out = predictor.predict(f, MODELS)
    assert out.models == tuple(MODELS)
    lo, hi = predictor.quality_clip
    assert np.all((out.quality >= lo) & (out.quality <= hi))
    assert np.all(out.length_median <= out.length_p90)
    assert np.all(out.length_mean >= 1) and np.all((out.success > 0) & (out.success < 1))
    for i, m in enumerate(MODELS):  # vectorised == one model at a time
        one = predictor.predict(f, [m])
        for key in ("quality", "length_mean", "length_median", "length_p90", "success"):
            assert getattr(one, key)[0] == pytest.approx(getattr(out, key)[i], abs=1e-12)
    again = predictor.predict(f, [MODELS[2], MODELS[2]])
    assert again.quality[0] == again.quality[1] == pytest.approx(out.quality[2])
    with pytest.raises(UnknownModelError, match="'gpt-x' is not in the trained predictor"):
        predictor.predict(f, ["qwen3-8b", "gpt-x"])


def test_the_bigger_model_is_predicted_better_on_hard_long_prompts(predictor):
    text = ("Prove each claim formally. " + "The theorem implies the integral of the matrix. "
            * 200)
    out = predictor.predict_text(text, MODELS, task="govreport")
    assert out.quality[0] < out.quality[1] < out.quality[2] + 0.05
    assert out.success[0] < out.success[2]


def test_a_known_token_count_is_used(predictor):
    f = predictor.features("Summarize the report above.", "govreport", tokens=9000)
    assert f.tokens == 9000 and f.bucket == length_bucket(9000)
    q = Query("Summarize the report above.", "govreport", tokens=9000)
    Trained(predictor).qualities(q, MODELS)
    assert q.features.tokens == 9000


def test_unknown_and_missing_tasks(predictor):
    a = predictor.features("Write a poem about the sea.", "no-such-task")
    assert a.task == "no-such-task" and a.task_index == -1 and not a.task_inferred
    out = predictor.predict(a, MODELS)
    assert np.isfinite(out.quality).all()
    b = predictor.features("Write a poem about the sea.")
    assert b.task_inferred and b.task in predictor.tasks


def test_remaining_tokens_given_tokens_already_generated(predictor):
    out = predictor.predict_text("Explain in detail how a compiler works.", MODELS, "alpaca")
    first = out.remaining_tokens(0)
    assert np.all(first >= out.length_median)  # the mean of a right-skewed length
    late = out.remaining_tokens(10 * out.length_p90.max())
    later = out.remaining_tokens(100 * out.length_p90.max())
    assert np.all(late >= 1) and np.all(later >= late)  # a long tail: the longer, the longer
    med = out.remaining_tokens(out.length_median.max(), statistic="median")
    assert np.all(med >= 1)
    assert remaining_tokens(np.array([100.0]), np.array([100.0]), 1e9)[0] >= 1
    with pytest.raises(ValueError, match="statistic"):
        out.remaining_tokens(5, statistic="mode")


# -- persistence --------------------------------------------------------------------------------

def test_directory_is_text_and_json_only(trained):
    out, _ = trained
    names = sorted(p.name for p in out.iterdir())
    assert names == ["length_mean.txt", "length_median.txt", "length_p90.txt",
                     "predictor.json", "quality.txt"]
    spec = json.loads((out / "predictor.json").read_text())
    assert spec["format"] == "duetime-predictor" and spec["format_version"] == 1
    assert spec["synthetic_training_data"] is True


def test_round_trip_gives_identical_predictions(trained, predictor, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(trained[0], copy)
    other = Predictor.load(copy)
    f = predictor.features("List five facts about the volcano.", "alpaca")
    a, b = predictor.predict(f, MODELS), other.predict(other.features(
        "List five facts about the volcano.", "alpaca"), MODELS)
    for key in ("quality", "length_mean", "length_median", "length_p90", "success"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key))


def _edit_spec(d, edit):
    path = d / "predictor.json"
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


@pytest.mark.parametrize(("damage", "file", "message"), [
    (lambda d: (d / "predictor.json").unlink(), "predictor.json", "missing"),
    (lambda d: (d / "predictor.json").write_text("{not json"), "predictor.json",
     "not valid JSON"),
    (lambda d: _edit_spec(d, lambda s: s.update(format_version=2)), "predictor.json",
     "format_version 2 is not supported"),
    (lambda d: _edit_spec(d, lambda s: s.update(format="pickle")), "predictor.json",
     "not a duetime predictor"),
    (lambda d: _edit_spec(d, lambda s: s.pop("pca")), "predictor.json", "pca: missing"),
    (lambda d: _edit_spec(d, lambda s: s["pca"].update(mean=[1.0])), "predictor.json",
     "pca: expected"),
    (lambda d: _edit_spec(d, lambda s: s["heads"]["quality"].update(offsets=[[0.5]])),
     "predictor.json", "heads.quality.offsets: expected"),
    (lambda d: _edit_spec(d, lambda s: s.update(models=s["models"][:2])), "quality.txt",
     "the model reads"),
    (lambda d: _edit_spec(d, lambda s: s["features"].update(hash="python-hash")),
     "predictor.json", "another token hash"),
    (lambda d: _edit_spec(d, lambda s: s["features"].update(
        tokenizer={"kind": "tokenizer", "file": "tokenizer.json"})), "tokenizer.json", "missing"),
    (lambda d: _edit_spec(d, lambda s: s["success"]["models"].pop("qwen3-8b")),
     "predictor.json", "no entry for model 'qwen3-8b'"),
    (lambda d: _edit_spec(d, lambda s: s["heads"]["length_mean"].update(smearing=1.2)),
     "predictor.json", "length_mean.smearing: has the wrong type"),
    (lambda d: _edit_spec(d, lambda s: s["heads"]["length_mean"].update(smearing=[[1.0]])),
     "predictor.json", "length_mean.smearing: expected"),
    (lambda d: (d / "quality.txt").unlink(), "quality.txt", "missing"),
    (lambda d: (d / "length_p90.txt").write_text("tree\nversion=v4\n"), "length_p90.txt",
     "no max_feature_idx"),
    (lambda d: (d / "length_median.txt").write_text(
        (d / "length_median.txt").read_text()[:2000]), "length_median.txt", "truncated"),
])
def test_loading_errors_name_the_file(trained, tmp_path, damage, file, message):
    d = tmp_path / "model"
    shutil.copytree(trained[0], d)
    damage(d)
    with pytest.raises(PredictorFormatError, match=message) as e:
        Predictor.load(d)
    assert str(e.value).startswith(str(d / file))


def test_loading_a_missing_directory(tmp_path):
    with pytest.raises(PredictorFormatError, match="not a directory"):
        Predictor.load(tmp_path / "nowhere")


# -- partial labels, tokenizers -----------------------------------------------------------------

def test_heads_follow_the_labels_present(tmp_path):
    rows = _rows(60, 21)
    for r in rows:
        r.score = None
        r.correct = None
    train(rows, tmp_path / "len", TrainOptions(rounds=20))
    p = Predictor.load(tmp_path / "len")
    assert sorted(f.name for f in (tmp_path / "len").iterdir()) == [
        "length_mean.txt", "length_median.txt", "length_p90.txt", "predictor.json"]
    out = p.predict_text("Give three tips for travel.", MODELS, "alpaca")
    assert out.quality is None and out.success is None and out.length_median is not None
    with pytest.raises(ValueError, match="no quality head"):
        Trained(p).qualities(Query("hi"), MODELS)
    r = evaluate(p, _rows(20, 22))
    assert r["quality"] is None and r["success"] is None and r["length"]["n"] == 60


def test_success_only_and_no_labels(tmp_path):
    rows = _rows(60, 23)
    for r in rows:
        r.score = r.output_tokens = None
    train(rows, tmp_path / "s", TrainOptions(rounds=10))
    p = Predictor.load(tmp_path / "s")
    out = p.predict_text("Hello", MODELS)
    assert out.quality is None and out.length_median is None and out.success is not None
    assert Trained(p).successes(Query("Hello"), MODELS).shape == (3,)
    for r in rows:
        r.correct = None
    with pytest.raises(TrainingError, match="no labelled rows"):
        train(rows, tmp_path / "none", TrainOptions(rounds=10))


def test_rows_without_tasks_train_without_task_features(tmp_path):
    rows = _rows(40, 24)
    for r in rows:
        r.task = None
    train(rows, tmp_path / "nt", TrainOptions(rounds=10))
    p = Predictor.load(tmp_path / "nt")
    assert p.tasks == () and p.task_classifier is None
    f = p.features("Summarize the report above.")
    assert f.task is None and f.task_index == -1
    assert np.isfinite(p.predict(f, MODELS).quality).all()


def test_training_with_a_tokenizer_copies_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rows = _rows(40, 25)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([r.text for r in rows], trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "my-tokenizer.json"))
    train(rows, tmp_path / "m", TrainOptions(rounds=10, tokenizer=str(tmp_path /
                                                                      "my-tokenizer.json")))
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    p = Predictor.load(tmp_path / "m")
    text = "Explain what a theorem is."
    assert p.features(text).tokens == len(tok.encode(text, add_special_tokens=False).ids)


# -- quality sources ----------------------------------------------------------------------------

def test_task_table_defaults_to_the_paper():
    table = TaskTable()
    q = table.qualities(Query(task="govreport"), MODELS)
    np.testing.assert_allclose(q, [0.2902, 0.8662, 0.9593])
    assert table.quality(Query(task="alpaca"), "qwen3-8b") == pytest.approx(0.8267)
    unknown = table.qualities(Query(task="poetry"), ["qwen3-0.6b"])[0]
    assert unknown == pytest.approx(np.mean([0.5349, 0.2902, 0.4098, 0.1773]))
    assert table.success(Query(task="alpaca"), "qwen3-32b") == pytest.approx(0.8885)
    with pytest.raises(UnknownModelError, match="'llama' is not in the quality table"):
        table.qualities(Query(task="alpaca"), ["llama"])
    custom = TaskTable({"qa": {"a": 0.3, "b": 0.9}})
    np.testing.assert_allclose(custom.qualities(Query(task="qa"), ["b", "a"]), [0.9, 0.3])


def test_oracle_looks_up_what_the_simulator_fed():
    oracle = Oracle()
    oracle.feed("r1", {"a": 0.2, "b": 0.7}, success={"a": 0.1, "b": 0.95})
    oracle.feed(7, {"a": 0.5, "b": 0.6})
    np.testing.assert_allclose(oracle.qualities(Query(id="r1"), ["b", "a"]), [0.7, 0.2])
    np.testing.assert_allclose(oracle.successes(Query(id="r1"), ["a"]), [0.1])
    np.testing.assert_allclose(oracle.successes(Query(id=7), ["b"]), [0.6])  # = quality
    with pytest.raises(UnknownModelError, match="model 'c'"):
        oracle.qualities(Query(id=7), ["c"])
    oracle.forget("r1")
    with pytest.raises(KeyError, match="no quality fed for request 'r1'"):
        oracle.quality(Query(id="r1"), "a")


def test_trained_source_reuses_the_features(predictor):
    source = Trained(predictor)
    q = Query("Give three tips for working with a regex.", task="alpaca")
    quality = source.qualities(q, MODELS)
    assert q.features is not None
    f = q.features
    success = source.successes(q, MODELS)
    assert q.features is f  # featurised once
    direct = predictor.predict(predictor.features(q.text, "alpaca"), MODELS)
    np.testing.assert_allclose(quality, direct.quality)
    np.testing.assert_allclose(success, direct.success)
    np.testing.assert_allclose(source.qualities(f, MODELS), quality)  # features directly
    assert source.quality(q, "qwen3-8b") == pytest.approx(quality[1])
