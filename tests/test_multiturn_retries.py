"""The multi-turn retry driver and the ``ttca-multiturn`` experiment."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from duetime.experiments.catalog import EXPERIMENTS
from duetime.experiments.fanout import Fanout
from duetime.experiments.multiturn import run_multiturn
from duetime.policy import make_policy
from duetime.policy.base import Policy
from duetime.sim.multiturn import run_conversations
from duetime.workload.kvlookup import load_pool
from duetime.workload.kvlookup.conversations import conversations

NAMES = ("granite3.1-2b", "phi3-mini")


class Spy(Policy):
    """ttca, recording what each decision saw."""

    name = "spy"

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_policy("ttca")
        self.consumes = self.inner.consumes
        self.seen: dict[str, tuple[float, str | None, frozenset, int]] = {}

    def choose(self, req, cands, now):
        self.seen[req.id] = (now, req.session, req.attempted, req.prompt_tokens)
        return self.inner.choose(req, cands, now)


def _setup(retry_cap: int = 3):
    pool = load_pool()
    models = {m: pool.models[m].spec for m in NAMES}
    convs = conversations(pool, 3, "en", 0, 3, seed=0, names=NAMES)
    truth = [np.array([[False, True], [False, False], [True, True]]),  # turn 2: capped
             np.array([[True, True]] * 3), np.array([[True, False]] * 3)]
    convs = [replace(c, correct=t) for c, t in zip(convs, truth, strict=True)]
    return pool, models, convs


def test_turns_are_retried_until_correct_or_capped_then_the_next_turn_follows() -> None:
    pool, models, convs = _setup()
    spy = Spy()
    res = run_conversations(models, spy, convs, clients=3, retry_cap=3)
    assert list(res.conversation) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert list(res.turn) == [0, 1, 2] * 3
    a = res.turns.attempts
    # conversation 0, turn 1: the first model fails, ttca tries the other (right)
    assert [(m, ok) for m, _, ok in a[0]] == [(NAMES[0], False), (NAMES[1], True)]
    # turn 2: both models wrong: capped at 3 attempts, every model tried first
    assert len(a[1]) == 3 and not any(ok for _, _, ok in a[1])
    assert {m for m, _, _ in a[1][:2]} == set(NAMES)
    assert all(x[-1][2] for x in a[3:])  # the other turns end right
    # each attempt is sent when the one before it in its conversation ended (no think time):
    # a turn starts only after the previous turn's last attempt
    for c in range(3):
        t = 0.0
        for k in range(3):
            for j, (_, lat, _) in enumerate(a[3 * c + k]):
                now, session, attempted, tokens = spy.seen[f"{c}.{k}.{j}"]
                assert now == pytest.approx(t, abs=1e-9)
                assert session == str(c) and tokens == pool.contexts[k]
                assert attempted == frozenset(m for m, _, _ in a[3 * c + k][:j])
                t += lat
    # time-to-goal = the sum of the turns' TTCAs; the goal needs every turn right
    ttg = res.time_to_goal
    assert ttg == pytest.approx([res.ttca[3 * c:3 * c + 3].sum() for c in range(3)])
    assert list(res.goal) == [False, True, True]
    assert res.ttca_by_turn() == pytest.approx(
        [np.mean([res.ttca[3 * c + k] for c in range(3)]) for k in range(3)])


def test_a_later_turn_hits_the_cache_of_the_instance_that_answered() -> None:
    """One model, one conversation, every turn right: turn k+1 finds turn k's prompt and
    answer cached (their full blocks), and nothing else."""
    pool = load_pool()
    name = "granite3.1-2b"
    conv = conversations(pool, 1, "en", 0, 3, seed=0, names=(name,))[0]
    conv = replace(conv, correct=np.ones((3, 1), dtype=bool))
    res = run_conversations({name: pool.models[name].spec}, make_policy("laar"), [conv],
                            clients=1)
    bs = pool.models[name].spec.config.block_size
    expect = sum((pool.contexts[k] + conv.answer_tokens) // bs * bs for k in range(2))
    assert int(res.turns.prefix_hits.sum()) == expect
    assert int(res.turns.prefix_queries.sum()) == sum(pool.contexts[:3])


def test_the_experiment_writes_its_summary(tmp_path) -> None:
    assert "ttca-multiturn" in EXPERIMENTS
    rows, summary, sections = run_multiturn(tmp_path, True, 0, lambda s: None, Fanout(), n=3,
                                            languages=("en",),
                                            settings=(("growing", 0), ("follow-up", 0)))
    assert {r["router"] for r in rows} == {"ttca", "laar", "session-affinity", "prefix-load",
                                           "cache-aware"}
    for key in ("mean_time_to_goal_s", "goal_share", "mean_ttca_by_turn_s", "cache_hit_rate",
                "best_baseline", "ttca_gain_vs_best"):
        assert key in summary
    best = summary["best_baseline"]
    ttg = summary["mean_time_to_goal_s"]
    assert summary["ttca_gain_vs_best"] == pytest.approx(ttg[best] / ttg["ttca"] - 1)
    assert summary["goal_share"][best] >= summary["goal_share"]["ttca"]
    assert len(summary["mean_ttca_by_turn_s"]["ttca"]) == 4
    assert set(summary["by_shape"]) == {"growing", "follow-up"}
    assert {(r["shape"], r["contexts"]) for r in rows} == {("growing", "4K-32K"),
                                                           ("follow-up", "4K doc")}
    assert (tmp_path / "ttca_multiturn.png").stat().st_size > 0
    json.dumps(summary)
    assert any("time-to-goal" in s for s in sections)


def test_replicas_of_a_model_share_its_answers_and_its_failures() -> None:
    """With two replicas per model, a model that failed a turn is not retried on its other
    replica by ttca (it would fail again): the turn's second attempt goes to the other model."""
    _, models, convs = _setup()
    res = run_conversations(models, make_policy("ttca"), convs, clients=3, retry_cap=3,
                            replicas=2)
    assert len(res.turns.prefix_queries) == 4
    a = res.turns.attempts
    assert [(m, ok) for m, _, ok in a[0]] == [(NAMES[0], False), (NAMES[1], True)]
    assert {m for m, _, _ in a[1][:2]} == set(NAMES)
