"""The discrete-event cluster simulator: instances are compiled engines with a "true" timing.

Each instance runs the engine (``duetime.engine.Engine``) with its model's batch-time model
(the truth, optionally with multiplicative per-step noise) and the requests' *true* output
lengths. The router sees snapshots carrying *predicted* output lengths (true x U(1 - e, 1 + e)),
and predicted qualities from a :class:`~duetime.predict.QualitySource` (a per-task table, or
the truth: an oracle), filled in as the policy declares it consumes them. Requests arrive in
time order (open loop) or from N clients (closed loop, :mod:`duetime.sim.loop`); before each
routing decision every instance is stepped up to the arrival time; the chosen instance queues
the request at its next step boundary. At the end every instance runs until idle, so no
request is lost: each one has a first token and a finish.

Prefix caching (``prefix_caching``, or the instance specs' own configs): when the request set
describes its prompts by segments (:mod:`duetime.workload.prefix`), each request is added to its
instance with the block hashes of its prompt and answer, so that later requests sharing a prefix
hit the instance's cache; the router is given the prompt's hashes (``RoutingRequest.
prompt_hashes``) and each instance's cache as a precise or an estimated index
(:mod:`duetime.sim.cache_view`). The result counts the cache's hits as vLLM does.
"""

from __future__ import annotations

import math
import time as wallclock
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from duetime.engine.batch_stepper import BatchStepper, warm_up_stepper
from duetime.engine.spec import InstanceSpec
from duetime.engine.wait_estimate import LoadBoard
from duetime.engine.warmup import warm_up
from duetime.estimate.base import Estimator, lora_kw
from duetime.policy.base import Candidate, Candidates, Policy, RoutingRequest
from duetime.policy.registry import INSTANCE_INPUTS, QUALITY, SUCCESS
from duetime.policy.tiers import warm_up_tiers
from duetime.predict.quality_source import Oracle, QualitySource, QueryTable, TaskTable
from duetime.sim.admission import SimAdmission
from duetime.sim.cache_view import check_cache_view, engine_hashes, keys_by_block_size
from duetime.sim.fleet import RouterFleet
from duetime.sim.instance import SimClock, SimInstance
from duetime.sim.loop import run_clients
from duetime.sim.scaling import Scaling, ScalingPool, ScalingRecord
from duetime.workload.profile import WorkloadProfile
from duetime.workload.requests import RequestSet

# Predicted output lengths for a request set: (requests, rng) -> (n, models) array.
LengthModel = Callable[[RequestSet, np.random.Generator], np.ndarray]


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
    # prefix caching, per instance (None when no instance caches): tokens of the requests
    # admitted after a cache lookup, and of those the tokens found cached (vLLM's
    # prefix_cache_queries / prefix_cache_hits counters)
    prefix_queries: np.ndarray | None = None
    prefix_hits: np.ndarray | None = None
    scaling: ScalingRecord | None = None  # a scaling pool's replicas and changes
    queue_s: np.ndarray | None = None  # time each request waited in the admission queue

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
    def cache_hit_rate(self) -> float | None:
        """Prefix-cache hit rate over the pool: cached prompt tokens / prompt tokens looked up
        (Σ hits / Σ queries over the instances, as vLLM's ``prefix_cache_hits`` /
        ``prefix_cache_queries``; 0 with no lookup); ``None`` when no instance caches."""
        if self.prefix_queries is None or self.prefix_hits is None:
            return None
        q = int(self.prefix_queries.sum())
        return float(self.prefix_hits.sum()) / q if q else 0.0

    @property
    def instance_cache_hit_rate(self) -> np.ndarray | None:
        """The hit rate per instance (NaN where an instance looked nothing up, e.g. without
        caching); ``None`` when no instance caches."""
        if self.prefix_queries is None or self.prefix_hits is None:
            return None
        q = self.prefix_queries.astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(q > 0, self.prefix_hits / q, np.nan)

    @property
    def simulated_s(self) -> float:
        return float(np.nanmax(self.finish) - self.requests.arrival[0]) if len(self.finish) else 0.0


