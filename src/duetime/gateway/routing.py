"""Routing one request: read its controls, count its prompt, predict what the policy consumes,
choose among the candidates, and retry elsewhere when an attempt fails before the client got
anything.

What is predicted and kept fresh follows the policy's declaration
(:mod:`duetime.policy.registry`): the shadow replicas of the candidates are brought to the
decision's time only for a policy that consumes snapshots or load gauges (which fall back to
the snapshot when no fresh scrape exists); quality, success probability and
output length are asked of the quality source (the pool's per-task table, or its trained
predictor with the table as fallback) only when consumed, and left ``None`` otherwise.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.estimate.base import KeysByBlockSize
from duetime.gateway.admission import PRIORITIES, AdmissionQueue, Shed
from duetime.gateway.config import Pool
from duetime.gateway.inflight import Flight
from duetime.gateway.instance import InstanceState
from duetime.gateway.metrics import GatewayMetrics
from duetime.gateway.observatory import Decision, Observatory
from duetime.gateway.prompt_tokens import PromptTokenizer
from duetime.gateway.relay import AttemptFailed, Controls, Passthrough, Relay
from duetime.policy import make_policy, policy_names
from duetime.policy.base import Policy, RoutingRequest
from duetime.policy.explain import explain as explain_decision
from duetime.policy.registry import METRICS, OUTPUT_LENGTH, QUALITY, SNAPSHOT, SUCCESS
from duetime.predict.quality_source import QualitySource, Query, TaskTable
from duetime.web.asgi import Scope, Send, header, send_json
from duetime.web.errors import ApiError, number_in, relayed_error
from duetime.web.prefix_keys import prompt_block_keys
from duetime.web.requests import CompletionRequest, prompt_texts

log = logging.getLogger("duetime.gateway")

MEAN_TASK = "*"  # no task given and no default: each model's mean quality over the tasks
MAX_VARIANTS = 32  # routers kept for requests that ask for another policy or lambda
EXPLAIN_HEADER_BYTES = 8192  # the x-duetime-explain header's size at most


def explain_header(explanation: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The ``x-duetime-explain`` response header: the explanation as compact JSON. Past
    ``EXPLAIN_HEADER_BYTES`` (a pool of many instances) only the chosen candidate and the best
    others by the policy's score are kept, and ``"truncated"`` says how many were left out
    (``POST /duetime/route`` has them all)."""
    def encode(e: dict[str, Any]) -> bytes:
        return json.dumps(e, separators=(",", ":")).encode()

    raw = encode(explanation)
    cands = explanation["candidates"]
    keep = len(cands)
    while len(raw) > EXPLAIN_HEADER_BYTES and keep > 1:
        keep //= 2
        sign = -1 if explanation.get("better") == "lower" else 1
        ranked = sorted(cands, key=lambda c: (not c["chosen"],
                                              -sign * (c["score"] if c["score"] is not None
                                                       else c["utility"] or 0.0)))
        raw = encode({**explanation, "candidates": ranked[:keep],
                      "truncated": len(cands) - keep})
    return [(b"x-duetime-explain", raw)]

def _milliseconds(scope: Scope, name: bytes) -> float | None:
    """A header's value in milliseconds, in (0, 3600000] (400 otherwise); None if absent."""
    raw = header(scope, name)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= 3.6e6):
        what = name.decode()
        raise ApiError(400, f"{what} must be a number of milliseconds in (0, 3600000], got "
                       f"{raw[:40]!r}", param=what, code="invalid_header")
    return ms


@dataclass(slots=True)
class Plan:
    """One request as every attempt routes it (:meth:`Router.plan`)."""

    rid: str
    req: CompletionRequest
    predicted: int  # output tokens predicted (the default, capped by max_tokens)
    cap: int  # no predicted length past this (max_tokens; else none)
    quality: dict | None
    success: dict | None
    lengths: dict | None
    keys: KeysByBlockSize


@dataclass(slots=True)
class Choice:
    """A routing decision (:meth:`Router.choose`): the instance, the policy's TTFT forecast
    for it (if it made one), the TTFT target the policy saw, whether the choice fails open
    (none of the candidates in rotation), and its explanation when one was asked for."""

    inst: InstanceState
    forecast: float | None
    target_s: float
    failing_open: bool = False
    explanation: dict | None = None  # (:mod:`duetime.policy.explain`), where asked for


