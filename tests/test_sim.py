"""Workloads, policies, the cluster simulator and the metric formulas."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.engine import Paper4, ResidentRequest, SchedulerConfig, Snapshot
from duetime.estimate import InstanceStats, LpsEstimator, SfsEstimator, ThroughputEstimator
from duetime.metrics import auc, forecast_mape, routing_share, summarize
from duetime.policy import Candidate, RoutingRequest, load_aware_score, make_policy, utility
from duetime.sim import ClusterSim, SimInstance
from duetime.workload import (
    MMPP2,
    Deterministic,
    Poisson,
    ProfileError,
    load_trace,
    load_workload,
    profile_from_dict,
    sample_requests,
)

# -- workloads ----------------------------------------------------------------------------------


def test_paper_workload_statistics() -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(0)
    rs = sample_requests(prof, Poisson(8.0).times(20000, rng), rng)
    # prompt mix close to the released calibration set: ~50% <= 128, ~23% 512-2k, ~26% 2k-32k
    frac = np.histogram(rs.prompt, [0, 128, 512, 2048, 32768])[0] / len(rs)
    assert abs(frac[0] - 0.499) < 0.04 and abs(frac[2] - 0.231) < 0.04
    assert abs(frac[3] - 0.265) < 0.05
    assert rs.prompt.min() >= 8 and rs.prompt.max() <= 32000
    assert 100 <= np.median(rs.output) <= 1000
    # per-(task, model) mean quality follows the paper's table
    for ti, t in enumerate(rs.tasks):
        mine = rs.task == ti
        for mi, m in enumerate(rs.models):
            assert abs(rs.quality[mine, mi].mean() - prof.tasks[t].accuracy[m]) < 0.02
    # TTFT targets by the released rule: 150..1120 ms, ~155 ms + 0.035 ms/token
    assert rs.target.min() >= 0.150 - 1e-12 and rs.target.max() <= 1.120 + 1e-12
    short = rs.prompt < 50
    assert abs(np.median(rs.target[short]) - 0.158) < 0.01


def test_arrival_processes_have_their_rates() -> None:
    rng = np.random.default_rng(1)
    t = Poisson(5.0).times(50000, rng)
    assert abs(len(t) / t[-1] - 5.0) < 0.1 and np.all(np.diff(t) > 0)
    d = Deterministic(4.0).times(8, rng)
    assert np.allclose(np.diff(d), 0.25)
    m = MMPP2(5.0, ratio=6.0, high_fraction=0.2, correlation_time=2.0).times(200000, rng)
    assert abs(len(m) / m[-1] - 5.0) < 0.25 and np.all(np.diff(m) >= 0)
    # burstier than Poisson: counts per second have a larger variance than their mean
    counts = np.bincount(m.astype(int))
    assert counts.var() > 1.5 * counts.mean()


def test_seeded_requests_are_reproducible() -> None:
    prof = load_workload("paper")
    a = sample_requests(prof, np.arange(100.0), np.random.default_rng(7))
    b = sample_requests(prof, np.arange(100.0), np.random.default_rng(7))
    assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.quality, b.quality)


def test_bad_profiles_name_the_field(tmp_path) -> None:
    with pytest.raises(ProfileError, match="tasks"):
        profile_from_dict({"models": {"m": {"profile": "qwen3-8b", "price_usd_per_mtok": {
            "prompt": 1, "output": 1}}}}, "x.yaml")
    with pytest.raises(ProfileError, match=r"models\.m: .*unknown engine profile"):
        profile_from_dict({"models": {"m": {"profile": "nope"}}, "tasks": {}}, "x.yaml")
    with pytest.raises(ProfileError, match=r"nope\.yaml"):
        load_workload(tmp_path / "nope.yaml")


def _paper_dict() -> dict:
    from importlib.resources import files

    import yaml
    return yaml.safe_load(files("duetime.workload").joinpath("profiles", "paper.yaml")
                          .read_text())


def test_a_class_s_own_ttft_target_applies_to_its_requests_only() -> None:
    d = _paper_dict()
    d["tasks"]["alpaca"]["ttft_target"] = {"base_ms": 60, "clip_ms": [50, 90]}
    own, plain = profile_from_dict(d, "own.yaml"), profile_from_dict(_paper_dict(), "p.yaml")
    assert own.tasks["alpaca"].target.base_ms == 60
    assert own.tasks["alpaca"].target.per_prompt_token_ms == plain.target.per_prompt_token_ms
    assert own.tasks["hotpotqa"].target is None
    times = Poisson(8.0).times(4000, np.random.default_rng(1))
    a = sample_requests(own, times, np.random.default_rng(2))
    b = sample_requests(plain, times, np.random.default_rng(2))
    alpaca = a.task == a.tasks.index("alpaca")
    assert (a.target[alpaca] <= 0.090 + 1e-12).all() and (a.target[alpaca] >= 0.050).all()
    assert (b.target[alpaca] >= 0.150).all()
    # the rest of the stream is what it is without the class's rule
    assert np.array_equal(a.target[~alpaca], b.target[~alpaca])
    assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
    for bad, msg in (({"base": 1}, "unknown field"), ({"clip_ms": [90, 50]}, "clip_ms"),
                     ("fast", "must be a mapping")):
        d["tasks"]["alpaca"]["ttft_target"] = bad
        with pytest.raises(ProfileError, match=rf"x.yaml: tasks.alpaca.ttft_target.*{msg}"):
            profile_from_dict(d, "x.yaml")


def test_trace_replay(tmp_path) -> None:
    prof = load_workload("paper")
    path = tmp_path / "t.csv"
    path.write_text("arrival,task,prompt_tokens,output_tokens,ttft_target_ms\n"
                    "2.0,alpaca,30,100,200\n1.0,govreport,9000,,\n")
    rs = load_trace(path, prof, np.random.default_rng(0))
    assert list(rs.arrival) == [1.0, 2.0]
    assert rs.tasks[rs.task[1]] == "alpaca" and rs.prompt[1] == 30
    assert np.all(rs.output[1] == 100) and rs.target[1] == pytest.approx(0.2)
    bad = tmp_path / "b.csv"
    bad.write_text("arrival,task,prompt_tokens\n1.0,chess,30\n")
    with pytest.raises(ProfileError, match=r"b\.csv:2: task"):
        load_trace(bad, prof, np.random.default_rng(0))


# -- policies on hand-built states ----------------------------------------------------------------

class View:
    """A hand-built instance view."""

    def __init__(self, running=0, waiting=0, snap=None, stats=None):
        self.num_running = running
        self.num_waiting = waiting
        self.kv_usage = 0.0
        self._snap = snap
        self.stats = stats or InstanceStats()
        self.request_overhead_s = 0.0

    def snapshot(self):
        return self._snap


CFG = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, block_size=16)
MODEL = Paper4(b0=0.01, b1=1e-4, b2=0.0, b3=0.0)


def busy(n_waiting: int, prompt: int = 400) -> Snapshot:
    return Snapshot(CFG, MODEL, time=0.0, waiting=[
        ResidentRequest(f"w{i}", prompt, 0, 0, 10) for i in range(n_waiting)])


def cands(views, prices=((1.0, 1.0), (1.0, 1.0), (1.0, 1.0))):
    return [Candidate(f"i{k}", f"m{k}", p, o, v) for k, (v, (p, o)) in
            enumerate(zip(views, prices, strict=False))]


def req(quality=(0.5, 0.9, 0.7), target=0.1, prompt=100):
    return RoutingRequest("r", prompt, np.array(quality, dtype=float),
                          np.array([10, 10, 10]), target)


def test_round_robin_cycles() -> None:
    p = make_policy("round-robin")
    c = cands([View(), View(), View()])
    assert [p.choose(req(), c, 0).index for _ in range(5)] == [0, 1, 2, 0, 1]


def test_shortest_queue_and_load_aware() -> None:
    c = cands([View(3, 2), View(1, 1), View(0, 5)])
    assert make_policy("shortest-queue").choose(req(), c, 0).index == 1
    assert load_aware_score(0) == 0.5 and load_aware_score(64) == 0.25
    assert load_aware_score(500) == 0.0
    c = cands([View(9, 3), View(0, 1), View(50, 0)])
    assert make_policy("load-aware").choose(req(), c, 0).index == 2  # waiting == 0 scores 0.5
    picks = {make_policy("shortest-queue", {"seed": s}).choose(req(), cands(
        [View(1, 0), View(0, 1), View(5, 5)]), 0).index for s in range(20)}
    assert picks == {0, 1}  # random tie-break


def test_latency_agnostic_maximises_utility() -> None:
    c = cands([View(), View(), View()], prices=((0, 0), (1e4, 1e4), (0, 0)))
    r = req(quality=(0.5, 0.9, 0.7))
    u = utility(r, c, 5e-4)
    assert u[1] == pytest.approx(0.9 - 5e-4 * (1e4 * 100 + 1e4 * 10))
    assert make_policy("latency-agnostic").choose(r, c, 0).index == 2


def test_sfs_prefers_utility_among_feasible_then_min_forecast() -> None:
    # instance 1 has the best utility but a long queue; 2 is idle; 0 has a short queue
    views = [View(snap=busy(1)), View(snap=busy(20)), View(snap=busy(0))]
    p = make_policy("sfs")
    d = p.choose(req(target=0.2), cands(views), 0.0)
    assert d.index == 2 and d.forecast == pytest.approx(0.01 + 1e-4 * 100)
    # generous target: the best utility wins
    assert p.choose(req(target=10.0), cands(views), 0.0).index == 1
    # nothing feasible: the smallest forecast
    views = [View(snap=busy(3)), View(snap=busy(20)), View(snap=busy(5))]
    d = p.choose(req(target=0.001), cands(views), 0.0)
    assert d.index == 0


def test_estimators() -> None:
    v = View(snap=busy(2, prompt=400))
    sfs = SfsEstimator().ttft(v, 100, 0.0)
    # step 1: w0 400 + w1 112 tokens (budget 512); step 2: w0's decode, w1's last 288 and the
    # probe's 100: 2 steps, 512 + 389 tokens
    assert sfs == pytest.approx(2 * 0.01 + 1e-4 * (512 + 389))
    # its finish, one decode step per later base step (each 0.01 s + 1e-4 per token), for
    # several lengths at once: the same numbers as its e2e replay
    got = SfsEstimator().finishes(v, 100, [1, 5, 40], 0.0)
    assert got[0] == pytest.approx(sfs)
    for n, t in zip([5, 40], got[1:], strict=True):
        assert t == pytest.approx(SfsEstimator().e2e(v, 100, n, 0.0), rel=1e-12)
        assert t > got[0]
    thr = ThroughputEstimator().ttft(v, 100, 0.0)
    assert thr > 0
    # LPS: alpha = 2/s, mean prompt 100, mean output 10; k = max_num_seqs = 16 (KV is ample);
    # mu = 1 / (10 * step(16 decoders) / 16 + prefill(100) - b0) = 1 / (0.00725 + 0.01)
    stats = InstanceStats(elapsed_s=10.0, arrivals=20, e2e_s_sum=5.0, e2e_count=10,
                          prompt_tokens_sum=2000, output_tokens_sum=100)
    mu = 1 / (10 * (0.01 + 16e-4) / 16 + 0.01)
    want = (2 / mu) ** 16 / (mu - 2) + 0.02
    assert LpsEstimator().ttft(View(snap=busy(0), stats=stats), 100, 0.0) == pytest.approx(want)
    stats.arrivals, stats.prompt_tokens_sum = 1000, 100_000  # alpha = 100/s > mu: saturated
    assert LpsEstimator().ttft(View(snap=busy(0), stats=stats), 100, 0.0) == 60.0
    # with k = 2 given: mu = 1 / (10 * step(2) / 2 + 0.01) = 16.4/s, alpha = 10/s
    stats.arrivals, stats.prompt_tokens_sum = 100, 10_000
    mu2 = 1 / (10 * (0.01 + 2e-4) / 2 + 0.01)
    want = (10 / mu2) ** 2 / (mu2 - 10) + 0.02
    assert LpsEstimator(k=2).ttft(View(snap=busy(0), stats=stats), 100, 0.0) == pytest.approx(
        want)


# -- the simulator --------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["round-robin", "sfs", "lps", "sfs-soft"])
def test_simulator_loses_no_request_and_times_are_monotone(policy: str) -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(3)
    rs = sample_requests(prof, Poisson(6.0).times(600, rng), rng)
    res = ClusterSim(prof, make_policy(policy), noise=0.05, seed=3).run(rs)
    assert np.all(np.isfinite(res.first_token)) and np.all(np.isfinite(res.finish))
    assert np.all(res.first_token > rs.arrival)
    assert np.all(res.finish >= res.first_token)
    # a request that generates one token finishes at its first token
    one = res.output_tokens == 1
    assert np.all(res.finish[one] == res.first_token[one])
    s = summarize(res)
    assert s["requests"] == 600 and 0 <= s["on_time"] <= 1
    shares = routing_share(res)
    for t in rs.tasks:
        assert sum(shares[t].values()) == pytest.approx(1.0)


def test_simulator_is_reproducible_and_sfs_beats_latency_agnostic_under_load() -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(5)
    rs = sample_requests(prof, Poisson(8.0).times(1500, rng), rng)
    a = ClusterSim(prof, make_policy("sfs"), seed=1).run(rs)
    b = ClusterSim(prof, make_policy("sfs"), seed=1).run(rs)
    assert np.array_equal(a.first_token, b.first_token)
    la = summarize(ClusterSim(prof, make_policy("latency-agnostic"), seed=1).run(rs))
    sf = summarize(a)
    assert sf["ontime_utility"] > la["ontime_utility"]
    assert sf["forecast_mape"] < 0.2


# -- metric formulas ------------------------------------------------------------------------------

def test_metric_formulas() -> None:
    assert auc([1, 2, 3], [1.0, 1.0, 3.0]) == pytest.approx(1.0 + 2.0)
    assert auc([3, 1, 2], [3.0, 1.0, 1.0]) == pytest.approx(3.0)  # sorted by rate
    f = np.array([1.0, np.nan, 3.0, np.inf])
    t = np.array([2.0, 1.0, 2.0, 1.0])
    assert forecast_mape(f, t) == pytest.approx((0.5 + 0.5) / 2)
    assert forecast_mape(np.array([np.nan]), np.array([1.0])) is None


def test_ontime_utility_is_utility_of_on_time_requests() -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(9)
    rs = sample_requests(prof, Poisson(7.0).times(400, rng), rng)
    res = ClusterSim(prof, make_policy("shortest-queue"), seed=2).run(rs)
    s = summarize(res)
    u = res.quality - prof.lam * res.cost
    on = res.ttft <= rs.target
    assert s["ontime_utility"] == pytest.approx(float(np.mean(u * on)))
    assert s["utility"] == pytest.approx(float(np.mean(u)))
    assert s["mean_ttft_s"] == pytest.approx(float(np.mean(res.first_token - rs.arrival)))


def test_closed_loop_keeps_n_requests_in_flight() -> None:
    prof = load_workload("paper")
    rs = sample_requests(prof, np.zeros(200), np.random.default_rng(4))
    res = ClusterSim(prof, make_policy("shortest-queue"), seed=4).run(rs, closed_loop=8)
    a = res.requests.arrival
    assert np.all(a[:8] == 0.0) and np.all(np.diff(a) >= 0)
    assert np.all(np.isfinite(res.finish)) and np.all(res.first_token > a)
    # each later request is sent at the moment an earlier one finished
    finishes = set(res.finish.tolist())
    assert all(t in finishes for t in a[8:].tolist())
    events = sorted([(t, 1) for t in a] + [(t, -1) for t in res.finish])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 8


def test_an_idle_instance_snapshot_follows_its_clock() -> None:
    """A cached snapshot must not go stale when an idle engine's clock jumps."""
    inst = SimInstance("a", load_workload("paper").models["qwen3-8b"])
    inst.engine.run_until(1.0)
    assert inst.snapshot().time == 1.0
    inst.engine.run_until(2.0)
    assert inst.snapshot().time == 2.0


