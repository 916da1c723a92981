"""The discrete-event cluster simulator: instances are compiled engines with a "true" timing.

Each instance runs the engine (``duetime.engine.Engine``) with its model's batch-time model
(the truth, optionally with multiplicative per-step noise) and the requests' *true* output
lengths. The router sees snapshots carrying *predicted* output lengths (true x U(1 - e, 1 + e)),
and predicted qualities (a per-task table, or the truth: an oracle). Requests arrive in time
order; before each routing decision every instance is stepped up to the arrival time; the
chosen instance queues the request at its next step boundary. At the end every instance runs
until idle, so no request is lost: each one has a first token and a finish.
"""

from __future__ import annotations

import time as wallclock
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from duetime.engine.compiled import Engine
from duetime.engine.snapshot import Snapshot
from duetime.engine.spec import InstanceSpec
from duetime.estimate.base import Estimator, InstanceStats
from duetime.policy.base import Candidate, Policy, RoutingRequest
from duetime.workload.profile import WorkloadProfile
from duetime.workload.requests import RequestSet

STATS_WINDOW = 256  # recent requests an instance's time-averaged stats look at

# Predicted output lengths for a request set: (requests, rng) -> (n, models) array.
LengthModel = Callable[[RequestSet, np.random.Generator], np.ndarray]


class SimInstance:
    """One simulated instance and the live view of it a router gets."""

    def __init__(self, name: str, spec: InstanceSpec, *, noise: float = 0.0) -> None:
        self.name = name
        self.spec = spec
        self.engine = Engine(spec.config, spec.batch_time, noise=noise)
        self.now = 0.0

    # InstanceView
    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    request_overhead_s = 0.0  # the simulator's requests reach the engine at once

    def snapshot(self) -> Snapshot:
        return self.engine.snapshot()

    @property
    def stats(self) -> InstanceStats:
        """Averages over the instance's last ``STATS_WINDOW`` requests, as seen at ``now``."""
        h = self.engine.history(last=STATS_WINDOW)
        if not len(h):
            return InstanceStats()
        arrival, first, fin = h.arrival, h.first_token, h.finish_time
        got_first = first <= self.now
        done = fin <= self.now
        return InstanceStats(
            elapsed_s=max(self.now - float(arrival[0]), 1e-9), arrivals=len(h),
            ttft_s_sum=float((first - arrival)[got_first].sum()),
            ttft_count=int(got_first.sum()),
            e2e_s_sum=float((fin - arrival)[done].sum()), e2e_count=int(done.sum()),
            prompt_tokens_sum=int(h.prompt.sum()), output_tokens_sum=int(h.output[done].sum()))


@dataclass(slots=True)
class SimResult:
    """Every request's fate (arrays aligned with ``requests``)."""

    requests: RequestSet
    instance_names: list[str]
    instance_models: list[int]        # model index of each instance
    instance: np.ndarray              # chosen instance per request
    first_token: np.ndarray           # absolute times
    finish: np.ndarray
    forecast: np.ndarray              # the policy's TTFT forecast (s), NaN if it made none
    shadow: dict[str, np.ndarray] = field(default_factory=dict)  # other estimators' forecasts
    overhead_s: np.ndarray | None = None  # routing wall time per decision
    lam: float = 5.0e-4
    prices: np.ndarray | None = None  # (models, 2): USD per Mtok, prompt and output
    wall_s: float = 0.0

    @property
    def model(self) -> np.ndarray:
        return np.asarray(self.instance_models)[self.instance]

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.requests.arrival

    @property
    def quality(self) -> np.ndarray:
        return self.requests.quality[np.arange(len(self.instance)), self.model]

    @property
    def output_tokens(self) -> np.ndarray:
        return self.requests.output[np.arange(len(self.instance)), self.model]

    @property
    def cost(self) -> np.ndarray:
        """Realised cost in micro-dollars."""
        p = self.prices[self.model]
        return p[:, 0] * self.requests.prompt + p[:, 1] * self.output_tokens

    @property
    def simulated_s(self) -> float:
        return float(np.nanmax(self.finish) - self.requests.arrival[0]) if len(self.finish) else 0.0


def _closed_loop_times(requests: RequestSet) -> RequestSet:
    return RequestSet(np.zeros(len(requests)), requests.task, requests.prompt, requests.output,
                      requests.quality, requests.target, requests.tasks, requests.models)


