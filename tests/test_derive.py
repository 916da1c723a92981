"""Derived profiles (engine/derive.py, engine/hardware.py): a measured profile scaled to other
hardware, and where the names are accepted (``duetime profiles``, the emulator, pool configs)."""

from __future__ import annotations

import json

import pytest

from duetime.cli import main
from duetime.engine.derive import STEP_HOST_S, derive, kv_blocks, scale_factors
from duetime.engine.hardware import Option, gpu, gpu_names, model_arch
from duetime.engine.profiles import (
    derived_profile_names,
    load_profile,
    measured_option,
    profile_names,
)


def test_option_names_round_trip():
    for text, want in [("qwen3-8b@l40s", Option("qwen3-8b", "l40s", 1)),
                       ("qwen3-32b@h100x2", Option("qwen3-32b", "h100", 2)),
                       ("qwen3-32b@a100-80gbx4", Option("qwen3-32b", "a100-80gb", 4))]:
        assert Option.parse(text) == want
        assert want.name == text
    for bad in ["qwen3-8b", "@h100", "qwen3-8b@", "qwen3-8b@h100x0"]:
        with pytest.raises(ValueError):
            Option.parse(bad)


def test_prices_come_from_the_catalogue_unless_overridden():
    opt = Option("qwen3-32b", "h100", 2)
    assert opt.price_per_hour() == pytest.approx(2 * gpu("h100").price_per_hour)
    assert opt.price_per_hour({"h100": 2.0}) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="price of h100"):
        gpu("h100", {"h100": -1})
    with pytest.raises(KeyError, match="unknown GPU 'tpu'"):
        gpu("tpu")
    assert {"h100", "a100-80gb", "l40s", "l4"} <= set(gpu_names())


def test_every_measured_profile_names_its_hardware():
    for name in profile_names():
        opt = measured_option(name)
        assert opt is not None and opt.model == name
        # the deployment's own name loads the measured profile, not a derived one
        assert load_profile(opt.name) is load_profile(name)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"])
def test_the_kv_cache_from_memory_matches_the_measured_block_counts(name):
    p, opt = load_profile(name), measured_option(name)
    got = kv_blocks(model_arch(opt.model), opt, p.config.block_size)
    assert got == pytest.approx(p.config.num_gpu_blocks, rel=0.02)


def test_deriving_onto_the_measured_hardware_changes_nothing_but_the_kv_estimate():
    ref = load_profile("qwen3-8b")
    opt = measured_option("qwen3-8b")
    d = derive(ref, opt, opt)
    for k, v in ref.batch_time.coefficients.items():
        assert d.batch_time.coefficients[k] == pytest.approx(v, rel=1e-12)
    assert d.derived_from == "qwen3-8b"


def test_more_gpus_divide_the_device_terms_and_keep_the_host_part():
    ref, opt = load_profile("qwen3-8b"), measured_option("qwen3-8b")
    f = scale_factors(opt, Option("qwen3-8b", "h100", 2))
    assert f == pytest.approx({"compute": 0.5, "attention": 0.5, "kv": 0.5, "step": 0.5})
    d = derive(ref, opt, Option("qwen3-8b", "h100", 2)).batch_time.coefficients
    r = ref.batch_time.coefficients
    for k in ("cp", "cpsq", "cd", "cs", "css"):
        assert d[k] == pytest.approx(r[k] / 2)
    assert d["c0"] == pytest.approx(STEP_HOST_S + (r["c0"] - STEP_HOST_S) / 2)
    # twice the memory less the same weights: more than twice the blocks
    assert (derive(ref, opt, Option("qwen3-8b", "h100", 2)).config.num_gpu_blocks
            > 2 * ref.config.num_gpu_blocks)


