"""The compiled tiers of a decision are the numpy expressions they replaced, ties included."""

from __future__ import annotations

import numpy as np
import pytest

from duetime.policy.tiers import least_and_ties, tier_runs, warm_up_tiers


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


def test_the_warm_up_loads_what_the_routers_call() -> None:
    """A server's first request must not compile these: after the warm-up the kernels hold
    the signatures of the routers' calls (float utilities and estimates)."""
    warm_up_tiers()
    for kernel in (tier_runs, least_and_ties):
        assert [str(t) for t in kernel.signatures[0]] == ["array(float64, 1d, C)"]