class ClusterSim:
    """Route a request set over a pool of simulated instances with one policy."""

    def __init__(self, profile: WorkloadProfile, policy: Policy, *,
                 instances: list[tuple[str, str]] | None = None, noise: float = 0.0,
                 length_error: float = 0.3, quality: str = "table", seed: int = 0,
                 charge_overhead: bool = False,
                 shadow_estimators: tuple[Estimator, ...] = (),
                 length_model: LengthModel | None = None) -> None:
        """``instances``: (instance name, model name) pairs; default one per model.
        ``quality``: ``table`` (per-task mean accuracy) or ``oracle`` (the truth).
        ``length_model``: predicted output lengths, (requests, rng) -> (n, models) array; by
        default the truth x U(1 - length_error, 1 + length_error)."""
        if quality not in ("table", "oracle"):
            raise ValueError(f"quality: 'table' or 'oracle', got {quality!r}")
        self.profile = profile
        self.policy = policy
        pairs = instances or [(m, m) for m in profile.model_names]
        for _, m in pairs:
            if m not in profile.models:
                raise ValueError(f"instance model {m!r} is not in the workload profile "
                                 f"({', '.join(profile.model_names)})")
        self.pairs = pairs
        self.noise = noise
        self.length_error = length_error
        self.quality = quality
        self.seed = seed
        self.charge_overhead = charge_overhead
        self.shadow_estimators = shadow_estimators
        self.length_model = length_model

    def run(self, requests: RequestSet, *, closed_loop: int | None = None) -> SimResult:
        """Route ``requests`` in arrival order (open loop), or with ``closed_loop`` = N
        clients that each send their next request when the previous one finishes (the
        requests' own arrival times are then ignored and replaced)."""
        t_wall = wallclock.perf_counter()
        prof = self.profile
        rng = np.random.default_rng(self.seed + 1)
        models = prof.model_names
        if requests.models != models:
            raise ValueError("the request set was drawn for other models than the profile's")
        from duetime.engine import kernel
        kernel.seed(self.seed)
        insts = [SimInstance(name, prof.models[m], noise=self.noise) for name, m in self.pairs]
        inst_model = [models.index(m) for _, m in self.pairs]
        n = len(requests)
        if self.length_model is None:
            e = self.length_error
            pred_out = requests.output * rng.uniform(1 - e, 1 + e, requests.output.shape)
        else:
            pred_out = np.asarray(self.length_model(requests, rng), dtype=float)
            if pred_out.shape != requests.output.shape:
                raise ValueError(f"length_model returned shape {pred_out.shape}, expected "
                                 f"{requests.output.shape}")
        pred_out = np.maximum(1, np.rint(pred_out)).astype(np.int64)
        if self.quality == "oracle":
            pred_q = requests.quality
        else:
            table = np.array([[prof.tasks[t].accuracy[m] for m in models]
                              for t in requests.tasks])
            pred_q = table[requests.task]
        cands = [Candidate(i.name, models[mi], i.spec.price_prompt, i.spec.price_output, i)
                 for i, mi in zip(insts, inst_model, strict=True)]
        cand_model = np.array(inst_model)
        chosen = np.zeros(n, dtype=np.int64)
        forecast = np.full(n, np.nan)
        shadow = {est.name: np.full(n, np.nan) for est in self.shadow_estimators}
        overhead = np.zeros(n)

        def dispatch(i: int, t: float) -> None:
            """Route request ``i`` arriving at ``t`` (every instance is at or past ``t``)."""
            for inst in insts:
                inst.now = t
            req = RoutingRequest(str(i), int(requests.prompt[i]), pred_q[i, cand_model],
                                 pred_out[i, cand_model], float(requests.target[i]),
                                 requests.tasks[requests.task[i]])
            t0 = wallclock.perf_counter()
            d = self.policy.choose(req, cands, t)
            overhead[i] = wallclock.perf_counter() - t0
            inst = insts[d.index]
            for est in self.shadow_estimators:
                shadow[est.name][i] = est.ttft(inst, req.prompt_tokens, t)
            if self.charge_overhead:  # the request reaches the instance after the decision
                inst.engine.run_until(t + overhead[i])
            mi = inst_model[d.index]
            inst.engine.add(str(i), int(requests.prompt[i]), int(requests.output[i, mi]),
                            predicted_output_tokens=int(pred_out[i, mi]), arrival=t)
            chosen[i] = d.index
            if d.forecast is not None:
                forecast[i] = d.forecast

        if closed_loop is None:
            for i in range(n):
                t = float(requests.arrival[i])
                for inst in insts:
                    inst.engine.run_until(t)
                dispatch(i, t)
        else:
            requests = self._closed_loop(requests, insts, closed_loop, dispatch)
        first = np.full(n, np.nan)
        fin = np.full(n, np.nan)
        for k, inst in enumerate(insts):
            inst.engine.drain()
            mine = np.flatnonzero(chosen == k)
            done = inst.engine.lookup([str(i) for i in mine.tolist()])
            first[mine] = done.first_token
            fin[mine] = done.finish_time
        prices = np.array([[prof.models[m].price_prompt, prof.models[m].price_output]
                           for m in models])
        return SimResult(requests, [name for name, _ in self.pairs], inst_model, chosen, first,
                         fin, forecast, shadow, overhead, prof.lam, prices,
                         wallclock.perf_counter() - t_wall)

    @staticmethod
    def _closed_loop(requests: RequestSet, insts: list[SimInstance], clients: int,
                     dispatch) -> RequestSet:
        """Event loop for N clients: the busy instance with the earliest clock steps next; a
        request that finishes at ``t`` makes its client send the next one at ``t``, routed
        once every busy instance has reached ``t``."""
        if clients < 1:
            raise ValueError(f"closed_loop: needs >= 1 client, got {clients}")
        out = _closed_loop_times(requests)
        n = len(requests)
        pending = [0.0] * min(clients, n)  # send times, sorted
        nxt = 0
        while pending or any(not inst.engine.idle for inst in insts):
            busy = [inst for inst in insts if not inst.engine.idle]
            horizon = min((inst.engine.time for inst in busy), default=float("inf"))
            if pending and pending[0] <= horizon:
                t = pending.pop(0)
                for inst in insts:
                    if inst.engine.idle:
                        inst.engine.advance_clock(t)
                out.arrival[nxt] = t
                dispatch(nxt, t)
                nxt += 1
                continue
            step = min(busy, key=lambda inst: inst.engine.time).engine.step()
            for _ in (step.finished if step else ()):
                if nxt + len(pending) < n:
                    pending.append(step.end)
            pending.sort()
        return out
