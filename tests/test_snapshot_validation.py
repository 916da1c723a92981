"""``Snapshot.from_dict`` / ``Snapshot.load`` reject bad snapshots with a ``SnapshotError`` whose
message names the field path and the reason (``docs/engine.md``, "Snapshots")."""

from __future__ import annotations

import copy
import json
import re

import pytest

import duetime
from duetime import Snapshot, SnapshotError


def valid() -> dict:
    """The format document's example, shrunk: 1 running decoder, 1 waiting prompt."""
    return {
        "version": 1,
        "time": 12.345,
        "config": {"max_num_batched_tokens": 8192, "max_num_seqs": 4, "max_model_len": 32768,
                   "block_size": 16, "num_gpu_blocks": 100, "long_prefill_token_threshold": 0},
        "batch_time": {"model": "paper4",
                       "coefficients": {"b0": 0.004, "b1": 2.0e-5, "b2": 5.0e-8, "b3": 1.0e-9}},
        "running": [{"id": "a", "prompt_tokens": 1200, "computed_tokens": 1200,
                     "output_tokens": 35, "predicted_output_tokens": 300, "arrival": 10.0}],
        "waiting": [{"id": "b", "prompt_tokens": 5000, "computed_tokens": 0,
                     "output_tokens": 0, "predicted_output_tokens": 120, "arrival": 12.3}],
    }


def bad(mutate) -> dict:
    d = copy.deepcopy(valid())
    mutate(d)
    return d


def expect_error(d, path: str, reason: str) -> SnapshotError:
    """``path`` must appear literally and ``reason`` (a regex) anywhere, case-insensitive."""
    with pytest.raises(SnapshotError) as info:
        Snapshot.from_dict(d)
    msg = str(info.value)
    assert path in msg, msg
    assert re.search(reason, msg, re.IGNORECASE), msg
    return info.value


def test_the_valid_example_loads():
    s = Snapshot.from_dict(valid())
    assert s.time == 12.345
    assert s.config.num_gpu_blocks == 100 and s.model.name == "paper4"
    assert [r.id for r in s.running] == ["a"] and [r.id for r in s.waiting] == ["b"]
    assert issubclass(SnapshotError, ValueError)
    assert duetime.SnapshotError is SnapshotError


# -- shape and types ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [[], "snapshot", None, 3, [valid()]])
def test_non_object_input(value):
    with pytest.raises(SnapshotError, match=r"^snapshot\b.*object"):
        Snapshot.from_dict(value)


@pytest.mark.parametrize(("mutate", "path", "reason"), [
    (lambda d: d.pop("batch_time"), "snapshot.batch_time", "required"),
    (lambda d: d["running"][0].pop("prompt_tokens"),
     "snapshot.running[0].prompt_tokens", "required"),
    (lambda d: d["waiting"][0].pop("predicted_output_tokens"),
     "snapshot.waiting[0].predicted_output_tokens", "required"),
    (lambda d: d["running"][0].pop("id"), "snapshot.running[0].id", "required"),
    (lambda d: d["batch_time"].pop("coefficients"),
     "snapshot.batch_time.coefficients", "required"),
], ids=["batch_time", "prompt_tokens", "predicted_output_tokens", "id", "coefficients"])
def test_missing_fields(mutate, path, reason):
    expect_error(bad(mutate), path, reason)


@pytest.mark.parametrize(("mutate", "path"), [
    (lambda d: d["running"][0].update(computed_tokens=-1), "snapshot.running[0].computed_tokens"),
    (lambda d: d["running"][0].update(output_tokens=-3), "snapshot.running[0].output_tokens"),
    (lambda d: d["waiting"][0].update(prompt_tokens=-5), "snapshot.waiting[0].prompt_tokens"),
    (lambda d: d["waiting"][0].update(predicted_output_tokens=-1),
     "snapshot.waiting[0].predicted_output_tokens"),
], ids=["computed", "output", "prompt", "predicted"])
def test_negative_token_counts(mutate, path):
    expect_error(bad(mutate), path, r"greater than or equal|>=|negative")


