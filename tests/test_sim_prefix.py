"""The simulator with prefix caching: instances cache shared prefixes (the engine's automatic
prefix caching, given each request's block hashes), routers see a precise or an estimated view
of every instance's cache, and results count the cache's hit rate."""

from __future__ import annotations

import json
from importlib.resources import files

import numpy as np
import pytest

from duetime.cli import main
from duetime.estimate import EstimatedPrefixIndex
from duetime.estimate.prefix_index import EngineCacheIndex
from duetime.metrics import summarize
from duetime.policy import Candidate, RoutingRequest, make_policy
from duetime.sim import ClusterSim, SimInstance
from duetime.sim.cache_view import keys_by_block_size
from duetime.sim.retry import run_retries
from duetime.workload import (
    Poisson,
    RequestSet,
    load_workload,
    multi_turn,
    prompt_hashes,
    sample_requests,
    sequence_hashes,
)

DEMO = load_workload("demo")
REPLICAS = [(f"r{k}", "qwen3-8b") for k in range(4)]  # four instances of one model


def conversations(seed: int = 0, n_sessions: int = 30, system: int = 0) -> RequestSet:
    """Chat sessions at one session per second; each turn's prompt is the conversation so far
    (~2k tokens on average), so a turn shares its previous turns' blocks."""
    return multi_turn(DEMO, 1.0, np.random.default_rng(seed), n_sessions=n_sessions,
                      question_len=300, answer_len=200, think_time_s=5.0,
                      system_prompt_len=system)


def run(policy: str, requests: RequestSet, **kw):
    return ClusterSim(DEMO, make_policy(policy), seed=0, **kw).run(requests)


# -- instances and their cache views ------------------------------------------------------------

def test_prefix_caching_overrides_every_instance_config_or_keeps_the_profiles() -> None:
    policy = make_policy("round-robin")
    assert not DEMO.models["qwen3-8b"].config.enable_prefix_caching
    assert ClusterSim(DEMO, policy).spec("qwen3-8b") is DEMO.models["qwen3-8b"]
    on = ClusterSim(DEMO, policy, prefix_caching=True).spec("qwen3-8b")
    assert on.config.enable_prefix_caching
    assert on.config.num_gpu_blocks == DEMO.models["qwen3-8b"].config.num_gpu_blocks
    assert not ClusterSim(DEMO, policy, prefix_caching=False).spec(
        "qwen3-8b").config.enable_prefix_caching
    with pytest.raises(ValueError, match="cache_view"):
        ClusterSim(DEMO, policy, cache_view="psychic")
    with pytest.raises(ValueError, match="prefix_caching"):
        ClusterSim(DEMO, policy, prefix_caching="yes")


def test_an_instance_carries_a_precise_or_estimated_index_only_when_it_caches() -> None:
    spec = ClusterSim(DEMO, make_policy("round-robin"), prefix_caching=True).spec("qwen3-8b")
    cfg = spec.config
    precise = SimInstance("a", spec).prefix_index
    assert isinstance(precise, EngineCacheIndex)
    assert (precise.block_size, precise.capacity_blocks) == (cfg.block_size, cfg.usable_blocks)
    est = SimInstance("b", spec, cache_view="estimated").prefix_index
    assert isinstance(est, EstimatedPrefixIndex)
    assert (est.block_size, est.capacity_blocks) == (cfg.block_size, cfg.usable_blocks)
    assert SimInstance("c", DEMO.models["qwen3-8b"]).prefix_index is None
    with pytest.raises(ValueError, match="cache_view"):
        SimInstance("d", spec, cache_view="psychic")


def test_the_precise_index_reads_the_engine_cache() -> None:
    spec = ClusterSim(DEMO, make_policy("round-robin"), prefix_caching=True).spec("qwen3-8b")
    inst = SimInstance("a", spec)
    idx = inst.prefix_index
    rs = conversations(n_sessions=1)
    h = sequence_hashes(rs, 0, int(rs.output[0, 0]), 16)
    assert idx.match(h) == 0 and idx.cached_blocks() == 0
    inst.engine.add("0", int(rs.prompt[0]), int(rs.output[0, 0]), hashes=h)
    inst.engine.drain()
    assert idx.match(h) == inst.engine.cached_prefix(h) > 0
    assert idx.cached_blocks() == inst.engine.cached_blocks > 0
    idx.record([123, 456])  # a no-op: the engine's cache is read as it is
    assert idx.match([123]) == 0


