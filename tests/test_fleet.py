"""Several routers over one pool (duetime.sim.fleet): what each router's views know, and that
knowing everything at once is the same as being one router."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from duetime.cli import main
from duetime.engine.config import SchedulerConfig
from duetime.engine.engine import Engine
from duetime.experiments.runner import Point, Runner
from duetime.policy import make_policy
from duetime.sim import ClusterSim, SimResult
from duetime.sim.fleet import FleetSpec, RouterFleet
from duetime.sim.router_view import ADD, DONE, FIRST, Known, RouterView
from duetime.workload import load_workload

PROF = load_workload("paper")


def _requests(n: int = 400, rate: float = 8.6):
    return Runner(PROF, seed=0).requests(Point("sfs", rate, n))


def _run(router: str, reqs, spec: FleetSpec | None = None, step_scale: float = 1.0
         ) -> tuple[SimResult, RouterFleet | None]:
    def make(k: int = 0):
        return make_policy(router, {}, defaults={"lambda": PROF.lam, "seed": k})

    policy = make() if spec is None else spec.fleet(make)
    res = ClusterSim(PROF, policy, step_scale=step_scale).run(reqs)
    return res, policy if isinstance(policy, RouterFleet) else None


def _same(a: SimResult, b: SimResult) -> None:
    assert np.array_equal(a.instance, b.instance)
    assert np.array_equal(a.first_token, b.first_token)


def test_one_router_views_are_exact_replicas_of_the_instances() -> None:
    """One router's shadow engines, fed with its dispatches, first tokens and ends, replay
    what the instances did: its sfs decisions equal those made on the true state, and every
    first token its views stamped is the instance's."""
    reqs = _requests()
    truth, _ = _run("sfs", reqs)
    res, fleet = _run("sfs", reqs, FleetSpec(1))
    _same(res, truth)
    assert fleet is not None and fleet.seen_share() == pytest.approx(1.0)
    for k, view in enumerate(fleet.views[0]):
        ids = [str(i) for i in np.flatnonzero(res.instance == k).tolist()
               if view.engine.known(str(i))]
        assert len(ids) > 10
        got = view.engine.lookup(ids).first_token
        want = res.first_token[[int(i) for i in ids]]
        seen = ~np.isnan(got)
        assert seen.mean() > 0.9 and np.array_equal(got[seen], want[seen])


def test_shared_views_without_staleness_match_a_single_router() -> None:
    reqs = _requests()
    one, _ = _run("sfs", reqs, FleetSpec(1))
    four, fleet = _run("sfs", reqs, FleetSpec(4, "shared", 0.0))
    _same(four, one)
    assert fleet is not None and (fleet.sent > 0).all()


def test_independent_views_undercount_queues() -> None:
    """A router that sees only its own dispatches holds about 1/N of what the instances hold,
    and never a request another router sent."""
    reqs = _requests()
    _, fleet = _run("sfs", reqs, FleetSpec(4, "independent"))
    assert fleet is not None
    seen, truth = np.array(fleet.seen), np.array(fleet.truth)
    assert fleet.seen_share() < 0.4
    busy = truth > 4
    assert busy.sum() > 50 and (seen[busy] < truth[busy]).mean() > 0.9
    # which router sent what: its views hold only those
    sender = {rid: r for r in range(4) for v in fleet.views[r]
              for rid in v.engine.history().ids}
    # (a router's last dispatches wait in its views until it decides again)
    assert len(reqs) - 4 * 3 <= len(sender) <= len(reqs)
    for r, views in enumerate(fleet.views):
        others = [rid for v in views for rid in v.engine.history().ids if sender[rid] != r]
        assert others == []


def test_shared_views_see_more_than_independent_ones_however_stale() -> None:
    reqs = _requests()
    shares = {}
    for spec in (FleetSpec(4, "independent"), FleetSpec(4, "shared", 2.0),
                 FleetSpec(4, "shared", 0.0)):
        _, fleet = _run("load-aware", reqs, spec)
        assert fleet is not None
        shares[(spec.sharing, spec.staleness_s)] = fleet.seen_share()
    assert shares[("independent", 0.0)] < 0.4 < shares[("shared", 2.0)]
    assert shares[("shared", 0.0)] == pytest.approx(1.0, abs=0.02)