@pytest.mark.parametrize(("mutate", "path"), [
    (lambda d: d["waiting"][0].update(prompt_tokens=12.5), "snapshot.waiting[0].prompt_tokens"),
    (lambda d: d["running"][0].update(computed_tokens=1199.5),
     "snapshot.running[0].computed_tokens"),
    (lambda d: d["running"][0].update(output_tokens="35"), "snapshot.running[0].output_tokens"),
    (lambda d: d["waiting"][0].update(predicted_output_tokens=True),
     "snapshot.waiting[0].predicted_output_tokens"),
], ids=["float-prompt", "float-computed", "string-output", "bool-predicted"])
def test_non_integer_token_counts(mutate, path):
    expect_error(bad(mutate), path, "integer")


def test_zero_prompt_tokens():
    expect_error(bad(lambda d: d["waiting"][0].update(prompt_tokens=0)),
                 "snapshot.waiting[0].prompt_tokens", "greater than or equal to 1")


def test_request_error_index_points_at_the_bad_element():
    def mutate(d):
        d["waiting"].append({"id": "c", "prompt_tokens": 10, "output_tokens": 0,
                             "predicted_output_tokens": 5})
        d["waiting"].append({"id": "e", "prompt_tokens": 10.5, "predicted_output_tokens": 5})
    expect_error(bad(mutate), "snapshot.waiting[2].prompt_tokens", "integer")


# -- batch-time model ---------------------------------------------------------------------------

def test_unknown_batch_time_model():
    err = expect_error(bad(lambda d: d["batch_time"].update(model="paper5")),
                       "snapshot.batch_time.model", "unknown batch-time model")
    assert "paper5" in str(err) and "paper4" in str(err) and "sfs6" in str(err)


def test_missing_coefficient():
    err = expect_error(bad(lambda d: d["batch_time"]["coefficients"].pop("b3")),
                       "snapshot.batch_time.coefficients", "missing")
    assert "b3" in str(err)


def test_unknown_coefficient():
    err = expect_error(bad(lambda d: d["batch_time"]["coefficients"].update(b4=1.0)),
                       "snapshot.batch_time.coefficients", "unknown")
    assert "b4" in str(err)


def test_sfs6_coefficients_do_not_fit_paper4():
    def mutate(d):
        d["batch_time"] = {"model": "sfs6", "coefficients": {"b0": 1, "b1": 1, "b2": 1, "b3": 1}}
    expect_error(bad(mutate), "snapshot.batch_time.coefficients", "missing")


def test_negative_coefficient():
    expect_error(bad(lambda d: d["batch_time"]["coefficients"].update(b1=-1e-5)),
                 "snapshot.batch_time.coefficients.b1", ">= 0")


def test_non_numeric_coefficient():
    expect_error(bad(lambda d: d["batch_time"]["coefficients"].update(b0="fast")),
                 "snapshot.batch_time.coefficients.b0", "number")


# -- config -------------------------------------------------------------------------------------

def test_bad_config_values():
    expect_error(bad(lambda d: d["config"].update(max_num_seqs=0)),
                 "snapshot.config.max_num_seqs", "greater than or equal to 1")
    expect_error(bad(lambda d: d["config"].update(block_size=16.0)),
                 "snapshot.config.block_size", "integer")
    expect_error(bad(lambda d: d["config"].update(long_prefill_token_threshold=-1)),
                 "snapshot.config.long_prefill_token_threshold", "greater than or equal to 0")


def test_unknown_config_key():
    expect_error(bad(lambda d: d["config"].update(max_num_sequences=8)),
                 "snapshot.config.max_num_sequences", "not permitted|extra")


# -- cross-field consistency --------------------------------------------------------------------

def test_duplicate_ids_across_running_and_waiting():
    err = expect_error(bad(lambda d: d["waiting"][0].update(id="a")),
                       "snapshot.waiting[0].id", "duplicate")
    assert "'a'" in str(err)


def test_duplicate_ids_within_running():
    def mutate(d):
        d["running"].append(dict(d["running"][0]))
    expect_error(bad(mutate), "snapshot.running[1].id", "duplicate")


