"""``duetime predict synth | train | eval`` end to end, and bad input reported as one line
``duetime: error: FILE:LINE: FIELD: reason`` with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from duetime.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def fails(capsys, *argv: str) -> str:
    """The one error line of a command that must fail with exit status 2."""
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("duetime: error: "), err
    return lines[0].removeprefix("duetime: error: ")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """synth (train and held-out sets) and train, through the CLI, once for the module."""
    d = tmp_path_factory.mktemp("cli")
    assert main(["predict", "synth", "--out", str(d / "train.jsonl"), "--n", "240",
                 "--seed", "3"]) == 0
    assert main(["predict", "synth", "--out", str(d / "test.jsonl"), "--n", "300",
                 "--seed", "4"]) == 0
    assert main(["predict", "train", "--data", str(d / "train.jsonl"), "--out",
                 str(d / "model"), "--rounds", "150"]) == 0
    return d


def test_synth_writes_labelled_synthetic_rows(workdir):
    rows = [json.loads(line) for line in (workdir / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 240 * 3
    assert all(r["synthetic"] is True for r in rows)
    assert {r["model"] for r in rows} == {"qwen3-0.6b", "qwen3-8b", "qwen3-32b"}


def test_synth_message_and_determinism(capsys, tmp_path):
    code, out, err = run(capsys, "predict", "synth", "--out", str(tmp_path / "a.jsonl"),
                         "--n", "5", "--seed", "9")
    assert code == 0 and err == ""
    assert "wrote 15 SYNTHETIC rows (5 prompts x 3 models" in out
    run(capsys, "predict", "synth", "--out", str(tmp_path / "b.jsonl"), "--n", "5",
        "--seed", "9")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_train_wrote_the_model(workdir):
    assert (workdir / "model" / "predictor.json").is_file()
    assert (workdir / "model" / "quality.txt").is_file()


def test_eval_json_beats_baselines(capsys, workdir):
    code, out, err = run(capsys, "predict", "eval", "--model", str(workdir / "model"),
                         "--data", str(workdir / "test.jsonl"), "--json")
    assert code == 0 and err == ""
    r = json.loads(out)
    assert {"mae", "baseline_mae", "rmse", "baseline_rmse", "n"} <= set(r["quality"])
    assert {"mae", "baseline_mae", "rmse", "baseline_rmse", "p90_coverage"} <= set(r["length"])
    assert {"brier", "baseline_brier", "roc_auc", "baseline_roc_auc"} <= set(r["success"])
    assert r["quality"]["mae"] < r["quality"]["baseline_mae"]
    assert r["length"]["mae"] < r["length"]["baseline_mae"]
    assert r["success"]["brier"] < r["success"]["baseline_brier"]


def test_eval_table(capsys, workdir):
    code, out, _ = run(capsys, "predict", "eval", "--model", str(workdir / "model"),
                       "--data", str(workdir / "test.jsonl"))
    assert code == 0
    assert "trained on SYNTHETIC data" in out
    for word in ("quality", "length", "success", "brier", "roc_auc", "baseline"):
        assert word in out


def test_train_progress_goes_to_stderr(capsys, workdir, tmp_path):
    code, out, err = run(capsys, "predict", "train", "--data", str(workdir / "test.jsonl"),
                         "--out", str(tmp_path / "m"), "--rounds", "5")
    assert code == 0
    assert out.startswith("trained on 900 rows (synthetic data)")
    assert "quality: 900 rows" in err


# -- bad rows -----------------------------------------------------------------------------------

GOOD = {"prompt": "Say hi.", "task": "alpaca", "model": "m1", "score": 0.5,
        "output_tokens": 12, "correct": True}


@pytest.mark.parametrize(("row", "where"), [
    ('{"task": "alpaca", "model": "m1"}', "prompt: missing"),
    ('{"prompt": 5, "model": "m1"}', "prompt: must be a string"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}], "model": "m1"}',
     "prompt: give either prompt or messages"),
    ('{"messages": "hello", "model": "m1"}', "messages: must be a non-empty list"),
    ('{"messages": [], "model": "m1"}', "messages: must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "a"}, 3], "model": "m1"}',
     "messages[1]: must be an object"),
    ('{"messages": [{"role": "user", "content": 7}], "model": "m1"}',
     "messages[0].content: must be a string, a list of parts or null"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}], '
     '"model": "m1"}', "messages[0].content[0].text: must be a string"),
    ('{"prompt": "a"}', "model: missing"),
    ('{"prompt": "a", "model": ""}', "model: must be a non-empty string"),
    ('{"prompt": "a", "model": 3}', "model: must be a non-empty string"),
    ('{"prompt": "a", "model": "m1", "task": 4}', "task: must be a non-empty string"),
    ('{"prompt": "a", "model": "m1", "score": "high"}', "score: must be a finite number"),
    ('{"prompt": "a", "model": "m1", "score": true}', "score: must be a finite number"),
    ('{"prompt": "a", "model": "m1", "score": NaN}', "score: must be a finite number"),
    ('{"prompt": "a", "model": "m1", "output_tokens": -3}', "output_tokens: must be an integer"),
    ('{"prompt": "a", "model": "m1", "output_tokens": 2.5}', "output_tokens: must be an integer"),
    ('{"prompt": "a", "model": "m1", "correct": "yes"}', "correct: must be true, false"),
    ('[1, 2]', "a row must be a JSON object"),
    ('{"prompt": "a", "model": "m1"', "not valid JSON"),
])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_malformed_row_names_file_line_and_field(capsys, tmp_path, workdir, row, where,
                                                   command):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + row + "\n" + json.dumps(GOOD) + "\n")
    args = (["predict", "train", "--data", str(path), "--out", str(tmp_path / "m")]
            if command == "train" else
            ["predict", "eval", "--model", str(workdir / "model"), "--data", str(path)])
    assert fails(capsys, *args).startswith(f"{path}:3: {where}")


def test_valid_variants_are_accepted(tmp_path):
    from duetime.predict import read_rows

    path = tmp_path / "ok.jsonl"
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                   {"type": "image_url", "image_url": {}}]},
                      {"role": "assistant", "content": None}], "model": "m"},
        {"prompt": "x", "model": "m", "task": None, "score": 7, "output_tokens": 3.0,
         "correct": 0, "extra": {"ignored": True}},
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    a, b = read_rows(path)
    assert a.text == "Be brief.\nHi" and a.line == 1
    assert b.score == 7.0 and b.output_tokens == 3 and b.correct is False and b.task is None


@pytest.mark.parametrize(("content", "message"), [
    (b"", "no rows"),
    (b"\n   \n", "no rows"),
    (b'{"prompt": "a", "model": "m"}\n\xff\xfe bad\n', ":2: not UTF-8 text"),
])
def test_a_malformed_file_is_named(capsys, tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    err = fails(capsys, "predict", "train", "--data", str(path), "--out", str(tmp_path / "m"))
    assert err.startswith(str(path)) and message in err


def test_missing_data_file(capsys, tmp_path):
    err = fails(capsys, "predict", "train", "--data", str(tmp_path / "nope.jsonl"), "--out",
                str(tmp_path / "m"))
    assert err.startswith(f"{tmp_path / 'nope.jsonl'}: cannot read")


def test_rows_without_labels_cannot_train(capsys, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "model": "m"}\n')
    assert "no labelled rows" in fails(capsys, "predict", "train", "--data", str(path),
                                       "--out", str(tmp_path / "m"))


def test_out_must_be_a_directory(capsys, tmp_path, workdir):
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in fails(capsys, "predict", "train", "--data",
                                         str(workdir / "test.jsonl"), "--out",
                                         str(tmp_path / "file"))


def test_eval_errors(capsys, tmp_path, workdir):
    err = fails(capsys, "predict", "eval", "--model", str(tmp_path), "--data",
                str(workdir / "test.jsonl"))
    assert err == f"{tmp_path / 'predictor.json'}: missing (not a trained predictor directory?)"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({**GOOD, "model": "qwen3-8b"}) + "\n"
                    + json.dumps({**GOOD, "model": "gpt-9"}) + "\n")
    err = fails(capsys, "predict", "eval", "--model", str(workdir / "model"), "--data",
                str(path))
    assert err.startswith(f"{path}:2: model: 'gpt-9' is not in the trained predictor")


@pytest.mark.parametrize("argv", [
    ["predict"], ["predict", "synth", "--out", "{x}", "--n", "0"], ["predict", "train"],
    ["predict", "eval", "--data", "{x}"],
    ["predict", "synth", "--out", "{x}", "--workload", "nope"],
])
def test_usage_errors(capsys, tmp_path, argv):
    fails(capsys, *[a.format(x=tmp_path / "x") for a in argv])
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_python_m_duetime_predict_runs_in_a_fresh_process(tmp_path):
    out = subprocess.run([sys.executable, "-m", "duetime", "predict", "synth", "--out",
                          str(tmp_path / "s.jsonl"), "--n", "2"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 6
