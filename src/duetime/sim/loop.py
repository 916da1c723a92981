"""The simulator's one closed-loop event loop.

Clients send requests; a request's end may make its client send another one (its next
request, or a retry of the same one: the ``finished`` hook decides). The busy instance with the
earliest clock steps next; a pending send at ``t`` is dispatched once every busy instance has
reached ``t`` (idle instances' clocks jump to it), so routing sees every instance as it is at
``t``. Sends at the same time go out in the order they were made. Behind a frontend
(``SimInstance.fronted``) an instance's next thing may also be a hand-off or a step's outputs
to send, and a request ends for its client when its last chunk is sent.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from duetime.sim.instance import SimInstance


def run_clients(insts: Sequence[SimInstance], sends: Iterable[tuple[float, Any]],
                dispatch: Callable[[float, Any], Iterable[tuple[float, Any]] | None],
                finished: Callable[[str, float], Iterable[Any]],
                first_token: Callable[[str, float], Iterable[Any]] | None = None) -> None:
    """Run until no send is pending and every instance is idle.

    ``sends``: the first sends, (time, item). ``dispatch(t, item)`` routes and queues one
    request at ``t`` (every instance's ``now`` is ``t``); it may return more sends, (time,
    item), at ``t`` or later (a timer). ``finished(request_id, t)`` is called for each request
    that ends at ``t`` and yields the items its client sends at ``t``; ``first_token``, where
    given, likewise for each first token (of an instance without a frontend)."""
    heap = [(t, k, item) for k, (t, item) in enumerate(sends)]
    heapq.heapify(heap)
    seq = len(heap)
    while True:
        busy = [i for i in insts if i.busy_until() < math.inf]
        if not heap and not busy:
            return
        horizon = min((i.busy_until() for i in busy), default=math.inf)
        if heap and heap[0][0] <= horizon:
            t, _, item = heapq.heappop(heap)
            for inst in insts:
                if inst.engine.idle:
                    inst.engine.advance_clock(t)
                inst.now = t
            for at, more in dispatch(t, item) or ():
                heapq.heappush(heap, (at, seq, more))
                seq += 1
            continue
        nxt = min(busy, key=lambda i: i.busy_until())
        if nxt.fronted is not None:
            ended = nxt.fronted.next_event()
        else:
            step = nxt.engine.step()
            # (asynchronous scheduling: the outputs are the previous step's, made at its start)
            ended = [(rid, step.outputs_at) for rid in step.finished_ids] if step else []
            if step and first_token is not None:
                for rid in step.first_token_ids:
                    for item in first_token(rid, step.outputs_at):
                        heapq.heappush(heap, (step.outputs_at, seq, item))
                        seq += 1
        for rid, at in ended:
            for item in finished(rid, at):
                heapq.heappush(heap, (at, seq, item))
                seq += 1