# -- what the router and the engine are given -----------------------------------------------------

class Spy:
    """Wraps a policy and keeps every request it routes."""

    def __init__(self, name: str) -> None:
        self.policy = make_policy(name)
        self.seen: list[RoutingRequest] = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def choose(self, req, cands, now):
        self.seen.append(req)
        return self.policy.choose(req, cands, now)


def test_requests_carry_their_prompt_hashes_and_session() -> None:
    rs = conversations(n_sessions=4)
    spy = Spy("round-robin")
    ClusterSim(DEMO, spy, seed=0).run(rs)  # caching off: the router is still told
    assert len(spy.seen) == len(rs)
    for i, req in enumerate(spy.seen):
        assert np.array_equal(req.prompt_hashes(16), prompt_hashes(rs, i, 16))
        assert req.prompt_hashes(16) is req.prompt_hashes(16)  # memoised per block size
        assert req.session == str(rs.session[i])
    plain = sample_requests(DEMO, np.arange(5) * 0.5, np.random.default_rng(0))
    spy = Spy("round-robin")
    ClusterSim(DEMO, spy, seed=0).run(plain)
    assert all(r.prompt_hashes is None and r.session is None for r in spy.seen)


def test_session_affinity_keeps_a_conversation_on_its_instance() -> None:
    rs = conversations(n_sessions=12)
    res = run("session-affinity", rs, instances=REPLICAS, prefix_caching=True)
    for s in np.unique(rs.session):
        assert len(set(res.instance[rs.session == s].tolist())) == 1


def test_a_later_turn_hits_the_previous_answer_blocks() -> None:
    # one session of two turns, far apart: turn 2's prompt = q1 a1 q2 (100 + 200 + 100 tokens)
    rs = multi_turn(DEMO, 1.0, np.random.default_rng(0), n_sessions=1, turns=2,
                    question_len=100, answer_len=200, think_time_s=60.0)
    assert len(rs) == 2 and rs.prompt.tolist() == [100, 400]
    res = run("round-robin", rs, instances=REPLICAS[:1], prefix_caching=True)
    # the prompt and answer of turn 1 are cached but its last token (whose KV is never
    # computed): 299 tokens = 18 full blocks; the prompt's hashes alone would give 6
    assert res.prefix_hits.tolist() == [18 * 16]
    assert res.prefix_queries.tolist() == [100 + 400]


# -- (a) caching cuts TTFT ------------------------------------------------------------------------

def test_caching_gives_hits_and_lower_ttft_on_the_same_requests() -> None:
    rs = conversations(system=1000)  # one shared system prompt, then each conversation
    off = run("round-robin", rs)
    on = run("round-robin", rs, prefix_caching=True)
    assert off.cache_hit_rate is None and "cache_hit_rate" not in summarize(off)
    assert np.array_equal(off.instance, on.instance)  # round-robin: the same choices
    s_off, s_on = summarize(off), summarize(on)
    assert s_on["cache_hit_rate"] == on.cache_hit_rate > 0.6
    assert s_on["mean_ttft_s"] < 0.5 * s_off["mean_ttft_s"]
    rates = on.instance_cache_hit_rate
    assert rates.shape == (3,) and np.all(rates > 0.5)
    assert on.cache_hit_rate == pytest.approx(on.prefix_hits.sum() / on.prefix_queries.sum())


# -- (b) cache-aware routing with the precise view ------------------------------------------------