def test_a_view_learns_events_at_their_time() -> None:
    spec = PROF.models["qwen3-8b"]
    view = RouterView("x", spec)
    view.learn(1.0, Known(ADD, "a", 100, 20, 0.5))
    view.catch_up(0.9)
    assert not view.engine.known("a") and view.now == 0.9
    view.catch_up(1.0)
    assert view.engine.has("a")
    view.learn(5.0, Known(DONE, "a", tokens=3))
    view.catch_up(2.0)
    assert view.engine.has("a") and view.num_running == 1
    view.catch_up(5.0)
    assert not view.engine.has("a") and view.num_running + view.num_waiting == 0
    view.learn(6.0, Known(FIRST, "gone"))  # (an event about a request it never held)
    view.catch_up(7.0)


def test_the_streamed_token_counts_correct_own_requests() -> None:
    """A replay that ran ahead of the instance takes its word (beyond the one token a step
    in flight may stand between them)."""
    view = RouterView("x", PROF.models["qwen3-8b"])
    view.learn(0.0, Known(ADD, "a", 100, 50, 0.0))
    view.catch_up(1.0)
    ahead = int(view.engine.lookup(["a"]).output[0])
    assert ahead > 5
    assert view.correct(["a"], np.array([ahead - 1])) == 0
    assert view.correct(["a", "unknown"], np.array([2, 9])) == 1
    assert int(view.engine.lookup(["a"]).output[0]) == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_end_stops_a_request_as_the_instance_did(async_scheduling: bool) -> None:
    """A replica that does not know a request's length (stop = max_model_len), told it ended
    when the instance's stamp says, stays step for step with the instance."""
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=4096,
                          num_gpu_blocks=40, async_scheduling=async_scheduling)
    bt = PROF.models["qwen3-8b"].batch_time
    inst, rep = Engine(cfg, bt), Engine(cfg, bt)
    for rid, prompt, out in (("a", 200, 7), ("b", 120, 30), ("c", 300, 12)):
        inst.add(rid, prompt, out)
        rep.add(rid, prompt, cfg.max_model_len, predicted_output_tokens=out)
    ended = 0
    while not inst.idle:
        ev = inst.step()
        assert ev is not None
        for rid in ev.finished_ids:  # the replica hears of it at the stamp, before stepping on
            while rep.time < ev.outputs_at:
                rep.step()
            assert rep.end(rid, int(inst.request(rid)["output_tokens"]))
            ended += 1
        while rep.steps < inst.steps:
            rep.step()
        assert rep.time == inst.time and rep.free_blocks == inst.free_blocks
    assert ended == 3 and rep.idle
    assert not rep.end("a", 7) and not rep.end("nobody", 1)


def test_arrivals_are_spread_over_the_routers() -> None:
    reqs = _requests(200)
    _, rr = _run("load-aware", reqs, FleetSpec(4, "independent", spread="round-robin"))
    _, rnd = _run("load-aware", reqs, FleetSpec(4, "independent"))
    assert rr is not None and rnd is not None
    assert rr.sent.tolist() == [50, 50, 50, 50]
    assert rnd.sent.sum() == 200 and (rnd.sent > 25).all() and rnd.sent.tolist() != [50] * 4


@pytest.mark.parametrize("kwargs", [{"sharing": "gossip"}, {"spread": "hash"},
                                    {"staleness_s": -1.0}, {"staleness_s": float("nan")}])
def test_bad_fleet_options(kwargs) -> None:
    with pytest.raises(ValueError):
        RouterFleet([make_policy("sfs")], **kwargs)
    with pytest.raises(ValueError):
        FleetSpec(2, **kwargs)


def test_fleets_need_routers_and_no_prefix_caching() -> None:
    with pytest.raises(ValueError):
        RouterFleet([])
    with pytest.raises(ValueError):
        FleetSpec(0)
    spec = PROF.models["qwen3-8b"]
    caching = replace(spec, config=replace(spec.config, enable_prefix_caching=True))
    with pytest.raises(ValueError, match="prefix"):
        RouterView("x", caching)