@pytest.mark.parametrize("computed", [1235, 1236, 5000])
def test_running_computed_must_be_below_prompt_plus_output(computed):
    # P + O = 1200 + 35 = 1235: the last token is computed in the next step, so C <= 1234.
    err = expect_error(bad(lambda d: d["running"][0].update(computed_tokens=computed)),
                       "snapshot.running[0].computed_tokens", "must be below")
    assert "1235" in str(err)


def test_running_computed_just_below_is_fine():
    d = bad(lambda d: d["running"][0].update(computed_tokens=1234))
    assert Snapshot.from_dict(d).running[0].computed_tokens == 1234


def test_waiting_request_with_computed_tokens():
    expect_error(bad(lambda d: d["waiting"][0].update(computed_tokens=16)),
                 "snapshot.waiting[0].computed_tokens", "must be 0")


def test_more_running_than_max_num_seqs():
    def mutate(d):
        d["config"]["max_num_seqs"] = 2
        d["running"] = [{"id": f"r{i}", "prompt_tokens": 10, "computed_tokens": 9,
                         "output_tokens": 0, "predicted_output_tokens": 5} for i in range(3)]
    err = expect_error(bad(mutate), "snapshot.running", "max_num_seqs")
    assert "3" in str(err) and "2" in str(err)


def test_running_blocks_exceed_num_gpu_blocks():
    # block 16: 1000 computed -> 63 blocks; 600 -> 38 blocks; 101 in all > 100.
    def mutate(d):
        d["running"] = [
            {"id": "x", "prompt_tokens": 1000, "computed_tokens": 999, "output_tokens": 1,
             "predicted_output_tokens": 5},
            {"id": "y", "prompt_tokens": 700, "computed_tokens": 600, "output_tokens": 0,
             "predicted_output_tokens": 5},
        ]
    err = expect_error(bad(mutate), "snapshot.running", "num_gpu_blocks")
    assert "101" in str(err) and "100" in str(err)


def test_running_blocks_exactly_filling_the_cache_are_fine():
    # 999 -> 63 blocks, 592 -> 37 blocks: exactly 100, the usable blocks beside vLLM's null
    # block; one block fewer is an error.
    def mutate(d, blocks=101):
        d["config"]["num_gpu_blocks"] = blocks
        d["running"] = [
            {"id": "x", "prompt_tokens": 1000, "computed_tokens": 999, "output_tokens": 1,
             "predicted_output_tokens": 5},
            {"id": "y", "prompt_tokens": 700, "computed_tokens": 592, "output_tokens": 0,
             "predicted_output_tokens": 5},
        ]
    assert Snapshot.from_dict(bad(mutate)).kv_usage == 1.0
    expect_error(bad(lambda d: mutate(d, 100)), "snapshot.running", "null block")


def test_request_reaching_max_model_len():
    expect_error(bad(lambda d: d["config"].update(max_model_len=1235)),
                 "snapshot.running[0]", "max_model_len")


def test_status_listed_under_the_wrong_queue():
    expect_error(bad(lambda d: d["running"][0].update(status="waiting")),
                 "snapshot.running[0].status", "waiting")


@pytest.mark.parametrize("version", [0, 4, 99])
def test_wrong_version(version):
    err = expect_error(bad(lambda d: d.update(version=version)), "snapshot.version",
                       "unsupported version")
    assert str(version) in str(err)