def test_a_slower_gpu_scales_compute_by_flops_and_kv_by_bandwidth():
    h, l4 = gpu("h100"), gpu("l4")
    f = scale_factors(Option("qwen3-8b", "h100"), Option("qwen3-8b", "l4"))
    assert f["compute"] == pytest.approx(h.flops / l4.flops)
    assert f["attention"] == pytest.approx(h.flops / l4.flops)
    assert f["kv"] == pytest.approx(h.bandwidth / l4.bandwidth)
    # another model on the same GPU: compute by active parameters, kv by bytes per token
    g = scale_factors(Option("qwen3-32b", "h100"), Option("qwen3-8b", "h100"))
    a8, a32 = model_arch("qwen3-8b"), model_arch("qwen3-32b")
    assert g["compute"] == pytest.approx(a8.active_params / a32.active_params)
    assert g["kv"] == pytest.approx(a8.kv_bytes_per_token / a32.kv_bytes_per_token)


def test_a_derived_profile_is_labelled_and_runs():
    p = load_profile("qwen3-8b@l40s")
    assert p.name == "qwen3-8b@l40s" and p.derived_from == "qwen3-8b"
    assert "derived from qwen3-8b" in p.description and "L40S" in p.description
    assert p.batch_time.coefficients["cp"] > load_profile("qwen3-8b").batch_time.coefficients["cp"]
    # a small KV cache lowers max_model_len to what it holds, as vLLM would need to start
    small = load_profile("qwen3-32b@h100")
    holds = (small.config.num_gpu_blocks - 1) * small.config.block_size
    assert small.config.max_model_len <= holds < 131072


def test_deployments_that_do_not_fit_or_do_not_exist_say_why():
    with pytest.raises(ValueError, match="do not fit"):
        load_profile("qwen3-32b@l4")
    for name, match in [("qwen3-8b@tpu", "unknown GPU"), ("llama@h100", "no architecture"),
                        ("qwen9", "unknown engine profile 'qwen9'"),
                        ("qwen3-8b@h100x0", "tensor-parallel size")]:
        with pytest.raises(KeyError, match=match):
            load_profile(name)


def test_the_derived_list_picks_the_fewest_gpus_that_fit():
    names = derived_profile_names()
    assert "qwen3-32b@l4x4" in names and "qwen3-32b@l4x2" not in names
    assert "qwen3-32b@h100" in names  # one H100 holds 32B (barely): the measured one has two
    assert not {"qwen3-0.6b@h100", "qwen3-8b@h100"} & set(names)  # those are measured
    for n in names:
        assert load_profile(n).derived_from


def test_cli_lists_and_labels_derived_profiles(capsys):
    assert main(["profiles", "qwen3-8b", "qwen3-8b@l4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["source"], p["derived_from"]) for p in got] == [
        ("qwen3-8b", "measured", None), ("qwen3-8b@l4", "derived", "qwen3-8b")]
    assert main(["profiles", "--derived"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-32b@a100-80gb [derived]:" in out and "qwen3-8b [measured]:" in out
    assert main(["profiles", "--gpus"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in gpu_names())


@pytest.mark.parametrize(("name", "message"), [
    ("qwen3-32b@l4", "do not fit"), ("qwen3-8b@tpu", "unknown GPU 'tpu'")])
def test_cli_rejects_a_bad_deployment_in_one_line(capsys, name, message):
    assert main(["profiles", name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and len(err.strip().splitlines()) == 1


def test_pool_configs_and_the_emulator_accept_derived_names(tmp_path):
    from duetime.gateway.config import ConfigError, load_pool

    cfg = tmp_path / "pool.yaml"
    cfg.write_text("instances:\n  - {name: a, model: qwen3-8b, url: 'http://h', "
                   "profile: qwen3-8b@l40s}\n")
    spec = load_pool(cfg).instances[0].spec
    assert spec.derived_from == "qwen3-8b"
    assert spec.batch_time == load_profile("qwen3-8b@l40s").batch_time
    cfg.write_text("instances:\n  - {name: a, model: qwen3-8b, url: 'http://h', "
                   "profile: qwen3-32b@l4}\n")
    with pytest.raises(ConfigError, match="do not fit"):
        load_pool(cfg)
    # the emulator's --profile takes the same names and rejects the same deployments
    assert main(["emulate", "--profile", "qwen3-32b@l4", "--port", "0"]) == 2
