"""The decision: which instance an attempt of a request goes to, by the request's policy over the
candidates' live state, admitted by the request's priority; and the dispatch that starts the
attempt's lifecycle.

What is kept fresh follows the policy's declaration (:mod:`duetime.policy.registry`): the
shadow replicas of the candidates are brought to the decision's time only for a policy that
consumes snapshots or load gauges (which fall back to the snapshot when no fresh scrape
exists). The relay (``duetime serve``) and the picker (``duetime epp``) decide through the same
:meth:`Router.pick`, :meth:`Router.choose` and :meth:`Router.dispatch`; the dry run through
:meth:`Router.dry_run`, which changes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from duetime.gateway.config import Pool
from duetime.gateway.intake.admission import Admission
from duetime.gateway.intake.controls import MEAN_TASK
from duetime.gateway.intake.request import RequestContext
from duetime.gateway.prometheus import GatewayMetrics
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.lifecycle import Attempt, Lifecycle
from duetime.policy.base import Policy, RoutingRequest
from duetime.policy.explain import explain as explain_decision
from duetime.policy.registry import LOAD, SNAPSHOT
from duetime.web.errors import ApiError


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


def reads_load(policy: Policy) -> bool:
    """Whether the policy reads load gauges (which fall back to the snapshot)."""
    return LOAD in policy.consumes


def reads_state(policy: Policy) -> bool:
    """Whether the policy reads the instances' live state (snapshots or load gauges)."""
    return SNAPSHOT in policy.consumes or LOAD in policy.consumes


