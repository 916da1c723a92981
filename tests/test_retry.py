"""LAAR's workload, the retry simulator and the retry-aware policies."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from duetime.engine import Paper4, SchedulerConfig
from duetime.policy import Candidate, RoutingRequest, make_policy
from duetime.sim.retry import run_retries
from duetime.workload.kvlookup import (
    check_answer,
    estimate_tokens,
    generate,
    load_pool,
    make_query,
)

CFG = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=131072,
                      num_gpu_blocks=100_000)


def test_kv_lookup_queries() -> None:
    rng = np.random.default_rng(0)
    for lang, head in (("en", "JSON data: "), ("ja", "JSONデータ: "), ("zh", "JSON数据: ")):
        q = make_query(rng, 4096, lang, "q", "fit")
        assert q.prompt.startswith(head) and q.key in q.prompt
        assert abs(q.prompt_tokens - 4096) / 4096 < 0.05
        data = json.loads(q.prompt[len(head):q.prompt.rindex("}") + 1])
        assert data[q.key] == q.value and len(data) > 50
        assert check_answer(f"The value is {q.value}.", q.value)
        assert not check_answer("I do not know.", q.value)
    qs = generate(4, contexts=(256,), languages=("en", "zh"), seed=1)
    assert [q.split for q in qs] == ["fit", "fit", "eval", "eval"] * 2
    assert generate(4, contexts=(256,), languages=("en",), seed=1)[0].prompt == qs[0].prompt
    assert estimate_tokens("x" * 17) == 10


def test_the_pool_follows_the_papers_findings() -> None:
    pool = load_pool()
    m = pool.models
    assert set(m) == {"granite3.1-2b", "granite3.1-8b", "phi3-mini", "phi3-medium",
                      "llama3.1-swallow-8b"}
    for lang in pool.languages:
        for name in m:  # accuracy falls with context length
            s = m[name].success[lang]
            assert all(a >= b for a, b in itertools.pairwise(s))
        assert m["granite3.1-2b"].p_success(lang, 0) < m["granite3.1-8b"].p_success(lang, 0)
        assert m["granite3.1-2b"].p_success(lang, 4) > m["granite3.1-8b"].p_success(lang, 4)
        assert m["llama3.1-swallow-8b"].p_success(lang, 2) > 0.7 > m[
            "llama3.1-swallow-8b"].p_success(lang, 3)
    # latency ranking: phi3-mini is slower than granite3.1-2b and swallow-8b at all lengths
    for ctx in pool.contexts:
        def prefill(name, n=ctx):
            return m[name].spec.batch_time.duration(0, n, n * n, n * (n + 1) // 2, 0, n, n * n)
        assert prefill("phi3-mini") > max(prefill("granite3.1-2b"),
                                          prefill("llama3.1-swallow-8b"))


class View:
    def __init__(self, waiting=0):
        from duetime.engine import ResidentRequest, Snapshot

        self.num_running = 0
        self.num_waiting = waiting
        self.request_overhead_s = 0.0
        self._snap = Snapshot(CFG, Paper4(b0=0.01, b1=1e-5, b2=0.0, b3=0.0), waiting=[
            ResidentRequest(f"w{i}", 4000, 0, 0, 10) for i in range(waiting)])

    def snapshot(self):
        return self._snap


def cands(*views):
    return [Candidate(f"i{k}", f"m{k}", 0.0, 0.0, v) for k, v in enumerate(views)]


def rreq(q, attempted=(), session="s"):
    """A request whose predicted success probabilities are ``q``."""
    return RoutingRequest("r", 1000, None, np.array([10] * len(q)), float("inf"),
                          session=session, attempted=frozenset(attempted),
                          success=np.array(q, dtype=float))


def test_laar_ranks_by_latency_over_success_and_penalises_attempts() -> None:
    p = make_policy("laar")
    c = cands(View(0), View(0), View(20))
    assert p.choose(rreq([0.5, 0.9, 0.95]), c, 0).index == 1  # same latency, higher Q
    assert p.choose(rreq([0.5, 0.9, 0.95], attempted={"m1"}), c, 0).index == 0
    # a long queue outweighs a small accuracy edge: 20 x 4000 queued tokens at alpha 0.7
    assert p.choose(rreq([0.5, 0.9, 0.95], attempted={"m1", "m0"}), c, 0).index == 2


def test_ttca_excludes_attempted_models_and_uses_forecasts() -> None:
    p = make_policy("ttca")
    c = cands(View(0), View(30), View(0))
    d = p.choose(rreq([0.6, 0.99, 0.5]), c, 0)
    assert d.index == 0 and d.forecast > 0  # the busy instance's forecast is far longer
    assert p.choose(rreq([0.6, 0.99, 0.5], attempted={"m0"}), c, 0).index == 2
    every = p.choose(rreq([0.6, 0.99, 0.5], attempted={"m0", "m1", "m2"}), c, 0)
    assert every.index in (0, 2)  # all attempted: the fastest forecast


def test_session_affinity_sticks() -> None:
    p = make_policy("session-affinity")
    first = p.choose(rreq([0.5, 0.5], session="a"), cands(View(3), View(0)), 0).index
    assert first == 1  # load-aware: no waiting requests
    again = p.choose(rreq([0.5, 0.5], attempted={"m1"}, session="a"),
                     cands(View(0), View(50)), 0).index
    assert again == 1


def _pool():
    pool = load_pool()
    return pool, {m: pm.spec for m, pm in pool.models.items()}


def test_retries_until_correct_and_ttca_accounting() -> None:
    _, models = _pool()
    n, k = 30, len(models)
    rng = np.random.default_rng(2)
    correct = rng.random((n, k)) < 0.4
    correct[0] = False  # never solved: censored at the cap
    q_pred = np.full((n, k), 0.4)
    outs = np.full((n, k), 40)
    res = run_retries(models, make_policy("laar"), np.full(n, 8192), outs, correct,
                      q_pred, clients=8, retry_cap=10)
    assert len(res.attempts) == n
    for qi, a in enumerate(res.attempts):
        ok = [c for _, _, c in a]
        assert all(lat > 0 for _, lat, _ in a)
        if correct[qi].any():  # laar tries new models first: solved within the pool's size
            assert ok[-1] and not any(ok[:-1]) and len(a) <= k
        else:
            assert not any(ok) and len(a) == 10
    assert res.ttca[0] == pytest.approx(sum(lat for _, lat, _ in res.attempts[0]))
    s = res.success_by_attempt(10)
    assert np.all(np.diff(s) >= 0) and s[-1] == pytest.approx(res.solved.mean())
    # session affinity repeats the first model: one attempt solves or all ten fail
    res = run_retries(models, make_policy("session-affinity"), np.full(n, 8192), outs,
                      correct, q_pred, clients=8, retry_cap=10)
    assert all(len({m for m, _, _ in a}) == 1 for a in res.attempts)


def test_laar_and_ttca_beat_the_baselines() -> None:
    pool, models = _pool()
    names = list(models)
    rng = np.random.default_rng(3)
    p = np.array([pool.models[m].p_success("en", 3) for m in names])
    truth = rng.random((80, len(names))) < p
    fit, ev = truth[:40], truth[40:]
    q_pred = np.repeat(((fit.sum(0) + 1) / 42)[None, :], 40, 0)
    outs = np.full((40, len(names)), 40)
    mean = {}
    for pol in ("load-aware", "session-affinity", "laar", "ttca"):
        res = run_retries(models, make_policy(pol), np.full(40, 32768), outs, ev,
                          q_pred, clients=8, retry_cap=10)
        mean[pol] = res.ttca.mean()
    assert mean["laar"] < mean["load-aware"] and mean["laar"] < mean["session-affinity"]
    assert mean["ttca"] <= mean["laar"] * 1.05


def test_session_affinity_forgets_the_oldest_sessions_past_its_bound():
    from duetime.policy.retry import BoundedDict

    d = BoundedDict(3)
    for k in "abcd":
        d[k] = k.upper()
    d["b"] = "B"  # (rebinding refreshes it)
    d["e"] = "E"
    assert list(d) == ["d", "b", "e"]
