"""The compiled tree walk gives LightGBM's own predictions, read from its text model files."""

from __future__ import annotations

import re

import lightgbm as lgb
import numpy as np
import pytest

from duetime.predict.trees import TreeFormatError, build_forest, parse_model_text, predict_forest

N_BASE, N_MODELS = 6, 3


def _data(rng, n, nan_share=0.0, zero_share=0.0):
    """Rows of N_BASE features + a one-hot model block, as the predictor lays them out."""
    base = rng.normal(size=(n, N_BASE))
    if nan_share:
        base[rng.random((n, N_BASE)) < nan_share] = np.nan
    if zero_share:
        base[rng.random((n, N_BASE)) < zero_share] = 0.0
    model = rng.integers(0, N_MODELS, n)
    onehot = np.eye(N_MODELS)[model]
    y = np.nan_to_num(base[:, 0]) * (1 + model) + np.sin(np.nan_to_num(base[:, 1])) + model
    return np.hstack([base, onehot]), y


def _train(x, y, **params):
    p = {"objective": "regression", "num_leaves": 15, "max_depth": 6, "learning_rate": 0.1,
         "verbose": -1, "deterministic": True, "num_threads": 1, **params}
    return lgb.train(p, lgb.Dataset(x, y), num_boost_round=60)


@pytest.mark.parametrize("params", [
    {},
    {"objective": "quantile", "alpha": 0.9},
    {"use_missing": True},
    {"zero_as_missing": True},
], ids=["l2", "quantile", "nan-missing", "zero-missing"])
def test_forest_matches_booster_predict(params):
    rng = np.random.default_rng(0)
    nan_share = 0.1 if "use_missing" in params else 0.0
    zero_share = 0.2 if "zero_as_missing" in params else 0.0
    x, y = _data(rng, 2000, nan_share, zero_share)
    booster = _train(x, y, **params)
    forest = build_forest([parse_model_text(booster.model_to_string(), "m.txt")])
    xt, _ = _data(np.random.default_rng(1), 300, nan_share, zero_share)
    models = np.arange(N_MODELS, dtype=np.int64)
    for row in xt:
        got = predict_forest(forest, row[:N_BASE].copy(), N_BASE, models)[0]
        rows = np.repeat(row[None, :], N_MODELS, axis=0)
        rows[:, N_BASE:] = np.eye(N_MODELS)
        np.testing.assert_allclose(got, booster.predict(rows), rtol=1e-12, atol=1e-12)


def test_several_heads_in_one_forest():
    rng = np.random.default_rng(2)
    x, y = _data(rng, 1000)
    a, b = _train(x, y), _train(x, -2 * y, objective="quantile", alpha=0.5)
    forest = build_forest([parse_model_text(m.model_to_string(), "m") for m in (a, b)])
    assert forest.n_heads == 2
    models = np.array([2, 0, 2], dtype=np.int64)  # any order, repeats allowed
    row = x[5, :N_BASE].copy()
    got = predict_forest(forest, row, N_BASE, models)
    full = np.repeat(x[5:6], 3, axis=0)
    full[:, N_BASE:] = np.eye(N_MODELS)[models]
    np.testing.assert_allclose(got[0], a.predict(full), atol=1e-12)
    np.testing.assert_allclose(got[1], b.predict(full), atol=1e-12)


def test_single_leaf_trees():
    x = np.zeros((50, N_BASE + N_MODELS))
    booster = lgb.train({"objective": "regression", "verbose": -1}, lgb.Dataset(x, np.full(50, 3.0)),
                        num_boost_round=3)
    forest = build_forest([parse_model_text(booster.model_to_string(), "m")])
    got = predict_forest(forest, np.zeros(N_BASE), N_BASE, np.array([0], dtype=np.int64))
    np.testing.assert_allclose(got[0], booster.predict(x[:1]))


def _model_text():
    x, y = _data(np.random.default_rng(3), 200)
    return _train(x, y).model_to_string()


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda t: "", "not a LightGBM text model"),
    (lambda t: "hello\nworld\n", "not a LightGBM text model"),
    (lambda t: t[: t.index("end of trees")], "truncated"),
    (lambda t: t.replace("num_class=1", "num_class=3"), "num_class=3 is not supported"),
    (lambda t: t.replace("num_cat=0", "num_cat=1", 1), "categorical splits"),
    (lambda t: t.replace("is_linear=0", "is_linear=1", 1), "linear trees"),
    (lambda t: t.replace("leaf_value=", "leaf_value=1 ", 1), "leaf values"),
    (lambda t: t.replace("split_feature=", "split_feature=99 ", 1), "split_feature has"),
    (lambda t: re.sub(r"split_feature=\d+", "split_feature=99", t, count=1),
     "split_feature out of range"),
    (lambda t: t.replace("left_child=", "left_child=x", 1), "malformed"),
])
def test_bad_model_files_are_refused_with_their_name(mutate, message):
    with pytest.raises(TreeFormatError, match=message) as e:
        parse_model_text(mutate(_model_text()), "DIR/quality.txt")
    assert str(e.value).startswith("DIR/quality.txt:")
