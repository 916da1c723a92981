"""``duetime plan`` (duetime.plan): the bounds hold against the simulator, the search finds what
exhaustive enumeration finds, the inputs are checked, and the outputs serve."""

from __future__ import annotations

import json

import numpy as np
import pytest

from duetime.cli import main
from duetime.engine.hardware import Option
from duetime.plan.bounds import feasible_split, idle_ttft, work_seconds
from duetime.plan.evaluate import Evaluator, pool_cost, pool_gpus
from duetime.plan.problem import PlanError, problem_from_dict
from duetime.plan.search import Space, enumerate_grid, search

MEASURED = ["qwen3-0.6b@h100", "qwen3-8b@h100", "qwen3-32b@h100x2"]


def small(**over):
    base = {"rate": 4.0, "options": MEASURED, "max_replicas": 2, "requests": 600,
            "max_requests": 1200, "constraints": {"on_time": 0.95, "quality": 0.8}}
    return problem_from_dict({**base, **over})


@pytest.fixture(scope="module")
def one_instance_run():
    """One 8B instance alone on a busy stream: the requests and their simulated fates."""
    p = small(rate=1.5, options=["qwen3-8b@h100"], requests=400)
    ev = Evaluator(p)
    reqs = ev.requests()
    opt = Option("qwen3-8b", "h100")
    return p.specs[opt], reqs, ev.simulate(((opt, 1),), reqs)


def test_no_request_starts_faster_than_on_an_idle_engine(one_instance_run):
    spec, reqs, res = one_instance_run
    bound = idle_ttft(spec.batch_time, spec.config, reqs.prompt)
    assert (res.ttft >= bound - 1e-9).all()
    # and the bound is tight for some: the first request found the engine idle
    assert res.ttft[0] == pytest.approx(bound[0], rel=0.05)


def test_the_engine_cannot_finish_faster_than_the_work_bound(one_instance_run):
    spec, reqs, res = one_instance_run
    col = reqs.models.index("qwen3-8b")
    work = work_seconds(spec.batch_time, spec.config, reqs.prompt, reqs.output[:, col])
    makespan = float(np.max(res.finish) - reqs.arrival[0])
    assert work.sum() <= makespan
    assert work.sum() > 0.2 * makespan  # not vacuous: the engine is busy much of the time


def test_the_split_program():
    one = np.array([1.0])
    assert feasible_split(np.array([2.0]), np.array([[0.4]]), one)       # 0.8 engine-s/s
    assert not feasible_split(np.array([3.0]), np.array([[0.4]]), one)   # 1.2
    # two classes, two deployments: only the split that sends each where it is cheap fits
    work = np.array([[0.1, 1.0], [1.0, 0.1]])
    assert feasible_split(np.array([5.0, 5.0]), work, np.array([1.0, 1.0]))
    # a quality floor that forces class 0 onto the slow deployment does not fit
    quality = np.array([[0.5, 0.9], [0.9, 0.9]])
    assert feasible_split(np.array([5.0, 5.0]), work, np.array([1.0, 1.0]), quality, 0.6)
    assert not feasible_split(np.array([5.0, 5.0]), work, np.array([1.0, 1.0]), quality, 0.85)


def test_the_search_finds_what_enumeration_finds_with_fewer_simulations():
    p = small()
    grid = enumerate_grid(p)
    found = search(p)
    assert grid.best is not None and found.best is not None
    assert found.best.cost == pytest.approx(grid.best.cost)
    assert found.best.meets
    # every pool cheaper than the answer misses a constraint when simulated
    cheaper = [o for o in grid.outcomes if o.cost < found.best.cost - 1e-9]
    assert cheaper and not any(o.meets for o in cheaper)
    assert found.simulations < grid.simulations / 2
    assert sum(found.pruned.values()) > 0


def test_a_pool_is_simulated_the_same_way_twice():
    p = small()
    pool = ((Option("qwen3-8b", "h100"), 2),)
    a, b = Evaluator(p).evaluate(pool), Evaluator(p).evaluate(pool)
    assert a.as_dict() == b.as_dict()