@pytest.mark.parametrize("view", ["precise", "estimated"])
def test_cache_aware_policies_beat_round_robin_on_hit_rate(view: str) -> None:
    rs = conversations()
    rr = run("round-robin", rs, instances=REPLICAS, prefix_caching=True, cache_view=view)
    assert 0.2 < rr.cache_hit_rate < 0.6  # a turn meets its previous turns 1 time in 4
    for name in ("prefix-load", "cache-aware"):
        res = run(name, rs, instances=REPLICAS, prefix_caching=True, cache_view=view)
        assert res.cache_hit_rate > rr.cache_hit_rate + 0.25, name
        assert summarize(res)["mean_ttft_s"] < summarize(rr)["mean_ttft_s"]


# -- (c) the estimated view learns from the router's own decisions --------------------------------

def test_the_estimated_index_learns_from_routing() -> None:
    spec = ClusterSim(DEMO, make_policy("round-robin"), prefix_caching=True).spec("qwen3-8b")
    insts = [SimInstance(f"r{k}", spec, cache_view="estimated") for k in range(2)]
    cands = [Candidate(i.name, "qwen3-8b", 0.0, 0.0, i) for i in insts]
    rs = conversations(n_sessions=1, system=1000)
    policy = make_policy("prefix-load")

    def request(i: int) -> RoutingRequest:
        return RoutingRequest(str(i), int(rs.prompt[i]), None, rs.output[i, :2], 1.0,
                              prompt_hashes=keys_by_block_size(rs.segments[i]))

    first = policy.choose(request(0), cands, 0.0).index
    h = prompt_hashes(rs, 1, 16)  # turn 2 shares turn 1's prompt
    assert insts[first].prefix_index.match(h) == len(prompt_hashes(rs, 0, 16)) > 0
    assert insts[1 - first].prefix_index.match(h) == 0
    assert insts[first].engine.cached_prefix(h) == 0  # nothing ran: only the router knows
    assert policy.choose(request(1), cands, 0.0).index == first


# -- (d) without segments, caching changes nothing when KV is ample -------------------------------

@pytest.mark.parametrize("policy", ["round-robin", "shortest-queue"])
def test_without_segments_caching_on_equals_caching_off(policy: str) -> None:
    rng = np.random.default_rng(3)
    rs = sample_requests(DEMO, Poisson(4.0).times(300, rng), rng)
    off = run(policy, rs)
    on = run(policy, rs, prefix_caching=True)
    assert np.array_equal(off.instance, on.instance)
    assert np.array_equal(off.first_token, on.first_token)
    assert np.array_equal(off.finish, on.finish)
    assert on.cache_hit_rate == 0.0 and on.prefix_queries.sum() > 0


def test_the_closed_loop_keeps_the_segments() -> None:
    rs = conversations(n_sessions=8)
    res = ClusterSim(DEMO, make_policy("cache-aware"), seed=0, instances=REPLICAS,
                     prefix_caching=True).run(rs, closed_loop=4)
    assert res.requests.segments is rs.segments and res.requests.session is rs.session
    assert res.requests.answer_segment is rs.answer_segment
    assert res.cache_hit_rate > 0.3


def test_a_profile_config_may_turn_caching_on(tmp_path) -> None:
    path = tmp_path / "cached.yaml"
    src = (files("duetime.workload") / "profiles" / "demo.yaml").read_text()
    path.write_text(src.replace("qwen3-8b:   {profile: qwen3-8b,",
                                "qwen3-8b:   {profile: qwen3-8b, config: "
                                "{enable_prefix_caching: true},"))
    prof = load_workload(str(path))
    assert prof.models["qwen3-8b"].config.enable_prefix_caching
    assert not prof.models["qwen3-32b"].config.enable_prefix_caching
    rs = multi_turn(prof, 1.0, np.random.default_rng(0), n_sessions=10, question_len=300,
                    answer_len=200, think_time_s=5.0)
    res = ClusterSim(prof, make_policy("round-robin"), seed=0).run(rs)
    assert np.isnan(res.instance_cache_hit_rate[[0, 2]]).all()
    assert res.instance_cache_hit_rate[1] > 0 and res.cache_hit_rate > 0
    assert res.prefix_queries[[0, 2]].tolist() == [0, 0]


