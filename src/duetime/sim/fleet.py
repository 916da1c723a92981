"""Several routers over one pool: each request goes to one of N router replicas (a load
balancer in front), and each router decides from its own view of the instances.

:class:`RouterFleet` is a :class:`~duetime.policy.base.Policy` for
:class:`~duetime.sim.cluster.ClusterSim`: the simulator steps the true instances and queues
each request where the fleet says; the fleet hands the request to one router and lets it
choose among that router's :class:`~duetime.sim.router_view.RouterView` s, one shadow engine
per (router, instance). What a router's views know (``sharing``):

* ``independent``: only its own dispatches, their first tokens and ends (as the instance
  streams them back to it), and its own requests' token counts;
* ``shared``: also every other router's dispatches, first tokens and ends, each ``staleness_s``
  seconds after it happened (a shared ledger, e.g. Redis, synchronised with that delay).

With one router both are the same: a gateway's shadow replica of each instance. With
``step_correction`` each view also learns its instance's step time from its router's token
counts, as the gateway's replicas do (``state.step_correction``): the simulator's instances may
step slower or faster than their calibration (``ClusterSim(step_scale=...)``). Arrivals are
spread over the routers at random (``spread="random"``, as kube-proxy's default iptables mode
picks a backend) or in turn (``"round-robin"``, IPVS's default).

The truth a router learns from is read from the true engines after the simulator has stepped
them to the decision's time: a request's first token and end as they are stamped (events
stamped after the decision's time wait in the views until their time comes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from duetime.engine.wait_estimate import LoadBoard
from duetime.estimate.correction import StepCorrection
from duetime.policy.base import Candidate, Candidates, Decision, Policy, RoutingRequest
from duetime.policy.registry import SNAPSHOT
from duetime.sim.instance import SimInstance
from duetime.sim.router_view import ADD, DONE, FIRST, Known, RouterView

SHARING = ("independent", "shared")
SPREADS = ("random", "round-robin")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """How many routers, what their views know, how arrivals are spread over them."""

    routers: int = 1
    sharing: str = "shared"
    staleness_s: float = 0.0
    spread: str = "random"
    step_correction: bool = False  # each view learns its instance's step time (RouterView)

    def __post_init__(self) -> None:
        if not isinstance(self.routers, int) or self.routers < 1:
            raise ValueError(f"routers must be an integer >= 1, got {self.routers!r}")
        check_fleet_options(self.sharing, self.staleness_s, self.spread)

    def fleet(self, make: Callable[[int], Policy], seed: int = 0) -> RouterFleet:
        """A fleet whose router k is ``make(k)``."""
        return RouterFleet([make(k) for k in range(self.routers)], sharing=self.sharing,
                           staleness_s=self.staleness_s, spread=self.spread, seed=seed,
                           step_correction=self.step_correction)


def check_fleet_options(sharing: str, staleness_s: float, spread: str) -> None:
    if sharing not in SHARING:
        raise ValueError(f"sharing: {' or '.join(SHARING)}, got {sharing!r}")
    if spread not in SPREADS:
        raise ValueError(f"spread: {' or '.join(SPREADS)}, got {spread!r}")
    if not staleness_s >= 0:
        raise ValueError(f"staleness must be >= 0 s, got {staleness_s!r}")


class _Ledger:
    """The requests sent to one true instance, in the order it got them (its engine's add
    order), with who sent each and which of its events the routers were told of."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.sender = np.zeros(64, dtype=np.int64)
        self.told_first = np.zeros(64, dtype=bool)
        self.told_done = np.zeros(64, dtype=bool)
        self.lo = 0  # the first request not yet known to have ended

    def append(self, rid: str, sender: int) -> None:
        k = len(self.rids)
        if k == len(self.sender):
            self.sender = np.concatenate((self.sender, np.zeros(k, dtype=np.int64)))
            self.told_first = np.concatenate((self.told_first, np.zeros(k, dtype=bool)))
            self.told_done = np.concatenate((self.told_done, np.zeros(k, dtype=bool)))
        self.rids.append(rid)
        self.sender[k] = sender
        self.told_first[k] = self.told_done[k] = False