def test_lora_needs_version_3_and_round_trips():
    """Version 3 carries LoRA adapters: ``config.max_loras`` (or vLLM's ``enable_lora``, whose
    default is one) and a request's ``lora``; versions 1 and 2 refuse them by name."""
    expect_error(bad(lambda d: d["config"].update(max_loras=2)), "snapshot.config.max_loras",
                 "version 3")
    expect_error(bad(lambda d: d["waiting"][0].update(lora=3)), "snapshot.waiting[0].lora",
                 "version 3")
    d = bad(lambda d: (d.update(version=3), d["config"].update(max_loras=2),
                       d["waiting"][0].update(lora=3)))
    snap = Snapshot.from_dict(d)
    assert snap.config.max_loras == 2
    assert snap.waiting[0].lora == 3 and snap.running[0].lora == 0
    out = snap.to_dict()
    assert out["version"] == 3 and out["config"]["max_loras"] == 2
    assert out["waiting"][0]["lora"] == 3 and "lora" not in out["running"][0]
    assert Snapshot.from_dict(out).to_dict() == out
    with pytest.raises(SnapshotError, match="version 1 cannot carry LoRA"):
        snap.to_dict(version=1)
    on = Snapshot.from_dict(bad(lambda d: (d.update(version=3),
                                           d["config"].update(enable_lora=True))))
    assert on.config.max_loras == 1
    expect_error(bad(lambda d: (d.update(version=3), d["waiting"][0].update(lora=-1))),
                 "snapshot.waiting[0].lora", "greater than or equal")
    assert "max_loras" not in Snapshot.from_dict(valid()).to_dict()["config"]


# -- load and round trip ------------------------------------------------------------------------

def test_load_rejects_a_non_json_file(tmp_path):
    p = tmp_path / "snap.json"
    p.write_text("{not json")
    with pytest.raises(SnapshotError, match="not valid JSON") as info:
        Snapshot.load(p)
    assert str(p) in str(info.value)


def test_load_validates_the_content(tmp_path):
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(bad(lambda d: d["waiting"][0].update(computed_tokens=3))))
    with pytest.raises(SnapshotError, match=re.escape("snapshot.waiting[0].computed_tokens")):
        Snapshot.load(p)


def test_load_reads_a_valid_file(tmp_path):
    p = tmp_path / "snap.json"
    p.write_text(json.dumps(valid()))
    assert Snapshot.load(p).to_dict() == Snapshot.from_dict(valid()).to_dict()


@pytest.mark.parametrize("model", ["paper4", "sfs6"])
def test_round_trip(model):
    d = valid()
    if model == "sfs6":
        d["batch_time"] = {"model": "sfs6", "coefficients": {
            "c0": 0.0073, "cp": 2.1e-5, "cpsq": 5.1e-10, "cd": 2.6e-5, "cs": 4.6e-8,
            "css": 2.7e-13}}
    d["config"].update(long_prefill_token_threshold=512, scheduler_reserve_full_isl=False,
                       watermark=0.01, async_scheduling=True)
    d["waiting"].append({"id": "c", "prompt_tokens": 7, "computed_tokens": 0,
                         "output_tokens": 3, "predicted_output_tokens": 9, "arrival": 12.0})
    s = Snapshot.from_dict(d)
    out = s.to_dict()
    s2 = Snapshot.from_dict(out)
    assert s2.to_dict() == out
    assert out["config"] == {**d["config"], "enable_prefix_caching": False}
    assert out["batch_time"] == d["batch_time"]
    assert out["running"] == d["running"] and out["waiting"] == d["waiting"]
    assert (out["version"], out["time"]) == (1, 12.345)
    # The JSON form survives too, and forecasts agree.
    s3 = Snapshot.from_dict(json.loads(json.dumps(out)))
    assert s3.to_dict() == out
    assert (duetime.forecast(s3, 100).estimate_s == duetime.forecast(s, 100).estimate_s)


def test_vllm_mode_keys_are_accepted_when_they_match_the_modelled_rules():
    d = valid()
    d["config"].update(chunked_prefill=True, enable_prefix_caching=False, policy="fcfs",
                       preemption_mode="recompute")
    assert Snapshot.from_dict(d).config.max_num_batched_tokens == 8192


@pytest.mark.parametrize(("key", "value"), [
    ("enable_prefix_caching", True),
    ("chunked_prefill", False),
    ("policy", "priority"),
    ("preemption_mode", "swap"),
])
def test_unmodelled_vllm_modes_are_rejected(key, value):
    d = valid()
    d["config"][key] = value
    with pytest.raises(SnapshotError, match=rf"snapshot\.config\.{key}"):
        Snapshot.from_dict(d)