def _mape(res: SimResult) -> float:
    ok = np.isfinite(res.forecast)
    return float(np.mean(np.abs(res.forecast[ok] - res.ttft[ok]) / res.ttft[ok]))


def test_views_learn_an_instance_slower_than_its_calibration() -> None:
    """Instances whose steps take 1.3x their calibration: one router's views priced with the
    calibration forecast too short; with the step correction each busy view learns the
    pace from its own requests' token counts and the forecasts' error falls."""
    reqs = _requests(1500, 6.0)
    plain, fleet = _run("sfs", reqs, FleetSpec(1), step_scale=1.3)
    learnt, fleet_c = _run("sfs", reqs, FleetSpec(1, step_correction=True), step_scale=1.3)
    assert fleet is not None and fleet_c is not None
    assert fleet.step_factors() == [1.0, 1.0, 1.0]
    busy = [k for k in range(3) if (learnt.instance == k).sum() > 300]
    assert busy
    for k in busy:
        assert fleet_c.step_factors()[k] == pytest.approx(1.3, rel=0.03)
    # uncorrected, the forecasts run short (observed / forecast above 1) ...
    ok = np.isfinite(plain.forecast)
    assert np.median(plain.ttft[ok] / plain.forecast[ok]) > 1.15
    # ... and the correction roughly halves their error
    assert _mape(learnt) < 0.7 * _mape(plain), (_mape(learnt), _mape(plain))


def test_a_step_scale_needs_routers_with_views_of_their_own() -> None:
    with pytest.raises(ValueError, match="RouterFleet"):
        ClusterSim(PROF, make_policy("sfs", {}, defaults={"lambda": PROF.lam}),
                   step_scale=1.2)
    with pytest.raises(ValueError, match="positive"):
        ClusterSim(PROF, FleetSpec(1).fleet(lambda k: make_policy("sfs", {}, defaults={
            "lambda": PROF.lam})), step_scale=0.0)


def test_simulate_with_routers(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--policy", "load-aware", "--rate", "8.6", "--requests", "200",
                 "--routers", "3", "--router-view", "independent", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["routers"] == 3 and summary["router_view"] == "independent"
    assert 0 < summary["view_share"] < 0.6
    assert "| load-aware | 3 | independent |" in capsys.readouterr().out


def test_simulate_a_miscalibrated_pool_with_step_correction(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--policy", "sfs", "--rate", "6", "--requests", "300",
                 "--routers", "1", "--step-scale", "1.3", "--step-correction",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step_scale"] == 1.3 and summary["step_correction"] is True
    assert 1.0 < summary["step_factor"] < 1.4
    printed = capsys.readouterr().out
    assert "| step_scale | step_factor | forecast_mape |" in printed


@pytest.mark.parametrize(("args", "fragment"), [
    (["--routers", "0"], "--routers"),
    (["--staleness", "0.1"], "needs --routers"),
    (["--routers", "2", "--router-view", "independent", "--staleness", "1"], "shared only"),
    (["--routers", "2", "--staleness", "-1"], "--staleness"),
    (["--routers", "2", "--clients", "4"], "--clients"),
    (["--routers", "2", "--prefix-caching"], "prefix caching"),
    (["--routers", "2", "--router-view", "gossip"], "--router-view"),
    (["--step-scale", "1.2"], "needs --routers"),
    (["--step-correction"], "needs --routers"),
    (["--routers", "1", "--step-scale", "0"], "--step-scale"),
], ids=["zero-routers", "staleness-alone", "staleness-independent", "negative-staleness",
        "closed-loop", "prefix-caching", "bad-view", "step-scale-alone", "step-correction-alone",
        "zero-step-scale"])
def test_simulate_routers_bad_input(tmp_path, capsys, args, fragment) -> None:
    code = main(["simulate", "--policy", "sfs", "--rate", "8", "--requests", "10",
                 "--out", str(tmp_path / "x"), *args])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    err = captured.err
    assert err.startswith("duetime: error: ") and err.count("\n") == 1 and fragment in err