def test_sfs_forecasts_are_measured_from_the_arrival() -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(6)
    rs = sample_requests(prof, Poisson(0.5).times(60, rng), rng)  # mostly idle instances
    res = ClusterSim(prof, make_policy("sfs"), length_error=0.0, seed=6).run(rs)
    ok = np.isfinite(res.forecast)
    assert ok.all() and np.all(res.forecast > 0)
    # with exact lengths and no noise the forecast is the realised TTFT
    assert np.allclose(res.forecast, res.ttft, rtol=1e-9, atol=1e-9)


def test_sfs_soft_trades_utility_for_forecast() -> None:
    views = [View(snap=busy(0)), View(snap=busy(20)), View(snap=busy(2))]
    c = cands(views)
    r = req(quality=(0.5, 0.9, 0.7), target=0.1)
    assert make_policy("sfs-soft", {"delta": 0.0}).choose(r, c, 0).index == 1  # latency-agnostic
    d = make_policy("sfs-soft", {"delta": 1e-6}).choose(r, c, 0)
    # forecasts: idle 0.02 s, 20 queued 400-token prompts ~1.8 s, 2 queued ~0.11 s;
    # scores u - 1e-6 * us: 0.5 - 0.02, 0.9 - 1.8, 0.7 - 0.11: instance 2
    assert d.index == 2 and d.forecast == pytest.approx(SfsEstimator().ttft(views[2], 100, 0))


def test_a_custom_length_model_feeds_the_snapshots() -> None:
    prof = load_workload("paper")
    rng = np.random.default_rng(8)
    rs = sample_requests(prof, Poisson(4.0).times(200, rng), rng)
    seen = []

    def exact(requests, rng):
        seen.append(len(requests))
        return requests.output

    res = ClusterSim(prof, make_policy("sfs"), length_model=exact, seed=8).run(rs)
    assert seen == [200]
    # Exact lengths and no noise: a forecast is exact unless a later arrival joins the same
    # instance before the first token (its chunk can lengthen a shared step); never too late.
    assert np.all(res.forecast <= res.ttft + 1e-9)
    undisturbed = [i for i in range(len(rs)) if not np.any(
        (res.instance == res.instance[i]) & (rs.arrival > rs.arrival[i])
        & (rs.arrival < res.first_token[i]))]
    assert len(undisturbed) > 150
    assert np.allclose(res.forecast[undisturbed], res.ttft[undisturbed], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="shape"):
        ClusterSim(prof, make_policy("sfs"), length_model=lambda r, g: r.output[:, :1]).run(rs)
