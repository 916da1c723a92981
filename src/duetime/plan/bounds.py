"""What a pool can do at best, from the profiles alone (no simulation): bounds that prune a
capacity plan's search.

Three bounds hold for any router on the same request stream:

- **idle attainment**: a request's TTFT is at least its prompt's prefill on an idle instance,
  so a class's on-time rate is at most the share of its requests that some deployment of the
  pool meets idle;
- **quality**: the mean quality is at most the mean, over requests, of the best answer among
  the pool's models;
- **saturation**: the pool must carry the rate without saturating a deployment. Each
  request needs at least its own terms of the batch-time model on the deployment it goes to
  (a step's time is a fixed cost plus a sum over its requests) plus a share of the steps'
  fixed cost; each replica supplies one engine-second a second. Whether some split of the
  classes over the deployments fits — with the mean quality at least its floor — is a linear
  program: Mélange's (capacities per request class and GPU, solved for the cheapest mix),
  here relaxed to a feasibility test of a given pool, with capacities from the profiles.
  (Its quality term is each class's mean per model: the router knows a task's accuracy, not a
  request's.)

None needs a simulation; none assumes a router. The search is tested against exhaustive
enumeration, which uses none of them.
"""

from __future__ import annotations

import numpy as np

from duetime.engine.batch_time import BatchTimeModel
from duetime.engine.config import SchedulerConfig
from duetime.workload import RequestSet


def idle_ttft(model: BatchTimeModel, config: SchedulerConfig, prompt: np.ndarray) -> np.ndarray:
    """Seconds to each prompt's first token on an idle engine: its prefill in chunks of the
    step's token budget (the first token comes with the last chunk's step)."""
    w = np.asarray(model.weights, dtype=float)  # type: ignore[attr-defined]
    budget = config.max_num_batched_tokens
    p = np.asarray(prompt, dtype=float)
    total = np.zeros_like(p)
    done = np.zeros_like(p)
    while True:
        left = p - done
        live = left > 0
        if not live.any():
            return total
        c = np.where(live, np.minimum(left, budget), 0.0)
        length = done + c
        step = (w[0] + w[2] * c + w[3] * c * c + w[4] * (c * done + c * (c + 1) / 2)
                + w[6] * length + w[7] * length * length)
        total += np.where(live, step, 0.0)
        done += c


def on_time_idle(model: BatchTimeModel, config: SchedulerConfig,
                 requests: RequestSet) -> np.ndarray:
    """Per request: whether an idle instance of this engine meets its TTFT target."""
    return idle_ttft(model, config, requests.prompt) <= requests.target


def class_attainment_bound(meets_idle: np.ndarray, task: np.ndarray,
                           n_classes: int) -> np.ndarray:
    """Per class, the share of its requests that some deployment (rows of ``meets_idle``, one
    per deployment in the pool) meets idle: an upper bound on its on-time rate."""
    any_ok = meets_idle.any(axis=0).astype(float)
    hits = np.bincount(task, weights=any_ok, minlength=n_classes)
    counts = np.bincount(task, minlength=n_classes)
    return np.divide(hits, counts, out=np.ones(n_classes), where=counts > 0)


def quality_bound(quality: np.ndarray, model_columns: list[int]) -> float:
    """The mean over requests of the best realised quality among these models' columns."""
    if not model_columns:
        return 0.0
    return float(quality[:, model_columns].max(axis=1).mean())


def work_seconds(model: BatchTimeModel, config: SchedulerConfig, prompt: np.ndarray,
                 output: np.ndarray) -> np.ndarray:
    """Per request, a lower bound on the engine time it takes on a saturated instance: its
    prefill's and decode tokens' own terms of the batch-time model (a step's time is its fixed
    cost plus a sum over the requests in it), plus its share of the steps' fixed cost with
    ``max_num_seqs`` requests in every decode step."""
    w = np.asarray(model.weights, dtype=float)  # type: ignore[attr-defined]
    p = np.asarray(prompt, dtype=float)
    chunks = np.ceil(p / config.max_num_batched_tokens)
    prefill = idle_ttft(model, config, prompt) - w[0] * chunks
    d = np.maximum(np.asarray(output, dtype=float) - 1, 0)  # decode steps after the first token
    # lengths after each decode step: p + 1 .. p + d
    s1 = d * p + d * (d + 1) / 2
    s2 = d * p * p + p * d * (d + 1) + d * (d + 1) * (2 * d + 1) / 6
    decode = w[1] * d + w[5] * (s1 - d) + w[6] * s1 + w[7] * s2  # dec_ctx: before the token
    return prefill + decode + w[0] * (d / config.max_num_seqs
                                      + p / config.max_num_batched_tokens)


def feasible_split(rate: np.ndarray, work: np.ndarray, replicas: np.ndarray,
                   quality: np.ndarray | None = None, floor: float | None = None) -> bool:
    """Mélange's program as a feasibility test: can the classes' traffic (``rate[c]``
    requests/s) be split over the pool's deployments (``work[c, o]`` engine-seconds a
    request, ``replicas[o]`` engine-seconds a second each) without any saturating, with a
    mean quality (``quality[c, o]``, weighted by rate) of at least ``floor``? A relaxation:
    fractional splits, no latency; so False proves no router can do it."""
    from scipy.optimize import linprog

    n_c, n_o = work.shape
    a_eq = np.zeros((n_c, n_c * n_o))
    for c in range(n_c):
        a_eq[c, c * n_o:(c + 1) * n_o] = 1.0
    a_ub = np.zeros((n_o, n_c * n_o))
    for o in range(n_o):
        a_ub[o, o::n_o] = rate * work[:, o]
    b_ub = np.asarray(replicas, dtype=float)
    if quality is not None and floor is not None:
        a_ub = np.vstack([a_ub, -(rate[:, None] * quality).ravel() / rate.sum()])
        b_ub = np.append(b_ub, -floor)
    res = linprog(np.zeros(n_c * n_o), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(n_c),
                  bounds=(0, 1), method="highs")
    return res.status == 0