class Router:
    """Chooses instances for requests and runs the attempts (through the :class:`Relay`)."""

    def __init__(self, pool: Pool, policy: Policy, instances: list[InstanceState],
                 metrics: GatewayMetrics, relay: Relay,
                 queue: AdmissionQueue | None = None,
                 observatory: Observatory | None = None) -> None:
        """``queue``: where critical requests wait (none: they go to the best forecast);
        ``observatory``: where the dashboard's history is kept (none: not kept)."""
        self.queue = queue
        self.observatory = observatory
        self.variants: OrderedDict[tuple[str, float | None], Router] = OrderedDict()
        # (session bindings shared between replicas, for a session-affinity variant)
        self.bindings: MutableMapping[str, str] | None = None
        self.pool = pool
        self.policy = policy
        self.consumes = policy.consumes
        self.instances = instances
        self.metrics = metrics
        self.relay = relay
        self.load = METRICS in self.consumes  # (load gauges fall back to the snapshot)
        self.fresh = SNAPSHOT in self.consumes or self.load
        self.by_model: dict[str, list[InstanceState]] = {}
        for s in instances:
            self.by_model.setdefault(s.model, []).append(s)
        self.tasks = list(pool.quality)
        self.default_task = pool.default_task or MEAN_TASK
        table = TaskTable({t: {m: pool.quality[t][m] for m in pool.models} for t in self.tasks})
        self.source: QualitySource = table
        if pool.predictor is not None:
            from duetime.predict.quality_source import Trained
            self.source = Trained(pool.predictor, fallback=table)
        self.tokenizer: PromptTokenizer | None = None
        if pool.tokenizer is not None:
            self.tokenizer = PromptTokenizer(pool.tokenizer, pool.chat_template)
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)

    # -- the request ------------------------------------------------------------------------------

    def controls(self, scope: Scope, prompt_tokens: int) -> Controls:
        """The request's headers: ``x-duetime-ttft-ms`` (else llm-d's ``x-slo-ttft-ms``),
        ``x-slo-tpot-ms``, ``x-duetime-priority``, ``x-duetime-attempted``,
        ``x-session-id``, ``x-duetime-task`` (400 on a bad value)."""
        target_ms = _milliseconds(scope, b"x-duetime-ttft-ms")
        if target_ms is None:
            target_ms = _milliseconds(scope, b"x-slo-ttft-ms")
        if target_ms is None:
            target_ms = self.pool.target_ms(prompt_tokens)
        tpot_ms = _milliseconds(scope, b"x-slo-tpot-ms")
        priority = header(scope, b"x-duetime-priority")
        if priority is None:
            priority = "standard"
        elif priority.strip().lower() in PRIORITIES:
            priority = priority.strip().lower()
        else:
            raise ApiError(400, f"x-duetime-priority must be one of {', '.join(PRIORITIES)}, "
                           f"got {priority[:40]!r}", param="x-duetime-priority",
                           code="invalid_header")
        attempted: frozenset[str] = frozenset()
        raw = header(scope, b"x-duetime-attempted")
        if raw is not None and raw.strip():
            names = [n.strip() for n in raw.split(",")]
            if any(not n for n in names) or len(names) > 100:
                raise ApiError(400, f"x-duetime-attempted must be a comma-separated list of "
                               f"model names, got {raw!r}", param="x-duetime-attempted",
                               code="invalid_header")
            attempted = frozenset(names)
        session = header(scope, b"x-session-id")
        task = header(scope, b"x-duetime-task")
        if task is None:
            task = self.default_task
        elif task not in self.tasks:
            raise ApiError(400, f"x-duetime-task: unknown task {task!r}; known: "
                           f"{', '.join(self.tasks)}", param="x-duetime-task",
                           code="invalid_header")
        client = scope.get("duetime.client") or (scope.get("client") or ("",))[0]
        explain = (header(scope, b"x-duetime-explain") or "").strip().lower() in (
            "1", "true", "yes")
        policy, lam = self._policy_headers(scope)
        return Controls(target_ms / 1000.0, attempted, session or None, task, priority,
                        None if tpot_ms is None else tpot_ms / 1000.0, str(client), explain,
                        policy, lam)

    def _policy_headers(self, scope: Scope) -> tuple[str | None, float | None]:
        """``x-duetime-policy`` (a registered policy's name) and ``x-duetime-lambda`` (its
        lambda, >= 0): this request routed by another policy than the pool's (400 on a bad
        value)."""
        name = header(scope, b"x-duetime-policy")
        if name is not None:
            name = name.strip()
            if name not in policy_names():
                raise ApiError(400, f"x-duetime-policy: unknown policy {name[:40]!r}; known: "
                               f"{', '.join(policy_names())}", param="x-duetime-policy",
                               code="invalid_header")
        raw = header(scope, b"x-duetime-lambda")
        lam = None if raw is None else number_in(raw, 0.0, 1e6, param="x-duetime-lambda",
                                                 code="invalid_header")
        return name, lam

    def variant(self, ctl: Controls) -> Router:
        """The router for a request: this one, or (``x-duetime-policy`` / ``x-duetime-lambda``)
        one that shares everything with it but its policy (kept for the next requests that
        ask for the same; at most ``MAX_VARIANTS``, the least recently used dropped)."""
        name = ctl.policy or self.pool.policy
        if name == self.pool.policy and ctl.lam is None:
            return self
        key = (name, ctl.lam)
        found = self.variants.get(key)
        if found is not None:
            self.variants.move_to_end(key)
            return found
        pool = self.pool
        params = dict(pool.policy_params) if name == pool.policy else {}
        defaults = {"lambda": pool.lam if ctl.lam is None else ctl.lam, "seed": pool.seed,
                    "delta": pool.delta, "alpha": pool.alpha}
        if ctl.lam is not None:
            params.pop("lambda", None)
            params.pop("lam", None)
        policy = make_policy(name, params, defaults=defaults)
        if self.bindings is not None and hasattr(policy, "bindings"):
            policy.bindings = self.bindings
        v = copy.copy(self)
        v.policy = policy
        v.consumes = policy.consumes
        v.load = METRICS in v.consumes
        v.fresh = SNAPSHOT in v.consumes or v.load
        v.variants = OrderedDict()
        self.variants[key] = v
        while len(self.variants) > MAX_VARIANTS:
            self.variants.popitem(last=False)
        return v

    def candidates(self, model: str | None, prompt_tokens: int, max_tokens: int | None, *,
                   param: str = "messages") -> list[InstanceState]:
        """The instances a request for ``model`` may go to (an alias: all; 404 if unknown)
        that can hold it (:meth:`SchedulerConfig.refusal`: within ``max_model_len`` and, up
        to ``max_tokens``, within the KV cache; else it would block that instance's queue for
        good). None can: 400, with the reason of the one with the largest cache."""
        if model is None or model in self.pool.aliases:
            insts = self.instances
        else:
            found = self.by_model.get(model)
            if found is None:
                raise ApiError(404, f"The model `{model}` does not exist. Models: "
                               f"{', '.join([*self.pool.aliases, *self.by_model])}",
                               param="model", code="model_not_found")
            insts = found
        fit = [s for s in insts if s.instance.config.refusal(prompt_tokens, max_tokens) is None]
        if not fit:
            big = max(insts, key=lambda s: (s.instance.config.kv_capacity_tokens,
                                            s.instance.config.max_model_len))
            why = big.instance.config.refusal(prompt_tokens, max_tokens)
            where = f"instance {big.name}" if len(insts) == 1 else (
                f"none of the {len(insts)} instances can hold it; the largest: {big.name}")
            raise ApiError(400, f"{why} ({where})", param=param,
                           code="context_length_exceeded")
        return fit

    def count_tokens(self, req: CompletionRequest) -> int:
        """Prompt tokens: with the pool's tokenizer, the token ids vLLM will see (kept in
        ``req.token_ids`` for the block keys; :class:`PromptTokenizer`), where it can make
        them; else the estimate (:mod:`duetime.web.tokens`)."""
        tok = self.tokenizer
        if tok is None:
            return req.prompt_tokens
        ids = tok.ids(req)
        if ids is None:  # (no template, or one the request defeats): contents counted, the
            if req.chat:  # template's markers estimated as in the emulator
                return 3 + sum(4 + (len(tok.encode(t, special=False)) if t else 0)
                               for t in prompt_texts(req))
            return req.prompt_tokens
        req.token_ids = ids
        return max(1, len(ids))

    def predict(self, req: CompletionRequest,
                ctl: Controls) -> tuple[dict | None, dict | None, dict | None]:
        """Per model, what the policy consumes: predicted quality, success probability and
        (median) output length; None where not consumed (or, for lengths, not predicted)."""
        needs = self.consumes
        if not needs & {QUALITY, SUCCESS, OUTPUT_LENGTH}:
            return None, None, None
        models = self.pool.models
        text = "\n".join(prompt_texts(req)) if self.pool.predictor is not None else ""
        query = Query(text, None if ctl.task == MEAN_TASK else ctl.task,
                      tokens=req.prompt_tokens)

        def per_model(values: np.ndarray | None) -> dict | None:
            return None if values is None else dict(zip(models, values.tolist(), strict=True))

        src = self.source
        return (per_model(src.qualities(query, models)) if QUALITY in needs else None,
                per_model(src.successes(query, models)) if SUCCESS in needs else None,
                per_model(src.output_lengths(query, models)) if OUTPUT_LENGTH in needs
                else None)

    # -- choose and attempt -------------------------------------------------------------------------

    async def _admit(self, forecast: float | None, target_s: float, ctl: Controls,
                     waited: bool) -> bool:
        """Whether the request goes to the decision's instance now (True), or was queued and
        must be decided again (False). A forecast that meets the target (or none made): now.
        Otherwise by priority: ``sheddable`` raises :class:`Shed`; ``critical`` waits in the
        queue (once) until capacity frees or its target is spent; ``standard``, and a
        critical one that has waited or finds the queue full, goes to the best forecast."""
        m = self.metrics.admission
        if forecast is None or not math.isfinite(forecast) or forecast <= target_s:
            m.labels(ctl.priority, "queued" if waited else "on_time").inc()
            return True
        if ctl.priority == "sheddable":
            m.labels(ctl.priority, "shed").inc()
            raise Shed(forecast - target_s, forecast, target_s)
        if ctl.priority == "critical" and not waited and self.queue is not None:
            # released, or its target spent, or the queue full: decide once more either way
            await self.queue.wait(ctl.client, target_s)
            return False
        m.labels(ctl.priority, "late").inc()
        return True

    def _tpot_outcome(self, ctl: Controls, flight) -> None:
        """Count whether the request met its ``x-slo-tpot-ms`` target (mean time per output
        token after the first), where it had one."""
        if ctl.tpot_target_s is None or flight.first_token is None or flight.tokens < 2:
            return
        tpot = (time.monotonic() - flight.first_token) / (flight.tokens - 1)
        self.metrics.tpot_target.labels("on_time" if tpot <= ctl.tpot_target_s
                                        else "late").inc()

    def rotation(self, insts: list[InstanceState],
                 tried: set[str]) -> tuple[list[InstanceState], bool]:
        """The candidates of the next attempt, and whether they are a fail-open choice: the
        ones in rotation not tried yet; once every one in rotation has been tried, those
        again (a failed attempt may pass on a retry: faults are per request); with none in
        rotation, the least bad instance (``health.fail_open``; see
        :meth:`HealthTracker.badness`), untried first, or none."""
        healthy = [s for s in insts if s.healthy]
        untried = [s for s in healthy if s.name not in tried]
        if untried or healthy:
            return untried or healthy, False
        if not self.pool.health.fail_open or not insts:
            return [], False
        rest = [s for s in insts if s.name not in tried] or insts
        return [min(rest, key=lambda s: s.health.badness())], True

    # -- the decision (shared by the relay path and the endpoint picker) --------------------------

    def plan(self, req: CompletionRequest, ctl: Controls) -> Plan:
        """What every attempt of ``req`` shares: its id, predicted output length, the policy's
        predictions and its prompt's block keys (computed per block size when asked)."""
        pool = self.pool
        predicted = (min(req.max_tokens, pool.default_output_tokens) if req.max_tokens
                     else pool.default_output_tokens)
        quality, success, lengths = self.predict(req, ctl)
        return Plan(f"dt-{self._prefix}-{next(self._ids):x}", req, predicted,
                    predicted if req.max_tokens else 1 << 30, quality, success, lengths,
                    KeysByBlockSize(lambda block_size: prompt_block_keys(req, block_size)))

    def _routing_request(self, plan: Plan, ctl: Controls, cands: list[InstanceState],
                         t0: float, now: float) -> RoutingRequest:
        """What the policy is told of the request (the candidates' state brought to ``now``
        first, for a policy that reads it)."""
        if self.fresh:
            for s in cands:
                s.refresh(now)
        quality, success, lengths = plan.quality, plan.success, plan.lengths
        predicted = plan.predicted
        return RoutingRequest(
            plan.rid, plan.req.prompt_tokens,
            None if quality is None else np.array([quality[c.model] for c in cands]),
            np.array([predicted if lengths is None else
                      max(1, min(plan.cap, round(lengths.get(c.model, predicted))))
                      for c in cands]),
            max(0.0, ctl.target_s - (now - t0)), ctl.task, ctl.session, ctl.attempted,
            None if success is None else np.array([success[c.model] for c in cands]),
            plan.keys)

    def choose(self, plan: Plan, ctl: Controls, cands: list[InstanceState], t0: float, *,
               explain: bool = False) -> Choice:
        """The policy's choice among ``cands`` now (their state brought to now first, for a
        policy that reads it), with its explanation if ``explain`` (or if a dashboard wants
        one now). Changes nothing but the replicas' clocks: no dispatch."""
        now = time.monotonic()
        rr = self._routing_request(plan, ctl, cands, t0, now)
        options = [c.candidate for c in cands]
        decision = self.policy.choose(rr, options, now)
        choice = Choice(cands[decision.index], decision.forecast, rr.ttft_target)
        if explain:
            choice.explanation = explain_decision(self.policy, rr, options, now, decision)
        elif self.observatory is not None and self.observatory.wants_explanation(now):
            t = time.thread_time()  # (a dashboard's sample: the dashboard's CPU cost)
            choice.explanation = explain_decision(self.policy, rr, options, now, decision)
            self.metrics.dashboard.labels("explain").inc(time.thread_time() - t)
        return choice

    def dry_run(self, plan: Plan, ctl: Controls, insts: list[InstanceState],
                t0: float) -> dict[str, Any]:
        """``POST /duetime/route``: the choice the policy would make now among the
        instances in rotation, explained, with nothing dispatched and no later choice
        changed (:meth:`Policy.preview`); the instances out of rotation are listed."""
        cands, failing_open = self.rotation(insts, set())
        if not cands:
            raise self.exhausted(plan.req, [], plan.rid)
        now = time.monotonic()
        rr = self._routing_request(plan, ctl, cands, t0, now)
        options = [c.candidate for c in cands]
        decision = self.policy.preview(rr, options, now)
        out = explain_decision(self.policy, rr, options, now, decision)
        forecast = decision.forecast
        out["admission"] = (
            "on_time" if forecast is None or not math.isfinite(forecast)
            or forecast <= rr.ttft_target else
            {"sheddable": "shed", "critical": "queued"}.get(ctl.priority, "late"))
        out["failing_open"] = failing_open
        out["out_of_rotation"] = [{"instance": s.name, "model": s.model,
                                   "reason": s.health.last_error or "ejected"}
                                  for s in insts if s not in cands]
        out["task"] = None if ctl.task == MEAN_TASK else ctl.task
        out["request_target_ms"] = round(ctl.target_s * 1e3, 3)
        return out

    def exhausted(self, req: CompletionRequest, errors: list[str], rid: str) -> ApiError:
        """No candidate left: 503 before any attempt, 502 after failed ones."""
        what = ("any model" if req.model is None or req.model in self.pool.aliases
                else f"model `{req.model}`")
        if not errors:
            return ApiError(503, f"no healthy instance serves {what}",
                            code="no_healthy_instance")
        return ApiError(502, f"upstream failed after {len(errors)} attempt(s) (request "
                        f"{rid}: the gateway's log has each attempt's error)",
                        code="upstream_failed")

    async def pick(self, plan: Plan, ctl: Controls, insts: list[InstanceState],
                   t0: float) -> Choice:
        """The first attempt's instance: the policy's choice among those in rotation, admitted
        by priority (:meth:`_admit`: may raise :class:`Shed`, or wait in the queue and choose
        again); raises the 503 when none is in rotation. Dispatches nothing."""
        waited = False
        while True:
            cands, failing_open = self.rotation(insts, set())
            if not cands:
                raise self.exhausted(plan.req, [], plan.rid)
            choice = self.choose(plan, ctl, cands, t0, explain=ctl.explain)
            choice.failing_open = failing_open
            if await self._admit(choice.forecast, choice.target_s, ctl, waited):
                return choice
            waited = True  # (it waited for capacity: decide again)

    def dispatch(self, plan: Plan, choice: Choice, attempt: int) -> Flight:
        """Record the attempt on the chosen instance: counted in the metrics, joined to its
        in-flight ledger and shadow replica (with its prompt's block keys when it caches)."""
        inst = choice.inst
        if attempt > 1:
            self.metrics.retries.inc()
        if choice.failing_open:
            self.metrics.fail_open.labels(inst.name).inc()
        self.metrics.decisions.labels(inst.name, inst.model).inc()
        self.metrics.state_source.labels(inst.name, inst.source(self.load)).inc()
        cfg = inst.instance.config
        fid = f"{plan.rid}-{attempt}"
        now = time.monotonic()
        if self.observatory is not None:
            f = choice.forecast
            self.observatory.decided(Decision(
                fid, time.time(), inst.name, inst.model, self.policy.name,
                None if f is None or not math.isfinite(f) else round(f * 1e3, 3),
                round(choice.target_s * 1e3, 3), attempt, choice.explanation), now)
        return inst.dispatch(fid, plan.req.prompt_tokens, plan.predicted, now,
                             choice.forecast,
                             plan.keys(cfg.block_size) if cfg.enable_prefix_caching else None)

    # -- choose and relay ---------------------------------------------------------------------------

    async def route(self, req: CompletionRequest, ctl: Controls, insts: list[InstanceState],
                    chat: bool, send: Send, t0: float) -> int:
        """Choose, attempt, retry; returns the status answered (raises ApiError for 502/503)."""
        pool = self.pool
        plan = self.plan(req, ctl)
        rid = plan.rid
        body = dict(req.body)
        body["stream"] = True
        # usage is always asked for upstream (the gateway counts tokens with it); the client's
        # other stream options (vLLM's continuous_usage_stats) go along
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                  "include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: set[str] = set()
        errors: list[str] = []
        attempt = 0
        while True:
            if attempt == 0:
                choice = await self.pick(plan, ctl, insts, t0)
            else:
                cands, failing_open = (self.rotation(insts, tried) if attempt <= pool.retries
                                       else ([], False))
                if not cands:
                    raise self.exhausted(req, errors, rid)
                choice = self.choose(plan, ctl, cands, t0, explain=ctl.explain)
                choice.failing_open = failing_open
            inst = choice.inst
            tried.add(inst.name)
            attempt += 1
            body["model"] = inst.instance.served_model
            flight = self.dispatch(plan, choice, attempt)
            if attempt == 1:
                self.metrics.overhead.observe(time.monotonic() - t0)
            try:
                extra = (explain_header(choice.explanation)
                         if ctl.explain and choice.explanation is not None else ())
                status = await self.relay.attempt(inst, flight, path, json.dumps(body).encode(),
                                                  req, ctl, chat, send, t0, rid, attempt, extra)
                self._tpot_outcome(ctl, flight)
                return status
            except AttemptFailed as e:
                inst.health.report_failure(e.kind, str(e))
                self.metrics.upstream_errors.labels(inst.name, e.kind).inc()
                errors.append(f"{inst.name}: {e}")
                log.warning("upstream attempt failed", extra={"fields": {
                    "event": "upstream_error", "id": rid, "instance": inst.name,
                    "kind": e.kind, "error": str(e), "attempt": attempt}})
            except Passthrough as e:
                await send_json(send, e.status, relayed_error(e.status, e.body),
                                [(b"x-duetime-instance", inst.name.encode())])
                return e.status