class Router:
    """Chooses instances for requests over the pool's ``instances``; ``wants_explanation(now)``
    says whether a dashboard wants the decision made now explained (None: never)."""

    def __init__(self, pool: Pool, lifecycle: Lifecycle, admission: Admission,
                 metrics: GatewayMetrics,
                 wants_explanation: Callable[[float], bool] | None = None) -> None:
        self.pool = pool
        self.lifecycle = lifecycle
        self.admission = admission
        self.metrics = metrics
        self.wants_explanation = wants_explanation

    # -- which candidates -------------------------------------------------------------------------

    def rotation(self, insts: list[InstanceState],
                 tried: set[str]) -> tuple[list[InstanceState], bool]:
        """The candidates of the next attempt, and whether they are a fail-open choice: the
        ones in rotation not tried yet; once every one in rotation has been tried, those
        again (a failed attempt may pass on a retry: faults are per request); with none in
        rotation, the least bad instance (``health.fail_open``; see
        :meth:`HealthTracker.badness`), untried first, or none."""
        insts = [s for s in insts if s.serving]  # (not joining or draining since)
        healthy = [s for s in insts if s.healthy]
        untried = [s for s in healthy if s.name not in tried]
        if untried or healthy:
            return untried or healthy, False
        if not self.pool.health.fail_open or not insts:
            return [], False
        rest = [s for s in insts if s.name not in tried] or insts
        return [min(rest, key=lambda s: s.health.badness())], True

    def exhausted(self, ctx: RequestContext, errors: list[str]) -> ApiError:
        """No candidate left: 503 before any attempt, 502 after failed ones."""
        model = ctx.req.model
        what = ("any model" if model is None or model in self.pool.aliases
                else f"model `{model}`")
        if not errors:
            return ApiError(503, f"no healthy instance serves {what}",
                            code="no_healthy_instance")
        return ApiError(502, f"upstream failed after {len(errors)} attempt(s) (request "
                        f"{ctx.rid}: the gateway's log has each attempt's error)",
                        code="upstream_failed")

    # -- the decision -----------------------------------------------------------------------------

    def _routing_request(self, ctx: RequestContext, cands: list[InstanceState],
                         now: float) -> RoutingRequest:
        """What the policy is told of the request (the candidates' state brought to ``now``
        first, for a policy that reads it)."""
        if reads_state(ctx.policy):
            for s in cands:
                s.refresh(now)
        quality, success, lengths, predicted = ctx.quality, ctx.success, ctx.lengths, \
            ctx.predicted
        ctl = ctx.controls
        return RoutingRequest(
            ctx.rid, ctx.req.prompt_tokens,
            None if quality is None else np.array([quality[c.model] for c in cands]),
            np.array([predicted if lengths is None else
                      max(1, min(ctx.cap, round(lengths.get(c.model, predicted))))
                      for c in cands]),
            max(0.0, ctl.target_s - (now - ctx.arrival)), ctl.task, ctl.session, ctl.attempted,
            None if success is None else np.array([success[c.model] for c in cands]),
            ctx.keys, lora=ctx.lora,
            deadline=(math.inf if ctl.deadline_s is None
                      else ctl.deadline_s - (now - ctx.arrival)),
            tpot_target=math.inf if ctl.tpot_target_s is None else ctl.tpot_target_s,
            output_p90=None if ctx.length_p90 is None or lengths is None else
            np.array([max(1.0, min(ctx.cap, ctx.length_p90.get(c.model, predicted)))
                      for c in cands]))

    def choose(self, ctx: RequestContext, cands: list[InstanceState], *,
               explain: bool = False) -> Choice:
        """The policy's choice among ``cands`` now (their state brought to now first, for a
        policy that reads it), with its explanation if ``explain`` (or if a dashboard wants
        one now). Changes nothing but the replicas' clocks: no dispatch."""
        now = time.monotonic()
        policy = ctx.policy
        rr = self._routing_request(ctx, cands, now)
        options = [c.candidate for c in cands]
        decision = policy.choose(rr, options, now)
        choice = Choice(cands[decision.index], decision.forecast, rr.ttft_target)
        if explain:
            choice.explanation = explain_decision(policy, rr, options, now, decision)
        elif self.wants_explanation is not None and self.wants_explanation(now):
            t = time.thread_time()  # (a dashboard's sample: the dashboard's CPU cost)
            choice.explanation = explain_decision(policy, rr, options, now, decision)
            self.metrics.dashboard.labels("explain").inc(time.thread_time() - t)
        return choice

    def fallbacks(self, ctx: RequestContext, choice: Choice, k: int) -> list[InstanceState]:
        """Up to ``k`` instances to try, in order, if ``choice`` fails: the others in rotation
        that serve the same model under the same name, ranked by the policy's dry run
        (:meth:`Policy.preview`: nothing dispatched, no later choice changed)."""
        served = choice.inst.instance.served_model
        rest = [s for s in ctx.candidates if s is not choice.inst and s.healthy
                and s.serving and s.instance.served_model == served]
        out: list[InstanceState] = []
        now = time.monotonic()
        while rest and len(out) < k:
            rr = self._routing_request(ctx, rest, now)
            best = rest[ctx.policy.preview(rr, [c.candidate for c in rest], now).index]
            out.append(best)
            rest.remove(best)
        return out

    async def pick(self, ctx: RequestContext) -> Choice:
        """The first attempt's instance: the policy's choice among those in rotation, admitted
        by priority (:meth:`Admission.admit`: may raise :class:`Shed`, or wait in the queue
        and choose again); raises the 503 when none is in rotation. Dispatches nothing."""
        waited = False
        while True:
            cands, failing_open = self.rotation(ctx.candidates, set())
            if not cands:
                raise self.exhausted(ctx, [])
            choice = self.choose(ctx, cands, explain=ctx.controls.explain)
            choice.failing_open = failing_open
            if await self.admission.admit(choice.forecast, choice.target_s, ctx.controls,
                                          waited):
                return choice
            waited = True  # (it waited for capacity: decide again)

    def dispatch(self, ctx: RequestContext, choice: Choice, number: int) -> Attempt:
        """Start attempt ``number`` of the request on the chosen instance: its flight (with its
        prompt's block keys where the instance caches) dispatched through the lifecycle."""
        inst = choice.inst
        cfg = inst.instance.config
        now = time.monotonic()
        flight = inst.new_flight(f"{ctx.rid}-{number}", ctx.req.prompt_tokens, ctx.predicted,
                                 now, choice.forecast,
                                 ctx.keys(cfg.block_size) if cfg.enable_prefix_caching
                                 else None, ctx.lora)
        ctl = ctx.controls
        return self.lifecycle.dispatch(Attempt(
            flight, inst, number, ctx.arrival, ctl.target_s, ctx.policy.name,
            inst.source(reads_load(ctx.policy)), ctl.tpot_target_s, choice.failing_open,
            choice.explanation, ctx.key, ctl.client))

    # -- the dry run ------------------------------------------------------------------------------

    def dry_run(self, ctx: RequestContext) -> dict[str, Any]:
        """``POST /duetime/route``: the choice the policy would make now among the
        instances in rotation, explained, with nothing dispatched and no later choice
        changed (:meth:`Policy.preview`); the instances out of rotation are listed."""
        cands, failing_open = self.rotation(ctx.candidates, set())
        if not cands:
            raise self.exhausted(ctx, [])
        now = time.monotonic()
        policy, ctl = ctx.policy, ctx.controls
        rr = self._routing_request(ctx, cands, now)
        options = [c.candidate for c in cands]
        decision = policy.preview(rr, options, now)
        out = explain_decision(policy, rr, options, now, decision)
        out["admission"] = Admission.verdict(decision.forecast, rr.ttft_target, ctl.priority)
        out["failing_open"] = failing_open
        out["out_of_rotation"] = [{"instance": s.name, "model": s.model,
                                   "reason": s.health.last_error or "ejected"}
                                  for s in ctx.candidates if s not in cands]
        out["task"] = None if ctl.task == MEAN_TASK else ctl.task
        out["request_target_ms"] = round(ctl.target_s * 1e3, 3)
        return out