# -- retries re-send the same prompt --------------------------------------------------------------

def test_retries_resend_the_same_prompt_hashes() -> None:
    models = {"qwen3-8b": DEMO.models["qwen3-8b"]}
    rs = conversations(n_sessions=6)
    n = len(rs)
    outs = np.full((n, 1), 20)
    wrong = np.zeros((n, 1), dtype=bool)  # every attempt fails: three attempts each
    kw = dict(clients=1, retry_cap=3, prefix_caching=True)
    plain = run_retries(models, make_policy("load-aware"), rs.prompt, outs, wrong,
                        np.full((n, 1), 0.5), **kw)
    assert plain.cache_hit_rate == 0.0
    spy = Spy("load-aware")
    res = run_retries(models, spy, rs.prompt, outs, wrong, np.full((n, 1), 0.5),
                      segments=rs.segments, **kw)
    assert all(len(a) == 3 for a in res.attempts)
    by_query: dict[str, list[np.ndarray]] = {}
    for req in spy.seen:
        by_query.setdefault(req.session, []).append(req.prompt_hashes(16))
    assert all(len(v) == 3 and all(np.array_equal(v[0], x) for x in v)
               for v in by_query.values())
    # the 2nd and 3rd attempts find the whole prompt (but its last partial block) cached
    assert res.cache_hit_rate > 0.6
    off = run_retries(models, make_policy("load-aware"), rs.prompt, outs, wrong,
                      np.full((n, 1), 0.5), segments=rs.segments, clients=1, retry_cap=3)
    assert off.cache_hit_rate is None


# -- (e) the command line -------------------------------------------------------------------------

def test_simulate_with_prefix_caching_prints_the_hit_rate(tmp_path, capsys) -> None:
    out = tmp_path / "on"
    assert main(["simulate", "--policy", "cache-aware", "--workload", "demo",
                 "--prefix-workload", "multi-turn", "--rate", "1", "--requests", "80",
                 "--prefix-caching", "--cache-view", "estimated", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cache_hit_rate" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 80 and summary["cache_view"] == "estimated"
    assert 0 < summary["cache_hit_rate"] <= 1
    assert set(summary["cache_hit_rate_by_instance"]) == set(DEMO.model_names)
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert "cache_hit_rate" in header
    # caching off: no hit rate
    out = tmp_path / "off"
    assert main(["simulate", "--policy", "cache-aware", "--workload", "demo",
                 "--prefix-workload", "tenants", "--rate", "2", "--requests", "40",
                 "--no-prefix-caching", "--out", str(out)]) == 0
    assert "cache_hit_rate" not in capsys.readouterr().out
    assert "cache_hit_rate" not in json.loads((out / "summary.json").read_text())


def test_simulate_replays_a_mooncake_trace_with_caching(tmp_path, capsys) -> None:
    trace = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 1000 * k, "input_length": 1000, "output_length": 20,
             "hash_ids": [1, 2 + k]} for k in range(6)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "mc"
    assert main(["simulate", "--policy", "prefix-load", "--workload", "demo", "--mooncake",
                 str(trace), "--prefix-caching", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 6 and summary["cache_view"] == "precise"
    # each later request finds the shared 512-token block where the first one went
    assert summary["cache_hit_rate"] == pytest.approx(5 * 512 / 6000)
    assert "cache_hit_rate" in capsys.readouterr().out


def test_simulate_prefix_options_are_checked_and_documented(tmp_path, capsys) -> None:
    code = main(["simulate", "--policy", "round-robin", "--prefix-workload", "tenants",
                 "--trace", "x.csv", "--rate", "1", "--requests", "5", "--out", str(tmp_path)])
    assert code == 2 and "at most one of" in capsys.readouterr().err
    code = main(["simulate", "--policy", "round-robin", "--cache-view", "psychic",
                 "--rate", "1", "--requests", "5", "--out", str(tmp_path)])
    assert code == 2
    capsys.readouterr()
    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--prefix-caching, --no-prefix-caching", "--cache-view", "--prefix-workload",
                 "--mooncake"):
        assert flag in text