def _board(insts: list[SimInstance]) -> None:
    """The instances' wait summaries kept on one (new) board, a row each."""
    board = LoadBoard(len(insts))
    for k, inst in enumerate(insts):
        inst.join_board(board, k)


def _due(busy_until: np.ndarray, t: float) -> np.ndarray:
    """The engines with a step to start before ``t`` (their clock while busy is before it)."""
    return np.flatnonzero(busy_until < t)


# pools of this many instances or more step their engines in batches (below it an arrival
# finds a couple of engines with steps due, and a batch's typed list costs ~0.6 s to compile
# per process)
BATCH_AT = 16


def _closed_loop_times(requests: RequestSet) -> RequestSet:
    return RequestSet(np.zeros(len(requests)), requests.task, requests.prompt, requests.output,
                      requests.quality, requests.target, requests.tasks, requests.models,
                      requests.segments, requests.session, requests.answer_segment,
                      requests.adapter, requests.deadline, requests.tpot, requests.tenant)


class ClusterSim:
    """Route a request set over a pool of simulated instances with one policy."""

    def __init__(self, profile: WorkloadProfile, policy: Policy, *,
                 instances: list[tuple[str, str]] | None = None, noise: float = 0.0,
                 length_error: float = 0.3, quality: str | QualitySource = "table",
                 seed: int = 0,
                 charge_overhead: bool = False,
                 shadow_estimators: tuple[Estimator, ...] = (),
                 length_model: LengthModel | None = None,
                 length_p90_model: LengthModel | None = None,
                 prefix_caching: bool | None = None, cache_view: str = "precise",
                 step_scale: float = 1.0,
                 instance_specs: Mapping[str, InstanceSpec] | None = None,
                 scaling: Scaling | None = None,
                 admission: SimAdmission | None = None) -> None:
        """``instances``: (instance name, model name) pairs; default the profile's
        (:meth:`~duetime.workload.profile.WorkloadProfile.instance_pairs`: one per model, or
        its ``replicas``; several pairs may name one model).
        ``instance_specs``: instance name -> the engine it runs, where it is not its model's
        (replicas of one model on other hardware: a capacity plan's pool); the model's prices
        stay the profile's (they price tokens, not GPUs).
        ``quality``: ``table`` (per-task mean accuracy), ``oracle`` (the truth), or any
        :class:`~duetime.predict.QualitySource` (asked with each request's task and id).
        ``length_model``: predicted output lengths, (requests, rng) -> (n, models) array; by
        default the truth x U(1 - length_error, 1 + length_error).
        ``length_p90_model``: the predicted 90th percentiles of those lengths, the same way
        (given to the router as ``RoutingRequest.output_p90``; None: no spread is predicted).
        A request set with ``deadline`` / ``tpot`` columns gives each request's to the router
        (``RoutingRequest.deadline``, ``tpot_target``).
        ``prefix_caching``: True / False turns the engines' automatic prefix caching on / off
        on every instance; ``None`` keeps what each model's config says.
        ``cache_view``: what the router knows of a caching instance's cache, ``precise`` (the
        instance's own) or ``estimated`` (learnt from its own routing decisions).
        ``step_scale``: every instance's steps take this many times what its calibration
        says (a server slower or faster than its profile); the routers price steps with the
        calibration, so it needs routers with views of their own (a
        :class:`~duetime.sim.fleet.RouterFleet`: a router reading the true state would read
        the true step times), which may learn the pace (``FleetSpec.step_correction``).
        ``scaling``: the pool changes as an autoscaler decides (:mod:`duetime.sim.scaling`;
        ``instances`` is the pool at the start; a new replica of a model runs the spec of the
        model's first instance); open loop, one router.
        ``admission``: the gateway's admission queue (:class:`~duetime.sim.admission.
        SimAdmission`, the gateway's order): a request whose best forecast misses its TTFT
        target waits there (as a ``critical`` one does in the gateway), released one at a
        time by each first token and each request's end and decided again, or sent to the
        best forecast when its target is spent (or the queue turns it away); the requests'
        ``tenant`` column names their keys. Open loop, one router, no scaling; the instances
        are stepped one step at a time (:func:`~duetime.sim.loop.run_clients`)."""
        if not math.isfinite(step_scale) or step_scale <= 0:
            raise ValueError(f"step_scale must be a positive number, got {step_scale!r}")
        if step_scale != 1.0 and not isinstance(policy, RouterFleet):
            raise ValueError("step_scale needs routers with views of their own (a RouterFleet"
                             ", --routers N): a router reading the true state reads the true "
                             "step times")
        if admission is not None and (scaling is not None or isinstance(policy, RouterFleet)):
            raise ValueError("admission: one router over a fixed pool")
        if scaling is not None and isinstance(policy, RouterFleet):
            raise ValueError("scaling: one router (a RouterFleet's views are fixed at the start)")
        if not isinstance(quality, QualitySource) and quality not in ("table", "oracle"):
            raise ValueError(f"quality: 'table', 'oracle' or a QualitySource, got {quality!r}")
        if prefix_caching is not None and not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching: True, False or None, got {prefix_caching!r}")
        check_cache_view(cache_view)
        self.profile = profile
        self.policy = policy
        pairs = instances or profile.instance_pairs()
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
        self.length_p90_model = length_p90_model
        self.prefix_caching = prefix_caching
        self.cache_view = cache_view
        self.step_scale = float(step_scale)
        self.instance_specs = dict(instance_specs or {})
        self.scaling = scaling
        self.admission = admission
        unknown = set(self.instance_specs) - {name for name, _ in pairs}
        if unknown:
            raise ValueError(f"instance_specs: no such instance(s) {sorted(unknown)}")

    def spec(self, model: str, instance: str | None = None) -> InstanceSpec:
        """The spec an instance of ``model`` runs (its own where ``instance_specs`` has one,
        else its profile's; with ``prefix_caching``)."""
        spec = self.profile.models[model]
        own = self.instance_specs.get(instance)
        if own is not None:
            spec = replace(own, price_prompt=spec.price_prompt, price_output=spec.price_output)
        on = self.prefix_caching
        if on is None or spec.config.enable_prefix_caching == on:
            return spec
        return replace(spec, config=replace(spec.config, enable_prefix_caching=on))

    def run(self, requests: RequestSet, *, closed_loop: int | None = None) -> SimResult:
        """Route ``requests`` in arrival order (open loop), or with ``closed_loop`` = N
        clients that each send their next request when the previous one finishes (the
        requests' own arrival times are then ignored and replaced)."""
        if self.scaling is not None and closed_loop is not None:
            raise ValueError("scaling: open loop only")
        if self.admission is not None and closed_loop is not None:
            raise ValueError("admission: open loop only")
        warm_up()  # (the compiled paths loaded before the clock starts)
        warm_up_tiers()
        batching = len(self.pairs) >= BATCH_AT and self.scaling is None
        if batching:
            warm_up_stepper()
        t_wall = wallclock.perf_counter()
        prof = self.profile
        rng = np.random.default_rng(self.seed + 1)
        models = prof.model_names
        if requests.models != models:
            raise ValueError("the request set was drawn for other models than the profile's")
        noise_seeds = np.random.SeedSequence(self.seed).generate_state(len(self.pairs),
                                                                        np.uint64) >> 2
        clock = SimClock()  # (every instance's ``now``)
        insts = [SimInstance(name, self.spec(m, name), noise=self.noise, cache_view=self.cache_view,
                             seed=int(s), step_scale=self.step_scale, clock=clock)
                 for (name, m), s in zip(self.pairs, noise_seeds, strict=True)]
        on_board = getattr(self.policy, "uses_load_board", False)
        if on_board:
            _board(insts)
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
        pred_p90 = None
        if self.length_p90_model is not None:
            pred_p90 = np.asarray(self.length_p90_model(requests, rng), dtype=float)
            if pred_p90.shape != requests.output.shape:
                raise ValueError(f"length_p90_model returned shape {pred_p90.shape}, expected "
                                 f"{requests.output.shape}")
        deadlines, tpots = requests.deadline, requests.tpot
        needs = self.policy.consumes
        pred_q = pred_s = None
        if needs & {QUALITY, SUCCESS}:
            source = self.quality_source(requests)
            names = requests.tasks
            queries = QueryTable([names[k] for k in requests.task.tolist()],
                                 [str(i) for i in range(n)])
            if QUALITY in needs:
                pred_q = source.quality_table(queries, models)
            if SUCCESS in needs:
                pred_s = source.quality_table(queries, models, success=True)
        cands = Candidates(Candidate(i.name, models[mi], i.spec.price_prompt,
                                     i.spec.price_output, i)
                           for i, mi in zip(insts, inst_model, strict=True))
        cand_model = np.array(inst_model)
        cand_index = None  # candidate -> instance, where they differ (a scaling pool)
        scaler = None
        if self.scaling is not None:
            spec_of = {m: inst.spec for inst, (_, m) in zip(insts[::-1], self.pairs[::-1],
                                                             strict=True)}
            seeds = np.random.SeedSequence([self.seed, 1])

            def make(name: str, model: str) -> SimInstance:
                s = int(seeds.spawn(1)[0].generate_state(1, np.uint64)[0] >> 2)
                return SimInstance(name, spec_of.get(model) or self.spec(model), noise=self.noise,
                                   cache_view=self.cache_view, seed=s,
                                   step_scale=self.step_scale, clock=clock)

            scaler = ScalingPool(self.scaling, insts, [m for _, m in self.pairs], make,
                                 float(requests.arrival[0]) if len(requests) else 0.0)

            def cands_all(index: list[int]) -> list[Candidate]:
                return [Candidate(insts[k].name, scaler.models[k], insts[k].spec.price_prompt,
                                  insts[k].spec.price_output, insts[k]) for k in index]
        chosen = np.zeros(n, dtype=np.int64)
        forecast = np.full(n, np.nan)
        shadow = {est.name: np.full(n, np.nan) for est in self.shadow_estimators}
        overhead = np.zeros(n)
        shared = requests.segments is not None  # else each request's blocks are its own
        sessions = requests.session
        adapters = requests.adapter
        if adapters is not None and shared and np.any(adapters > 0):
            raise ValueError("requests on LoRA adapters with shared prefixes: the simulator's "
                             "block keys do not carry adapters yet")

        # a policy that reads no instance's state sees none: the instances are then stepped
        # only when given a request (the same steps, noise included: each engine draws its
        # own), at a fraction of the calls in a big pool
        lazy = (closed_loop is None and self.admission is None
                and not self.policy.consumes & INSTANCE_INPUTS)

        timers: list[float] = []  # (the admission queue's give-up times to wake at)

        def dispatch(i: int, t: float, may_queue: bool = False) -> bool:
            """Route request ``i`` at ``t`` (every instance is at or past ``t``, or ``lazy``:
            the chosen one is stepped to it after the decision); with ``may_queue``, a
            decision whose forecast misses what is left of the target is offered to the
            admission queue instead (False: it waits there)."""
            clock.now = t
            session = None
            if sessions is not None and sessions[i] >= 0:
                session = str(int(sessions[i]))
            # (a request released from the admission queue is routed after its arrival; in a
            # closed loop a request arrives as it is sent)
            since = 0.0 if closed_loop is not None else t - float(requests.arrival[i])
            req = RoutingRequest(str(i), int(requests.prompt[i]),
                                 None if pred_q is None else pred_q[i, cand_model],
                                 pred_out[i, cand_model], float(requests.target[i]) - since,
                                 requests.tasks[requests.task[i]], session=session,
                                 success=None if pred_s is None else pred_s[i, cand_model],
                                 prompt_hashes=keys_by_block_size(requests.segments[i]) if shared
                                 else None,
                                 lora=0 if adapters is None else int(adapters[i]),
                                 deadline=math.inf if deadlines is None
                                 else float(deadlines[i]) - since,
                                 tpot_target=math.inf if tpots is None else float(tpots[i]),
                                 output_p90=None if pred_p90 is None
                                 else pred_p90[i, cand_model])
            t0 = wallclock.perf_counter()
            d = self.policy.choose(req, cands, t)
            overhead[i] = wallclock.perf_counter() - t0
            if (may_queue and d.forecast is not None and d.forecast > req.ttft_target
                    and self._queue(i, t, req, requests, timers)):
                return False
            k = d.index if cand_index is None else cand_index[d.index]
            inst = insts[k]
            if lazy and inst.busy_until() < t:
                inst.advance(t)
            for est in self.shadow_estimators:
                shadow[est.name][i] = est.ttft(inst, req.prompt_tokens, t,
                                               hashes=req.prompt_hashes, **lora_kw(req.lora))
            inst.sync()
            if self.charge_overhead:  # the request reaches the instance after the decision
                inst.advance(t + overhead[i])
            mi = inst_model[k]
            out = int(requests.output[i, mi])
            hashes = (engine_hashes(requests, i, out, inst.engine.config.block_size)
                      if shared and inst.engine.caching else ())
            inst.submit(str(i), int(requests.prompt[i]), out, int(pred_out[i, mi]), t, hashes,
                        req.lora)
            chosen[i] = k
            if scaler is not None:
                scaler.routed_to(models[mi], i, k, t, float(requests.target[i]), out,
                                 int(requests.prompt[i]))
            if d.forecast is not None:
                forecast[i] = d.forecast
            return True

        queue_s = None
        if self.admission is not None:
            seen = len(self.admission.waits)
            self._admitted(requests, insts, dispatch, chosen, inst_model, timers)
            queue_s = np.zeros(n)
            for w in self.admission.waits[seen:]:
                queue_s[w.i] += w.seconds
        elif closed_loop is None:
            # Only engines with a step to start before the arrival are stepped to it: a busy
            # engine whose clock is already past it has nothing to do, and an idle one's clock
            # is brought to the arrival when it is read or given a request (SimInstance.sync).
            # The same steps in the same order as stepping every engine, at a fraction of the
            # calls in a big pool.
            # In a big pool the engines without a frontend or prefix caching are stepped in
            # one compiled call per arrival (engine/batch_stepper.py), the others one by one.
            busy_until = np.full(len(insts), np.inf)  # engine clock while it has work
            stepper = (BatchStepper([i.engine if i.fronted is None else None for i in insts])
                       if batching else None)

            def step_to(t: float) -> None:
                due = _due(busy_until, t)
                if stepper is not None and due.shape[0]:
                    due = stepper.advance(due, t, busy_until)
                for k in due.tolist():
                    insts[k].advance(t)
                    busy_until[k] = insts[k].busy_until()

            for i in range(n):
                t = float(requests.arrival[i])
                if scaler is not None and scaler.next_event <= t:
                    grew = len(insts)
                    changed = scaler.until(t, step_to)  # (may add instances: idle ones)
                    if len(insts) > grew:
                        busy_until = np.append(busy_until, np.full(len(insts) - grew, np.inf))
                        if on_board:
                            _board(insts)
                    if changed or len(insts) > grew:
                        inst_model = [models.index(m) for m in scaler.models]
                        cand_index = scaler.serving()
                        cands = Candidates(cands_all(cand_index))
                        cand_model = np.array([inst_model[k] for k in cand_index])
                if not lazy:
                    step_to(t)
                dispatch(i, t)
                k = int(chosen[i])
                busy_until[k] = insts[k].busy_until()
        else:
            requests = self._closed_loop(requests, insts, closed_loop, dispatch)
        first = np.full(n, np.nan)
        fin = np.full(n, np.nan)
        if scaler is not None:
            inst_model = [models.index(m) for m in scaler.models]
        for k, inst in enumerate(insts):
            inst.drain()
            mine = np.flatnonzero(chosen == k)
            first[mine], fin[mine] = inst.delivered([str(i) for i in mine.tolist()])
        prices = np.array([[prof.models[m].price_prompt, prof.models[m].price_output]
                           for m in models])
        queries = hits = None
        if any(inst.engine.caching for inst in insts):
            queries = np.array([inst.engine.prefix_queries for inst in insts], dtype=np.int64)
            hits = np.array([inst.engine.prefix_hits for inst in insts], dtype=np.int64)
        scaled = None
        if scaler is not None:
            scaled = scaler.record(fin, chosen, float(np.nanmax(fin)) if n else 0.0)
        return SimResult(requests, [inst.name for inst in insts], inst_model, chosen, first,
                         fin, forecast, shadow, overhead, prof.lam, prices,
                         wallclock.perf_counter() - t_wall, queries, hits, scaled, queue_s)

    def _key(self, requests: RequestSet, i: int) -> str:
        """Request ``i``'s tenant as the admission queue keys it."""
        return "" if requests.tenant is None else str(int(requests.tenant[i]))

    def _queue(self, i: int, t: float, req: RoutingRequest, requests: RequestSet,
               timers: list[float]) -> bool:
        """Offer request ``i`` to the admission queue at ``t`` (True: it waits; its give-up
        time joins ``timers``), ordered by its end-to-end deadline where it has one, else its
        TTFT target's expiry; its wait lasts what is left of its target."""
        assert self.admission is not None
        give_up = t + max(0.0, req.ttft_target)
        deadline = t + req.deadline if math.isfinite(req.deadline) else give_up
        if not self.admission.offer(i, self._key(requests, i), "critical", deadline, give_up, t):
            return False
        timers.append(give_up)
        return True

    def _admitted(self, requests: RequestSet, insts: list[SimInstance],
                  dispatch: Callable[..., bool], chosen: np.ndarray, inst_model: list[int],
                  timers: list[float]) -> None:
        """Open-loop arrivals through the admission queue, step by step
        (:func:`~duetime.sim.loop.run_clients`): an arrival is decided and sent or queued; a
        first token charges its prompt to its tenant and releases a waiter, an end its
        output; a released waiter is decided again and sent; a waiter whose wait ended
        unreleased is sent to the best forecast."""
        adm = self.admission
        assert adm is not None
        prompt = requests.prompt

        def send(t: float, item: tuple[str, int]) -> list[tuple[float, tuple[str, int]]]:
            kind, i = item
            if kind == "arrive":
                dispatch(i, t, may_queue=True)
            elif kind == "release":
                dispatch(i, t)
            for j in adm.expired(t):  # (displaced just now, or out of time)
                dispatch(j, t)
            due = [(at, ("tick", -1)) for at in timers]
            timers.clear()
            return due

        def charge(rid: str, t: float, tokens: int) -> list[tuple[str, int]]:
            i = int(rid)
            adm.served(self._key(requests, i), tokens, t)
            return [("release", j) for j in adm.release(t, 1)]

        def first_token(rid: str, t: float) -> list[tuple[str, int]]:
            return charge(rid, t, int(prompt[int(rid)]))

        def finished(rid: str, t: float) -> list[tuple[str, int]]:
            i = int(rid)
            return charge(rid, t, int(requests.output[i, inst_model[int(chosen[i])]]))

        run_clients(insts, [(float(a), ("arrive", i)) for i, a in enumerate(requests.arrival)],
                    send, finished, first_token)

    def quality_source(self, requests: RequestSet) -> QualitySource:
        """What the router predicts quality (and success) with for ``requests``."""
        if isinstance(self.quality, QualitySource):
            return self.quality
        if self.quality == "oracle":
            return Oracle.of_table([str(i) for i in range(len(requests))], requests.models,
                                   requests.quality)
        prof = self.profile
        return TaskTable({t: {m: prof.tasks[t].accuracy[m] for m in requests.models}
                          for t in requests.tasks})

    @staticmethod
    def _closed_loop(requests: RequestSet, insts: list[SimInstance], clients: int,
                     dispatch) -> RequestSet:
        """N clients, each sending its next request when its previous one finishes
        (:func:`~duetime.sim.loop.run_clients`); request i is the i-th sent."""
        if clients < 1:
            raise ValueError(f"closed_loop: needs >= 1 client, got {clients}")
        out = _closed_loop_times(requests)
        n = len(requests)
        planned = min(clients, n)
        sent = 0

        def send(t: float, _item: object) -> None:
            nonlocal sent
            out.arrival[sent] = t
            dispatch(sent, t)
            sent += 1

        def finished(_rid: str, _t: float) -> list[None]:
            nonlocal planned
            if planned < n:  # the client sends its next request
                planned += 1
                return [None]
            return []

        run_clients(insts, [(0.0, None)] * planned, send, finished)
        return out
