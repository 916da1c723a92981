"""The compiled tiers of a decision are the numpy expressions they replaced, ties included."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.policy.base import Candidate, Candidates, RoutingRequest, utility
from duetime.policy.tiers import least_and_ties, tier_runs, utility_tiers, warm_up_tiers


def numpy_tiers(u: np.ndarray) -> tuple[np.ndarray, list[int]]:
    order = np.argsort(-u, kind="stable")
    edges = np.flatnonzero(np.diff(u[order])).tolist()
    return order, [*(e + 1 for e in edges), len(order)]


@pytest.mark.parametrize("seed", range(40))
def test_tier_runs_are_the_stable_argsort_and_its_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 120))
    # few distinct values: long runs of equal utility, as replicas of a model give
    u = rng.choice(rng.normal(size=int(rng.integers(1, 6))), size=n)
    if seed % 5 == 0:
        u[rng.integers(0, n)] = -np.inf
    order, ends = tier_runs(u)
    want_order, want_ends = numpy_tiers(u)
    assert order.tolist() == want_order.tolist()
    assert ends.tolist() == want_ends


def test_one_candidate_is_one_tier() -> None:
    order, ends = tier_runs(np.array([0.3]))
    assert order.tolist() == [0] and ends.tolist() == [1]


@pytest.mark.parametrize("seed", range(40))
def test_least_and_ties_are_argmin_and_its_count(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.choice(rng.exponential(size=4), size=int(rng.integers(1, 40)))
    if seed % 4 == 0:
        x[:] = np.inf
    least, ties = least_and_ties(x)
    assert least == int(np.argmin(x))
    assert ties == int((x == x.min()).sum())


def test_a_nan_leaves_the_choice_to_numpy() -> None:
    assert least_and_ties(np.array([0.2, np.nan, 0.1]))[1] == 0


@pytest.mark.parametrize("seed", range(30))
def test_utility_tiers_are_the_policy_utility_and_its_tiers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 100))
    models = int(rng.integers(1, 5))
    which = rng.integers(0, models, size=n)  # replicas of a few models: equal utilities
    prices = rng.uniform(0.0, 2.0, size=(models, 2))[which]
    quality = rng.uniform(0.0, 1.0, size=models)[which]
    out = (rng.integers(1, 2000, size=models)[which] if seed % 2
           else rng.uniform(1.0, 2000.0, size=models)[which])
    prompt = int(rng.integers(1, 30000))
    lam = float(rng.choice([0.0, 5e-4, rng.uniform(0, 1e-2)]))
    u, order, ends = utility_tiers(quality, out, prices, prompt, lam)
    cands = [Candidate(str(k), "m", float(prices[k, 0]), float(prices[k, 1]), None)
             for k in range(n)]
    req = RoutingRequest("r", prompt, quality, out, 1.0)
    want = utility(req, Candidates(cands), lam)
    assert u.tobytes() == want.tobytes()  # the same floats, bit for bit
    want_order, want_ends = numpy_tiers(want)
    assert order.tolist() == want_order.tolist()
    assert ends.tolist() == want_ends


def test_the_warm_up_loads_what_the_routers_call() -> None:
    """A server's first request must not compile these: after the warm-up the kernels hold
    the signatures of the routers' calls (float quality with integer or float lengths, as the
    gateway and the simulator build them)."""
    warm_up_tiers()
    sigs = {tuple(str(t) for t in sig[:2]) for sig in utility_tiers.signatures}
    assert ("array(float64, 1d, C)", "array(int64, 1d, C)") in sigs
    assert ("array(float64, 1d, C)", "array(float64, 1d, C)") in sigs
    assert tier_runs.signatures and least_and_ties.signatures
