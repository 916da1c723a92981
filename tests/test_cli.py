"""The ``duetime`` command: ``duetime.cli.main(argv)`` in-process, plus one ``python -m`` run."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import duetime
from duetime.cli import DEMO_PROBES, main
from duetime.engine import Snapshot, forecast, load_profile, profile_names

# The example of docs/engine.md, "Snapshots".
SNAPSHOT = {
    "version": 1,
    "time": 12.345,
    "config": {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 32768,
               "block_size": 16, "num_gpu_blocks": 100000, "long_prefill_token_threshold": 0},
    "batch_time": {"model": "paper4",
                   "coefficients": {"b0": 0.004, "b1": 2.0e-5, "b2": 5.0e-8, "b3": 1.0e-9}},
    "running": [{"id": "a", "prompt_tokens": 1200, "computed_tokens": 1200, "output_tokens": 35,
                 "predicted_output_tokens": 300, "arrival": 10.0}],
    "waiting": [{"id": "b", "prompt_tokens": 5000, "computed_tokens": 0, "output_tokens": 0,
                 "predicted_output_tokens": 120, "arrival": 12.3}],
}


@pytest.fixture
def snap_file(tmp_path):
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(SNAPSHOT))
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    return json.loads(out)


# -- forecast -----------------------------------------------------------------------------------

def test_forecast_file_matches_the_api(capsys, snap_file):
    got = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "512")
    assert set(got) == {"estimate_s", "steps"}
    assert got["estimate_s"] > 0 and got["steps"] >= 1
    assert got == forecast(Snapshot.from_dict(SNAPSHOT), 512).to_dict()


def test_forecast_finish_is_later_than_first_token(capsys, snap_file):
    first = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "512")
    finish = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "512",
                      "--predicted-output-tokens", "50", "--until", "finish")
    assert finish["estimate_s"] > first["estimate_s"]
    assert finish["steps"] > first["steps"]


def test_forecast_trace(capsys, snap_file):
    got = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "512", "--trace")
    assert set(got) == {"estimate_s", "steps", "trace"}
    plain = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "512")
    assert got["estimate_s"] == pytest.approx(plain["estimate_s"])
    trace = got["trace"]
    assert trace and all({"end", "duration", "prefill", "decode", "preempted"} <= set(s)
                          for s in trace)
    # estimate_s is measured from the snapshot's time; the probe's first token ends the trace.
    assert trace[-1]["end"] == pytest.approx(SNAPSHOT["time"] + got["estimate_s"])


def test_forecast_indent(capsys, snap_file):
    code, out, _ = run(capsys, "forecast", snap_file, "--prompt-tokens", "16", "--indent", "2")
    assert code == 0 and out.startswith('{\n  "estimate_s"')


def test_forecast_from_stdin(capsys, monkeypatch, snap_file):
    from_file = run_json(capsys, "forecast", snap_file, "--prompt-tokens", "2048")
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(SNAPSHOT)))
    assert run_json(capsys, "forecast", "-", "--prompt-tokens", "2048") == from_file


# -- errors: one line on stderr, exit 2, nothing on stdout -------------------------------------

def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2
    assert out == ""
    assert err.startswith("duetime: error: ") and err.endswith("\n") and err.count("\n") == 1
    assert "Traceback" not in err
    for f in fragments:
        assert f in err


def with_file(tmp_path, text: str | bytes) -> str:
    path = tmp_path / "bad.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def bad_request(field: str, value):
    d = json.loads(json.dumps(SNAPSHOT))
    d["running"][0][field] = value
    return json.dumps(d)


@pytest.mark.parametrize(("content", "fragments"), [
    (None, ["missing.json", "No such file"]),
    ("{not json", ["not valid JSON", "line 1"]),
    ("", ["not valid JSON"]),
    (b"\xff\xfe\x00", ["not UTF-8"]),
    ("[1, 2]", ["must be a JSON object"]),
    ('{"running": []}', ["snapshot.batch_time"]),
    (bad_request("prompt_tokens", 0), ["snapshot.running[0].prompt_tokens"]),
    (bad_request("computed_tokens", 99999), ["snapshot.running[0]"]),
], ids=["missing-file", "invalid-json", "empty-file", "not-utf8", "not-an-object",
        "no-batch-time", "bad-field", "inconsistent"])
def test_bad_snapshot_file(capsys, tmp_path, content, fragments):
    path = str(tmp_path / "missing.json") if content is None else with_file(tmp_path, content)
    code, out, err = run(capsys, "forecast", path, "--prompt-tokens", "16")
    assert_one_line_error(code, out, err, *fragments)


def test_bad_snapshot_on_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("{oops"))
    code, out, err = run(capsys, "forecast", "-", "--prompt-tokens", "16")
    assert_one_line_error(code, out, err, "<stdin>", "not valid JSON")


def test_directory_is_not_a_snapshot(capsys, tmp_path):
    code, out, err = run(capsys, "forecast", str(tmp_path), "--prompt-tokens", "16")
    assert_one_line_error(code, out, err, "cannot read")


@pytest.mark.parametrize(("args", "fragments"), [
    (["--prompt-tokens", "0"], ["prompt_tokens"]),
    (["--prompt-tokens", "-5"], ["prompt_tokens"]),
    (["--prompt-tokens", "40000"], ["prompt_tokens", "max_model_len"]),
    (["--prompt-tokens", "16", "--until", "finish"], ["predicted_output_tokens"]),
    (["--prompt-tokens", "16", "--until", "finish", "--predicted-output-tokens", "0"],
     ["predicted_output_tokens"]),
    (["--prompt-tokens", "many"], ["--prompt-tokens", "invalid int"]),
    (["--prompt-tokens", "16", "--until", "soon"], ["--until"]),
    ([], ["--prompt-tokens"]),
], ids=["zero", "negative", "too-long", "finish-needs-output", "zero-output", "not-an-int",
        "bad-until", "no-probe"])
def test_bad_probe(capsys, snap_file, args, fragments):
    code, out, err = run(capsys, "forecast", snap_file, *args)
    assert_one_line_error(code, out, err, *fragments)


@pytest.mark.parametrize(("argv", "fragment"), [
    ([], "COMMAND"),
    (["launch"], "launch"),
    (["snapshot"], "SUBCOMMAND"),
    (["snapshot", "example", "--profile", "nope"], "nope"),
    (["snapshot", "example", "--running", "-1"], "--running"),
    (["demo", "--profile", "nope"], "nope"),
    (["profiles", "--colour"], "--colour"),
])
def test_usage_errors(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert_one_line_error(code, out, err, fragment, "--help")


def test_example_that_does_not_fit_its_profile(capsys):
    name = profile_names()[0]
    too_many = load_profile(name).config.max_num_seqs + 1
    code, out, err = run(capsys, "snapshot", "example", "--profile", name,
                         "--running", str(too_many), "--waiting", "0")
    assert_one_line_error(code, out, err, name, "scheduler config", "max_num_seqs", "--running")


def test_demo_workload_that_does_not_fit(capsys):
    code, out, err = run(capsys, "demo", "--running", "5000")
    assert_one_line_error(code, out, err, "do not fit", "--running")


# -- help and version ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["forecast", "--help"], ["profiles", "-h"],
                                  ["snapshot", "--help"], ["snapshot", "example", "--help"],
                                  ["demo", "--help"]])
def test_help_everywhere(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    assert out.startswith("usage: duetime")


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"duetime {duetime.__version__}"


def test_python_m_duetime_help():
    proc = subprocess.run([sys.executable, "-m", "duetime", "--help"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: duetime")
    for command in ("forecast", "profiles", "snapshot", "demo"):
        assert command in proc.stdout


# -- profiles -----------------------------------------------------------------------------------

def test_profiles_text(capsys):
    code, out, err = run(capsys, "profiles")
    assert (code, err) == (0, "")
    for name in profile_names():
        p = load_profile(name)
        assert f"{name} [measured]: {p.description}" in out
        assert p.batch_time.to_dict()["model"] in out
        assert f"num_gpu_blocks={p.config.num_gpu_blocks}" in out


def test_profiles_json(capsys):
    got = run_json(capsys, "profiles", "--json")
    assert [p["name"] for p in got] == profile_names()
    for p in got:
        profile = load_profile(p["name"])
        assert p["description"] == profile.description
        assert p["batch_time"] == profile.batch_time.to_dict()
        assert p["config"] == profile.config.to_dict()


# -- snapshot example ---------------------------------------------------------------------------

def test_snapshot_example_round_trips_into_forecast(capsys, tmp_path):
    data = run_json(capsys, "snapshot", "example", "--seed", "7")
    snap = Snapshot.from_dict(data)
    assert (len(data["running"]), len(data["waiting"])) == (200, 20)
    assert snap.to_dict() == data
    path = tmp_path / "example.json"
    path.write_text(json.dumps(data))
    got = run_json(capsys, "forecast", str(path), "--prompt-tokens", "2048")
    assert got == forecast(snap, 2048).to_dict()
    assert got["estimate_s"] > 0


def test_snapshot_example_is_seeded(capsys):
    a = run(capsys, "snapshot", "example", "--seed", "1", "--running", "30")[1]
    b = run(capsys, "snapshot", "example", "--seed", "1", "--running", "30")[1]
    c = run(capsys, "snapshot", "example", "--seed", "2", "--running", "30")[1]
    assert a == b != c


def test_snapshot_example_with_a_profile(capsys):
    name = profile_names()[-1]
    profile = load_profile(name)
    data = run_json(capsys, "snapshot", "example", "--profile", name, "--running", "5",
                    "--waiting", "3")
    assert (len(data["running"]), len(data["waiting"])) == (5, 3)
    assert data["config"] == profile.config.to_dict()
    assert data["batch_time"] == profile.batch_time.to_dict()
    Snapshot.from_dict(data)


# -- demo ---------------------------------------------------------------------------------------

def test_demo_all_profiles(capsys):
    code, out, err = run(capsys, "demo")
    assert (code, err) == (0, "")
    assert "200 running + 20 waiting" in out
    for name in profile_names():
        assert name in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("profile"))
    rows = lines[header + 2:header + 2 + len(DEMO_PROBES) * len(profile_names())]
    assert [int(r.split()[-4]) for r in rows] == list(DEMO_PROBES) * len(profile_names())
    for r in rows:
        ttft_ms, steps, us = r.split()[-3:]
        assert float(ttft_ms) > 0 and int(steps) >= 1 and float(us) >= 0


def test_demo_named_profiles(capsys):
    first, *rest = profile_names()
    code, out, err = run(capsys, "demo", "--profile", first, "--running", "20", "--waiting", "2",
                         "--seed", "3")
    assert (code, err) == (0, "")
    assert first in out and not any(name in out for name in rest)
    assert "20 running + 2 waiting" in out


# -- forecast requests (a snapshot with a "probe") ----------------------------------------------

def test_forecast_request_form(capsys, tmp_path):
    req = dict(SNAPSHOT, probe={"prompt_tokens": 512, "predicted_output_tokens": 40},
               until="finish")
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    snap = Snapshot.from_dict(SNAPSHOT)
    got = run_json(capsys, "forecast", str(path))
    assert got == forecast(snap, 512, 40, until="finish").to_dict()
    # Options override the request.
    got = run_json(capsys, "forecast", str(path), "--until", "first_token")
    assert got == forecast(snap, 512).to_dict()
    got = run_json(capsys, "forecast", str(path), "--prompt-tokens", "64", "--until",
                   "first_token")
    assert got == forecast(snap, 64).to_dict()


def test_forecast_needs_a_probe(capsys, snap_file):
    code, out, err = run(capsys, "forecast", snap_file)
    assert_one_line_error(code, out, err, "--prompt-tokens", "probe")


@pytest.mark.parametrize(("probe", "fragment"), [
    ({"prompt_tokens": "many"}, "prompt_tokens"),
    ([512], "probe"),
])
def test_bad_forecast_request(capsys, tmp_path, probe, fragment):
    path = tmp_path / "req.json"
    path.write_text(json.dumps(dict(SNAPSHOT, probe=probe)))
    code, out, err = run(capsys, "forecast", str(path))
    assert_one_line_error(code, out, err, fragment)


def test_forecast_behind_a_request_that_never_fits_is_null_with_the_reason(capsys, tmp_path):
    """A waiting prompt larger than the whole KV cache blocks the queue for good (vLLM's
    full-sequence admission): the probe behind it never gets a first token."""
    d = {"version": 1, "time": 0.0,
         "config": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "max_model_len": 4096,
                    "block_size": 16, "num_gpu_blocks": 9},
         "batch_time": {"model": "paper4",
                        "coefficients": {"b0": 0.004, "b1": 2e-5, "b2": 5e-8, "b3": 1e-9}},
         "running": [],
         "waiting": [{"id": "big", "prompt_tokens": 200, "predicted_output_tokens": 5}]}
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(d))
    assert main(["forecast", str(p), "--prompt-tokens", "10"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["estimate_s"] is None
    assert "'big' can never be admitted" in out["reason"] and "8" in out["reason"]


def test_forecast_a_probe_on_a_lora_adapter(tmp_path, capsys):
    """``--lora``: with ``max_loras`` 1 and a request on adapter 1 decoding, a probe on
    adapter 2 is skipped until it finishes, one on adapter 1 or the base model is not; a
    forecast request's ``probe.lora`` says the same; a bad id is a one-line error."""
    snap = {"version": 3, "config": {"max_num_batched_tokens": 512, "max_num_seqs": 8,
                                     "max_model_len": 4096, "num_gpu_blocks": 1000,
                                     "max_loras": 1},
            "batch_time": {"model": "paper4", "coefficients": {"b0": 0.01, "b1": 1e-5,
                                                               "b2": 0.0, "b3": 0.0}},
            "running": [{"id": "a", "prompt_tokens": 100, "computed_tokens": 100,
                         "output_tokens": 1, "predicted_output_tokens": 40, "lora": 1}]}
    path = tmp_path / "lora.json"
    path.write_text(json.dumps(snap))
    got = {}
    for lora in ("0", "1", "2"):
        code, out, _ = run(capsys, "forecast", str(path), "--prompt-tokens", "50",
                           "--lora", lora)
        assert code == 0
        got[lora] = json.loads(out)["steps"]
    assert got["0"] == got["1"] == 1
    assert got["2"] == 40  # after a's 39 remaining decode steps
    path.write_text(json.dumps({**snap, "probe": {"prompt_tokens": 50, "lora": 2}}))
    code, out, _ = run(capsys, "forecast", str(path))
    assert code == 0 and json.loads(out)["steps"] == 40
    code, _, err = run(capsys, "forecast", str(path), "--lora", "-1")
    assert code != 0 and "lora: must be an adapter id" in err and len(err.splitlines()) == 1
