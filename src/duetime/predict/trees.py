"""LightGBM models evaluated by a compiled loop over their trees, read from LightGBM's own
text model files.

Why not ``Booster.predict``: it costs ~60 us per call even for 3 rows (ctypes and input
checks), and a request needs four heads (quality, length mean, median, p90): ~240 us, over the
whole prediction budget. The trees themselves are tiny; walking them in a numba loop for 3
models x 4 heads takes a few microseconds. ``tests/test_predict_trees.py`` checks the results
against ``Booster.predict`` on many rows.

Only what training here produces is supported: numerical splits, one output per iteration, no
linear trees. Anything else is refused with an error naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duetime.engine._jit import njit

_CATEGORICAL = 1
_DEFAULT_LEFT = 2
_ZERO_THRESHOLD = 1e-35


class TreeFormatError(ValueError):
    """A model file that is not a LightGBM text model this reader supports."""


@dataclass(frozen=True)
class Forest:
    """Several LightGBM models (heads) as flat arrays; head ``h`` is trees
    ``head_start[h]:head_start[h+1]``. A child < 0 is leaf ``~child`` of its tree."""

    n_features: int
    head_start: np.ndarray  # int64[n_heads + 1]
    node_start: np.ndarray  # int64[n_trees + 1]
    leaf_start: np.ndarray  # int64[n_trees + 1]
    feature: np.ndarray     # int64[n_nodes]
    threshold: np.ndarray   # float64[n_nodes]
    decision: np.ndarray    # int64[n_nodes]
    left: np.ndarray        # int64[n_nodes]
    right: np.ndarray       # int64[n_nodes]
    leaf_value: np.ndarray  # float64[n_leaves]

    @property
    def n_heads(self) -> int:
        return len(self.head_start) - 1

    @property
    def n_trees(self) -> int:
        return len(self.node_start) - 1


@dataclass
class _Tree:
    feature: list[int]
    threshold: list[float]
    decision: list[int]
    left: list[int]
    right: list[int]
    leaf_value: list[float]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split()] if s.strip() else []


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split()] if s.strip() else []


def parse_model_text(text: str, name: str) -> tuple[int, list[_Tree]]:
    """(number of features, trees) of a LightGBM text model. ``name`` goes in errors."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "tree":
        raise TreeFormatError(f"{name}: not a LightGBM text model (no 'tree' header)")
    header: dict[str, str] = {}
    i = 1
    while i < len(lines) and not lines[i].startswith("Tree="):
        if lines[i].startswith("end of trees"):
            break
        k, _, v = lines[i].partition("=")
        header[k.strip()] = v.strip()
        i += 1
    for key, want in (("num_class", "1"), ("num_tree_per_iteration", "1")):
        if header.get(key, want) != want:
            raise TreeFormatError(f"{name}: {key}={header[key]} is not supported (one output "
                                  "per iteration only)")
    if "max_feature_idx" not in header:
        raise TreeFormatError(f"{name}: not a LightGBM text model (no max_feature_idx)")
    n_features = int(header["max_feature_idx"]) + 1
    trees: list[_Tree] = []
    seen_end = False
    while i < len(lines):
        line = lines[i]
        if line.startswith("end of trees"):
            seen_end = True
            break
        if not line.startswith("Tree="):
            i += 1
            continue
        fields: dict[str, str] = {}
        i += 1
        while i < len(lines) and lines[i].strip():
            k, _, v = lines[i].partition("=")
            fields[k] = v
            i += 1
        try:
            trees.append(_tree(fields, name, len(trees), n_features))
        except TreeFormatError:
            raise
        except KeyError as e:
            raise TreeFormatError(f"{name}: tree {len(trees)}: no {e.args[0]} (a truncated "
                                  "file?)") from None
        except ValueError as e:
            raise TreeFormatError(f"{name}: tree {len(trees)}: malformed ({e})") from None
    if not seen_end:
        raise TreeFormatError(f"{name}: truncated LightGBM model (no 'end of trees')")
    if not trees:
        raise TreeFormatError(f"{name}: the model has no trees")
    return n_features, trees


