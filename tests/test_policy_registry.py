"""The policy registry: declared parameters are typed and checked, declared inputs decide what
the simulator and the gateway provide, and a new policy is one class plus one registration."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.cli import main
from duetime.gateway import pool_from_dict
from duetime.gateway.app import Gateway
from duetime.policy import (
    INPUTS,
    Candidate,
    Decision,
    Param,
    Policy,
    PolicyError,
    RoutingRequest,
    consumes,
    make_policy,
    policy_class,
    policy_names,
)
from duetime.policy import registry as reg
from duetime.policy.registry import QUALITY, SEED
from duetime.sim import ClusterSim
from duetime.workload import load_workload, sample_requests

ALL = ("round-robin", "shortest-queue", "load-aware", "latency-agnostic", "sfs", "sfs-soft",
       "throughput", "lps", "session-affinity", "laar", "ttca", "prefix-load", "cache-aware",
       "lora-affinity", "sfs-deadline", "slo-headroom")


def test_every_policy_is_registered_with_its_declarations():
    assert policy_names() == ALL
    for name in ALL:
        cls = policy_class(name)
        assert cls.name == name and cls.summary
        assert set(cls.consumes) <= set(INPUTS)
        assert make_policy(name).name == name
    assert consumes("sfs") >= {"snapshot", "quality"} and "load" not in consumes("sfs")
    assert consumes("load-aware") == {"load"}
    assert consumes("session-affinity") == {"load", "session_bindings"}
    assert consumes("laar") >= {"success"} and "quality" not in consumes("laar")
    assert "stats" in consumes("lps")
    assert consumes("cache-aware") == consumes("prefix-load") == {"load", "prefix_cache"}
    assert consumes("lora-affinity") == {"load", "lora_adapters"}
    assert consumes("sfs-deadline") == consumes("sfs")
    assert consumes("slo-headroom") == {"snapshot", "output_length"}


def test_parameters_are_typed_defaulted_and_checked():
    p = make_policy("sfs-soft", {"delta": "2e-6"})  # a command line's string is read
    assert p.delta == 2e-6 and p.lam == 5e-4
    assert make_policy("laar", {"alpha": 0.5}).alpha == 0.5
    assert make_policy("lps").estimator.k is None and make_policy("lps", {"k": 25}).estimator.k == 25
    with pytest.raises(PolicyError, match=r"policy\.delta: must be a number >= 0, got -1"):
        make_policy("sfs-soft", {"delta": -1})
    with pytest.raises(PolicyError, match=r"policy\.alpha: policy 'sfs' has no parameter"):
        make_policy("sfs", {"alpha": 0.5})
    with pytest.raises(PolicyError, match=r"policy\.seed: must be an integer, got 1\.5"):
        make_policy("round-robin", {"seed": 1.5})
    with pytest.raises(PolicyError, match=r"unknown policy 'fastest'; one of round-robin"):
        make_policy("fastest")
    # shared settings apply where declared and are ignored elsewhere
    assert make_policy("laar", defaults={"lambda": 0.0, "alpha": 0.3}).alpha == 0.3
    assert make_policy("sfs", defaults={"lambda": 0.0, "alpha": 0.3}).lam == 0.0


class _Cheapest(Policy):
    """A new policy, as a user would add one: the lowest prompt price; reads quality only to
    prove it was given."""

    name = "cheapest-test"
    summary = "the lowest prompt price"
    params = (SEED, Param("bias", "bias", float, 0.0, "added to every price", min=0.0))
    consumes = frozenset({QUALITY})

    def __init__(self, *, seed: int = 0, bias: float = 0.0) -> None:
        super().__init__(seed=seed)
        self.bias = bias
        self.seen: list[RoutingRequest] = []

    def choose(self, req: RoutingRequest, cands: list[Candidate], now: float) -> Decision:
        assert req.quality is not None and req.success is None
        self.seen.append(req)
        return Decision(int(np.argmin([c.price_prompt + self.bias for c in cands])))


@pytest.fixture
def cheapest(monkeypatch):
    monkeypatch.setattr(reg, "_REGISTRY", dict(reg._REGISTRY))
    reg.register(_Cheapest)
    return _Cheapest


def test_a_new_policy_is_one_class_and_one_registration(cheapest, capsys, tmp_path):
    assert "cheapest-test" in policy_names()
    assert make_policy("cheapest-test", {"bias": 1}).bias == 1.0
    # the command line knows it (choices, parameters, the listing)
    assert main(["policies"]) == 0 and "cheapest-test: the lowest prompt price" in (
        capsys.readouterr().out)
    assert main(["simulate", "--policy", "cheapest-test", "--policy-param", "bias=0.5",
                 "--rate", "5", "--requests", "40", "--out", str(tmp_path / "s")]) == 0
    assert main(["simulate", "--policy", "cheapest-test", "--policy-param", "gamma=1",
                 "--rate", "5", "--requests", "40", "--out", str(tmp_path / "s")]) == 2
    assert "has no parameter 'gamma'" in capsys.readouterr().err
    # so does the pool config
    pool = pool_from_dict({"policy": {"name": "cheapest-test", "bias": 2},
                           "instances": [{"name": "a", "model": "qwen3-8b",
                                          "url": "http://127.0.0.1:9", "profile": "qwen3-8b"}]})
    assert (pool.policy, pool.policy_params) == ("cheapest-test", {"bias": 2.0})
    assert Gateway(pool).policies.default.bias == 2.0


def test_the_simulator_gives_a_policy_what_it_declares(cheapest):
    prof = load_workload("paper")
    rs = sample_requests(prof, np.arange(30) * 0.5, np.random.default_rng(0))
    policy = make_policy("cheapest-test")
    ClusterSim(prof, policy, seed=0).run(rs)
    assert len(policy.seen) == 30  # (and each had quality, no success: asserted in choose)
    laar = make_policy("laar")
    seen = []
    orig = laar.choose

    def spy(req, cands, now):
        seen.append(req)
        return orig(req, cands, now)

    laar.choose = spy
    ClusterSim(prof, laar, seed=0).run(rs)
    assert all(r.quality is None and r.success is not None for r in seen)


def _pool(policy: str, source: str = "auto"):
    return pool_from_dict({"policy": policy, "state": {"source": source},
                           "instances": [{"name": "a", "model": "qwen3-8b",
                                          "url": "http://127.0.0.1:9", "profile": "qwen3-8b"}]})


@pytest.mark.parametrize(("policy", "source", "snapshots", "metrics"), [
    ("sfs", "auto", True, False),
    ("ttca", "auto", True, False),
    ("load-aware", "auto", False, True),
    ("round-robin", "auto", False, False),
    ("sfs", "shadow", False, False),
    ("round-robin", "metrics", False, True),
])
def test_the_gateway_polls_only_what_its_policy_consumes(policy, source, snapshots, metrics):
    pollers = Gateway(_pool(policy, source)).pollers
    assert (pollers.snapshots, pollers.metrics) == (snapshots, metrics)


def test_the_gateway_predicts_only_what_its_policy_consumes():
    import asyncio

    from duetime.gateway.intake.request import KeyCheck

    def predicted(policy: str) -> tuple:
        ctx = asyncio.run(Gateway(_pool(policy)).intake.take(
            b'{"messages": [{"role": "user", "content": "hi"}]}', {"headers": []},
            arrival=0.0, chat=True, keys=KeyCheck.NONE))
        return ctx.quality, ctx.success, ctx.lengths

    assert predicted("round-robin") == (None, None, None)
    q, s, n = predicted("sfs")
    assert q is not None and set(q) == {"qwen3-8b"} and s is None and n is None
    q, s, n = predicted("laar")
    assert q is None and s is not None and n is None
    assert s["qwen3-8b"] == pytest.approx(predicted("sfs")[0]["qwen3-8b"])  # (the table's
    # quality read as a probability)


def test_shared_session_bindings_are_given_to_the_policies_that_consume_them():
    """Session bindings are a declared input: a caller that provides a mapping (the gateway's
    replicas share one) gives it to a policy that consumes ``session_bindings``; otherwise
    the policy keeps its own."""
    shared: dict[str, str] = {}
    assert make_policy("session-affinity", bindings=shared).bindings is shared
    assert make_policy("session-affinity").bindings is not shared
    assert not hasattr(make_policy("load-aware", bindings=shared), "bindings")


def test_cli_policy_params_are_checked(capsys, tmp_path):
    assert main(["simulate", "--policy", "sfs-soft", "--policy-param", "delta=oops",
                 "--rate", "5", "--requests", "10", "--out", str(tmp_path)]) == 2
    assert "--policy-param delta: must be a number >= 0, got 'oops'" in capsys.readouterr().err
    assert main(["simulate", "--policy", "sfs", "--policy-param", "nonsense",
                 "--rate", "5", "--requests", "10", "--out", str(tmp_path)]) == 2
    assert "must be NAME=VALUE" in capsys.readouterr().err
    assert main(["simulate", "--policy", "lps", "--policy-param", "k=20", "--rate", "5",
                 "--requests", "30", "--out", str(tmp_path / "k")]) == 0
    assert "k" in (tmp_path / "k" / "results.csv").read_text().splitlines()[0].split(",")