class RouterFleet(Policy):
    """N routers (``routers``: one policy each, with its own state and tie-break stream)."""

    name = "fleet"
    summary = "N router replicas, each routing from its own view of the instances"

    def __init__(self, routers: Sequence[Policy], *, sharing: str = "independent",
                 staleness_s: float = 0.0, spread: str = "random", seed: int = 0,
                 step_correction: bool = False) -> None:
        """``step_correction``: each view learns its instance's step time from its router's
        own token counts (:class:`~duetime.estimate.correction.StepCorrection`)."""
        if not routers:
            raise ValueError("a fleet needs at least one router")
        check_fleet_options(sharing, staleness_s, spread)
        super().__init__(seed=seed)
        self.routers = list(routers)
        self.sharing = sharing
        self.staleness_s = float(staleness_s)
        self.spread = spread
        self.step_correction = step_correction
        # the routers read their views' snapshots whatever they consume: the true instances
        # must be stepped to each decision's time for the fleet to read what happened
        self.consumes = frozenset().union(*(p.consumes for p in routers)) | {SNAPSHOT}
        self.views: list[list[RouterView]] = []
        self._cands: list[Candidates] = []
        self._ledgers: list[_Ledger] = []
        self._turn = 0
        self.sent = np.zeros(len(routers), dtype=np.int64)  # requests each router routed
        self.seen: list[int] = []   # per decision: requests the deciding router's views hold
        self.truth: list[int] = []  # ... and the true instances hold (running + waiting)

    @property
    def n(self) -> int:
        return len(self.routers)

    def seen_share(self) -> float:
        """Σ requests in the deciding router's views / Σ requests in the true instances, over
        the decisions (1 with a single router; below 1 where views miss requests)."""
        t = sum(self.truth)
        return sum(self.seen) / t if t else 1.0

    def step_factors(self) -> list[float]:
        """Per instance, the step factor its views apply at the end, averaged over the
        routers (1 each without a step correction, or before the first decision)."""
        if not self.views:
            return []
        return [float(np.mean([1.0 if vs[k].steps is None else vs[k].steps.applied
                               for vs in self.views])) for k in range(len(self.views[0]))]

    def _build(self, cands: Sequence[Candidate]) -> None:
        self.views = [[RouterView(c.name, c.view.spec,
                                  StepCorrection() if self.step_correction else None)
                       for c in cands] for _ in self.routers]
        self._cands = [Candidates(Candidate(c.name, c.model, c.price_prompt, c.price_output, v)
                                  for c, v in zip(cands, vs, strict=True))
                       for vs in self.views]
        self._ledgers = [_Ledger() for _ in cands]
        for p, vs in zip(self.routers, self.views, strict=True):
            if getattr(p, "uses_load_board", False):
                board = LoadBoard(len(vs))
                for k, v in enumerate(vs):
                    v.join_board(board, k)

    def _tell(self, k: int, sender: int, t: float, event: Known) -> None:
        """Router ``sender`` knows ``event`` about instance ``k`` at ``t``; with shared state
        the others know it ``staleness_s`` later."""
        self.views[sender][k].learn(t, event)
        if self.sharing == "shared":
            late = t + self.staleness_s
            for r, vs in enumerate(self.views):
                if r != sender:
                    vs[k].learn(late, event)

    def _read_truth(self, k: int, inst: SimInstance, t: float, router: int
                    ) -> tuple[list[str], np.ndarray] | None:
        """Tell the routers what instance ``k`` did since it was last read; return
        ``router``'s own requests there that streamed their first token by ``t`` (ids, token
        counts), to correct its view with."""
        led = self._ledgers[k]
        eng = inst.engine
        count = len(led.rids)
        if eng.num_added != count:
            raise RuntimeError("the fleet's ledger lost step with the instance")
        if led.lo == count:
            return None
        h = eng.history(last=count - led.lo)
        lo = led.lo
        first, fin = h.first_token, h.finish_time
        new = np.flatnonzero(~led.told_first[lo:count] & ~np.isnan(first))
        for j in new.tolist():
            self._tell(k, int(led.sender[lo + j]), float(first[j]), Known(FIRST, led.rids[lo + j]))
        led.told_first[lo + new] = True
        new = np.flatnonzero(~led.told_done[lo:count] & ~np.isnan(fin))
        for j in new.tolist():
            self._tell(k, int(led.sender[lo + j]), float(fin[j]),
                       Known(DONE, led.rids[lo + j], tokens=int(h.output[j])))
        led.told_done[lo + new] = True
        own = np.flatnonzero((led.sender[lo:count] == router) & (first <= t) & ~(fin <= t))
        streamed = ([led.rids[lo + j] for j in own.tolist()], h.output[own].copy())
        done = led.told_done[lo:count]
        led.lo = lo + (int(np.argmin(done)) if not done.all() else count - lo)
        return streamed if own.size else None

    def choose(self, req: RoutingRequest, cands: Sequence[Candidate], now: float) -> Decision:
        if not self.views:
            self._build(cands)
        if self.spread == "random":
            r = int(self.rng.integers(self.n)) if self.n > 1 else 0
        else:
            r, self._turn = self._turn, (self._turn + 1) % self.n
        views = self.views[r]
        streamed = [self._read_truth(k, c.view, now, r)  # type: ignore[arg-type]
                    for k, c in enumerate(cands)]
        for v, own in zip(views, streamed, strict=True):
            v.catch_up(now)
            if own is not None:
                v.correct(*own)
        self.seen.append(sum(v.num_running + v.num_waiting for v in views))
        self.truth.append(sum(c.view.num_running + c.view.num_waiting for c in cands))
        d = self.routers[r].choose(req, self._cands[r], now)
        k = d.index
        self._ledgers[k].append(req.id, r)
        self._tell(k, r, now, Known(ADD, req.id, req.prompt_tokens,
                                    int(req.output_tokens[k]), now))
        self.sent[r] += 1
        return d