def _tree(f: dict[str, str], name: str, index: int, n_features: int) -> _Tree:
    num_leaves = int(f["num_leaves"])
    if int(f.get("num_cat", "0")) != 0:
        raise TreeFormatError(f"{name}: tree {index}: categorical splits are not supported")
    if int(f.get("is_linear", "0")) != 0:
        raise TreeFormatError(f"{name}: tree {index}: linear trees are not supported")
    leaf_value = _floats(f["leaf_value"])
    if len(leaf_value) != num_leaves:
        raise TreeFormatError(f"{name}: tree {index}: {len(leaf_value)} leaf values for "
                              f"{num_leaves} leaves")
    if num_leaves == 1:
        return _Tree([], [], [], [], [], leaf_value)
    t = _Tree(_ints(f["split_feature"]), _floats(f["threshold"]), _ints(f["decision_type"]),
              _ints(f["left_child"]), _ints(f["right_child"]), leaf_value)
    n_nodes = num_leaves - 1
    for key, field in (("feature", "split_feature"), ("threshold", "threshold"),
                       ("decision", "decision_type"), ("left", "left_child"),
                       ("right", "right_child")):
        if len(getattr(t, key)) != n_nodes:
            raise TreeFormatError(f"{name}: tree {index}: {field} has {len(getattr(t, key))} "
                                  f"entries for {n_nodes} splits")
    if any(d & _CATEGORICAL for d in t.decision):
        raise TreeFormatError(f"{name}: tree {index}: categorical splits are not supported")
    if any(not 0 <= v < n_features for v in t.feature):
        raise TreeFormatError(f"{name}: tree {index}: split_feature out of range (the model "
                              f"reads {n_features} features)")
    for c in t.left + t.right:
        if not (-num_leaves <= c < n_nodes):
            raise TreeFormatError(f"{name}: tree {index}: child index {c} out of range")
    return t


def build_forest(models: list[tuple[int, list[_Tree]]]) -> Forest:
    """Concatenate parsed models (heads) that share one feature layout (none: an empty
    forest with no heads)."""
    n_features = {n for n, _ in models} or {0}
    if len(n_features) != 1:
        raise TreeFormatError(f"heads disagree on the number of features: {sorted(n_features)}")
    head_start, node_start, leaf_start = [0], [0], [0]
    cols: dict[str, list] = {k: [] for k in
                             ("feature", "threshold", "decision", "left", "right", "leaf")}
    for _, trees in models:
        for t in trees:
            cols["feature"] += t.feature
            cols["threshold"] += t.threshold
            cols["decision"] += t.decision
            cols["left"] += t.left
            cols["right"] += t.right
            cols["leaf"] += t.leaf_value
            node_start.append(node_start[-1] + len(t.feature))
            leaf_start.append(leaf_start[-1] + len(t.leaf_value))
        head_start.append(head_start[-1] + len(trees))
    return Forest(
        n_features=n_features.pop(), head_start=np.array(head_start, dtype=np.int64),
        node_start=np.array(node_start, dtype=np.int64),
        leaf_start=np.array(leaf_start, dtype=np.int64),
        feature=np.array(cols["feature"], dtype=np.int64),
        threshold=np.array(cols["threshold"], dtype=np.float64),
        decision=np.array(cols["decision"], dtype=np.int64),
        left=np.array(cols["left"], dtype=np.int64),
        right=np.array(cols["right"], dtype=np.int64),
        leaf_value=np.array(cols["leaf"], dtype=np.float64))


@njit(cache=True, nogil=True)
def eval_forest(x: np.ndarray, n_base: int, models: np.ndarray, head_start: np.ndarray,
                node_start: np.ndarray, leaf_start: np.ndarray, feature: np.ndarray,
                threshold: np.ndarray, decision: np.ndarray, left: np.ndarray,
                right: np.ndarray, leaf_value: np.ndarray, out: np.ndarray) -> None:
    """out[h, j] = sum of head h's trees on row (x, model one-hot of models[j]).

    Features >= n_base are the model indicators: 1.0 for ``n_base + models[j]``, else 0.0.
    The split rule is LightGBM's numerical decision (missing values by decision type)."""
    n_heads = head_start.shape[0] - 1
    for j in range(models.shape[0]):
        m = models[j]
        for h in range(n_heads):
            total = 0.0
            for t in range(head_start[h], head_start[h + 1]):
                n0 = node_start[t]
                if node_start[t + 1] == n0:  # a single-leaf tree
                    total += leaf_value[leaf_start[t]]
                    continue
                node = 0
                while node >= 0:
                    k = n0 + node
                    f = feature[k]
                    v = x[f] if f < n_base else (1.0 if f - n_base == m else 0.0)
                    d = decision[k]
                    missing = (d >> 2) & 3
                    if v != v and missing != 2:
                        v = 0.0
                    if (missing == 1 and -_ZERO_THRESHOLD <= v <= _ZERO_THRESHOLD) or \
                            (missing == 2 and v != v):
                        node = left[k] if d & _DEFAULT_LEFT else right[k]
                    elif v <= threshold[k]:
                        node = left[k]
                    else:
                        node = right[k]
                total += leaf_value[leaf_start[t] + ~node]
            out[h, j] = total


def predict_forest(forest: Forest, x: np.ndarray, n_base: int, models: np.ndarray) -> np.ndarray:
    """float64[n_heads, len(models)]: each head's raw output for the row ``x`` (the
    model-independent features) with each model's indicator set."""
    out = np.empty((forest.n_heads, len(models)))
    eval_forest(x, n_base, models, forest.head_start, forest.node_start, forest.leaf_start,
                forest.feature, forest.threshold, forest.decision, forest.left, forest.right,
                forest.leaf_value, out)
    return out