def test_the_space_walks_one_deployment_per_model():
    p = small(options=["qwen3-8b@h100", "qwen3-8b@l40s", "qwen3-0.6b@l4"], max_replicas=2)
    space = Space(p)
    states = list(space.all_states())
    assert len(states) == (1 + 2 * 2) * (1 + 1 * 2) - 1
    pools = {space.pool(s) for s in states}
    assert all(len({o.model for o, _ in pool}) == len(pool) for pool in pools)
    assert min(pool_cost(x, p) for x in pools) == pytest.approx(
        Option("qwen3-0.6b", "l4").price_per_hour())


@pytest.mark.parametrize(("over", "message"), [
    ({"options": ["qwen3-8b@tpu"]}, "unknown GPU 'tpu'"),
    ({"options": ["llama@h100"]}, "'llama' is not a model of the workload"),
    ({"options": ["qwen3-32b@h100"]}, "less than the workload's longest sequence"),
    ({"options": ["qwen3-32b@l4"]}, "do not fit"),
    ({"constraints": {"on_time": {"chess": 0.9}}}, "unknown class(es) ['chess']"),
    ({"constraints": {"quality": 2}}, "constraints.quality"),
    ({"router": "fastest"}, "unknown policy 'fastest'"),
    ({"rate": -1}, "rate"),
    ({"prices": {"h100": -2}}, "prices.h100"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_plans_say_what_is_wrong(over, message):
    with pytest.raises(PlanError, match=None) as e:
        small(**over)
    assert message in str(e.value)


def test_default_deployments_hold_the_workload():
    p = problem_from_dict({"rate": 4.0, "gpus": ["h100", "l4"]})
    names = {o.name for o in p.options}
    # 32B on one H100 holds its weights but not a 35,000-token sequence: two (measured)
    assert {"qwen3-32b@h100x2", "qwen3-32b@l4x4", "qwen3-8b@l4", "qwen3-0.6b@h100"} <= names
    assert "qwen3-32b@h100" not in names


def test_cli_plan_writes_a_pool_the_gateway_accepts(tmp_path, capsys):
    from duetime.gateway.config import load_pool

    out = tmp_path / "plan"
    options = ",".join([*MEASURED, "qwen3-8b@l40s"])
    code = main(["plan", "--quick", "--rate", "4", "--options", options, "--quality", "0.8",
                 "--requests", "600", "--out", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0, stdout
    summary = json.loads((out / "summary.json").read_text())
    best = summary["best"]
    assert best["meets"] and best["cost_per_hour"] > 0
    assert all(v >= 0.95 for v in best["on_time"].values()) and best["quality"] >= 0.8
    assert {r["option"]: r["profile"] for r in summary["options"]}["qwen3-8b@l40s"] == "derived"
    assert (out / "frontier.png").stat().st_size > 1000
    assert "## The pool" in (out / "report.md").read_text()
    pool = load_pool(out / "pool.yaml")
    got: dict[str, int] = {}
    for inst in pool.instances:
        got[inst.profile] = got.get(inst.profile, 0) + 1
        assert inst.emulate is not None
    assert got == best["pool"]
    urls = load_pool(out / "pool-urls.yaml")
    assert len(urls.instances) == sum(best["pool"].values())
    assert all(".invalid:8000" in i.url for i in urls.instances)


def test_per_class_ttft_targets_reach_the_plan_and_its_pool_yaml(tmp_path):
    from importlib.resources import files

    import yaml

    from duetime.gateway.config import pool_from_dict
    from duetime.plan.report import pool_config

    wl = yaml.safe_load(files("duetime.workload").joinpath("profiles", "paper.yaml")
                        .read_text())
    wl["tasks"]["alpaca"]["ttft_target"] = {"base_ms": 80, "clip_ms": [60, 120]}
    (tmp_path / "wl.yaml").write_text(yaml.safe_dump(wl))
    p = problem_from_dict({"workload": "wl.yaml", "rate": 4.0, "options": MEASURED,
                           "requests": 400}, "plan.yaml", tmp_path)
    reqs = Evaluator(p).requests()
    alpaca = reqs.task == reqs.tasks.index("alpaca")
    assert reqs.target[alpaca].max() <= 0.120 and reqs.target[~alpaca].min() >= 0.150
    cfg = pool_config(p, ((Option("qwen3-8b", "h100"), 1),))
    assert cfg["ttft_target"]["tasks"] == {"alpaca": {
        "base_ms": 80.0, "per_prompt_token_ms": 0.035, "min_ms": 60.0, "max_ms": 120.0}}
    cfg["quality"]["workload"] = str(tmp_path / "wl.yaml")
    pool = pool_from_dict(cfg, "pool.yaml")
    assert pool.target_ms(40, "alpaca") == pytest.approx(81.4)
    assert pool.target_ms(40, "hotpotqa") == pytest.approx(156.4)  # the workload's rule


def test_cli_plan_rejects_bad_input_in_one_line(tmp_path, capsys):
    assert main(["plan", "--options", "qwen3-32b@h100", "--out", str(tmp_path)]) == 2
    _, err = capsys.readouterr()
    assert "longest sequence" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "plan.yaml"
    bad.write_text("rate: [1, 2\n")
    assert main(["plan", str(bad), "--out", str(tmp_path)]) == 2
    _, err = capsys.readouterr()
    assert "not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_cli_plan_with_no_answer_exits_1(tmp_path, capsys):
    code = main(["plan", "--quick", "--rate", "4", "--options", "qwen3-0.6b@h100",
                 "--quality", "0.9", "--requests", "400", "--out", str(tmp_path)])
    assert code == 1
    assert "no pool of the space meets" in capsys.readouterr().out
    assert "No pool of the space meets" in (tmp_path / "report.md").read_text()


def test_a_calibrated_deployment_replaces_the_derived_profile(tmp_path):
    """``duetime calibrate --out``'s YAML for a deployment: its batch time, labelled measured."""
    (tmp_path / "l40s.yaml").write_text(
        "batch_time: {model: sfs6, coefficients: {c0: 0.01, cp: 3.0e-5, cpsq: 1.0e-9, "
        "cd: 4.0e-5, cs: 1.0e-7, css: 1.0e-12}}\nrequest_overhead_ms: 2.5\n")
    p = problem_from_dict({"rate": 2.0, "options": [
        "qwen3-8b@h100", {"name": "qwen3-8b@l40s", "profile": "l40s.yaml"}]},
        "plan.yaml", tmp_path)
    spec = p.specs[Option("qwen3-8b", "l40s")]
    assert spec.batch_time.coefficients["c0"] == 0.01 and not spec.derived_from
    assert spec.request_overhead_s == pytest.approx(0.0025)
    # the config the calibration left out is the deployment's (derived) one
    from duetime.engine.profiles import load_profile
    assert spec.config == load_profile("qwen3-8b@l40s").config
    with pytest.raises(PlanError, match="cannot read"):
        problem_from_dict({"rate": 2.0, "options": [{"name": "qwen3-8b@l40s",
                                                     "profile": "missing.yaml"}]},
                          "plan.yaml", tmp_path)


def test_the_simulator_runs_each_replica_on_its_own_engine():
    """ClusterSim's instance_specs: a replica on a slower GPU is slower, priced as its model."""
    from duetime.sim.cluster import ClusterSim

    p = small(rate=0.5, options=["qwen3-8b@h100", "qwen3-8b@l4"], requests=200)
    ev = Evaluator(p)
    reqs = ev.requests()
    fast = ev.simulate(((Option("qwen3-8b", "h100"), 1),), reqs)
    slow = ev.simulate(((Option("qwen3-8b", "l4"), 1),), reqs)
    assert np.median(slow.ttft) > 2 * np.median(fast.ttft)
    assert (slow.cost == fast.cost).all()  # token prices are the model's, not the GPU's
    with pytest.raises(ValueError, match="no such instance"):
        ClusterSim(p.workload, None, instances=[("a", "qwen3-8b")],
                   instance_specs={"b": p.specs[Option("qwen3-8b", "l4")]})


# -- schedules ----------------------------------------------------------------------------------

def test_a_diurnal_day_has_its_peak_and_trough_where_asked():
    from duetime.plan.rates import diurnal

    day = diurnal(12.0, 3.0, interval_s=900, peak_hour=14)
    assert len(day) == 96 and sum(iv.duration_s for iv in day) == 86400
    top = max(day, key=lambda iv: iv.rate)
    low = min(day, key=lambda iv: iv.rate)
    assert 13.5 <= top.start_s / 3600 <= 14 and 1.5 <= low.start_s / 3600 <= 2
    assert 11.9 < top.rate <= 12 and 3 <= low.rate < 3.1
    # interval means: the day's mean is the cosine's, (peak + trough) / 2
    assert np.mean([iv.rate for iv in day]) == pytest.approx(7.5)


def test_rate_levels_round_up():
    from duetime.plan.rates import level

    for r in (0.3, 1.0, 4.2, 8.6, 12.0):
        lv = level(r, 0.1)
        assert r <= lv < r * 1.1 + 1e-9
    assert level(1.1 ** 7, 0.1) == pytest.approx(1.1 ** 7)


def test_a_rate_trace_is_read_and_checked(tmp_path):
    from duetime.plan.rates import read_rates

    f = tmp_path / "rates.csv"
    f.write_text("start_s,rate\n0,2\n600,5\n900,3\n")
    got = read_rates(f)
    assert [(iv.start_s, iv.duration_s, iv.rate) for iv in got] == [
        (0, 600, 2), (600, 300, 5), (900, 300, 3)]
    for text, message in [("start_s,rate\n0,2\n", "two rows"), ("a,b\n0,1\n1,2\n", "columns"),
                          ("start_s,rate\n0,2\n0,3\n", "increase"),
                          ("start_s,rate\n0,2\n10,-1\n", "positive"),
                          ("start_s,rate\n0,x\n10,1\n", "numbers")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_rates(f)


def test_a_schedule_pays_for_scale_ups_and_beats_the_static_peak(tmp_path):
    from duetime.plan.schedule import plan_schedule

    (tmp_path / "rates.csv").write_text("start_s,rate\n0,1\n3600,6\n7200,1\n")
    p = problem_from_dict({"rate": 1, "options": MEASURED, "max_replicas": 3, "requests": 600,
                           "max_requests": 1200, "schedule": {"trace": "rates.csv",
                                                              "scale_up_delay_s": 120},
                           "constraints": {"on_time": 0.95, "quality": 0.8}},
                          "plan.yaml", tmp_path)
    assert p.rate == 6  # the peak
    s = plan_schedule(p)
    low, high, again = s.pools
    assert low is not None and high is not None and again is low
    assert high.cost > low.cost
    assert s.peak.best.pool == high.pool
    # GPU-hours: each hour's pool, plus the replicas added at 1 h paid 120 s ahead
    added = sum(max(0, r - dict(low.pool).get(o, 0)) * o.tp for o, r in high.pool)
    want = (2 * pool_gpus(low.pool) + pool_gpus(high.pool)) + added * 120 / 3600
    assert s.gpu_hours() == pytest.approx(want)
    assert s.static_gpu_hours() == pytest.approx(3 * pool_gpus(high.pool))
    assert s.gpu_hours() < s.static_gpu_hours()


def test_cli_plans_a_day(tmp_path, capsys):
    out = tmp_path / "day"
    code = main(["plan", "--diurnal", "6,1.5", "--interval-min", "240", "--options",
                 ",".join(MEASURED), "--quality", "0.8", "--requests", "600", "--max-replicas",
                 "3", "--out", str(out)])
    stdout, _ = capsys.readouterr()
    assert code == 0, stdout
    data = json.loads((out / "summary.json").read_text())
    assert len(data["intervals"]) == 6 and data["unplanned_intervals"] == 0
    assert 0 < data["gpu_hours_vs_static_peak"] <= 1 and 0 < data["cost_vs_static_peak"] <= 1
    assert (out / "schedule.png").stat().st_size > 1000
    assert len((out / "schedule.csv").read_text().splitlines()) == 7
    assert "static peak pool" in (out / "report.md").read_text()
    # the pools by level, as the gateway's autoscale.table reads them
    from duetime.gateway.config import pool_from_dict
    levels = {float(r["planned_for"]) for r in data["intervals"]}
    pool = pool_from_dict({
        "instances": [{"name": m, "model": m, "profile": m, "url": "http://127.0.0.1:1"}
                      for m in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")],
        "autoscale": {"table": "autoscale-table.yaml"}}, str(out / "summary.json"))
    assert [r for r, _ in pool.autoscale.table] == pytest.approx(sorted(levels), rel=1e-3)
    assert all(sum(p.values()) >= 1 for _, p in pool.autoscale.table)
    assert main(["plan", "--diurnal", "1,3", "--out", str(out)]) == 2
