"""The serving frontend in front of the engine: vLLM's API server as a queue.

vLLM serves the OpenAI API from ``--api-server-count`` processes (default 1) in front of one
engine core. Each is one asyncio loop, so its Python work is serial: per request, parsing,
the chat template, tokenisation and the hand-off to the engine core (``request_s``); per
output chunk, detokenising, framing the SSE event and writing it (``chunk_s``). The engine
core runs in its own process and does not wait for it: a busy frontend delays what the client
sees, not the engine's steps. A request reaches the engine once its server has done the work
queued ahead of it and the request's own; a step's outputs reach their clients once the
server has done the work ahead and their chunks, in the engine's order. A request whose chunk
is still queued when its next token comes gets it in the same chunk (vLLM's per-request output
collector merges the deltas its consumer has not taken yet), so a server that falls behind
sends fewer, larger chunks and its backlog stays bounded by one chunk per stream.

:class:`Frontend` is that queue, exact for a deterministic cost per item: the simulator's and
the emulator's instances put it between the engine and the client, ``duetime validate``
replays traces through it. The forecasts use :meth:`FrontendModel.delay_s`, its closed form
for a request sent now. ``duetime calibrate`` measures the two costs from the API server's own
CPU counter (``process_cpu_seconds_total`` on vLLM's ``/metrics``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FrontendModel:
    """The API servers' costs: seconds of one server's work per request and per output chunk,
    and how many servers share the requests (``--api-server-count``)."""

    request_s: float = 0.0
    chunk_s: float = 0.0
    servers: int = 1

    def __post_init__(self) -> None:
        if self.request_s < 0 or self.chunk_s < 0:
            raise ValueError("request_ms and chunk_ms must be >= 0")
        if self.servers < 1:
            raise ValueError("servers must be >= 1")

    @property
    def own_s(self) -> float:
        """A lone request's own frontend work before its first token: its hand-off and its
        first chunk (part of an idle instance's request overhead)."""
        return self.request_s + self.chunk_s

    def delay_s(self, wait_s: float, streams: int) -> float:
        """Seconds a request sent now waits at the frontend beyond its own work (which the
        idle request overhead already counts): the server's backlog ``wait_s``, then, in the
        step that makes its first token, the chunks of the other ``streams`` ahead of it on its
        server (the engine lists running requests first)."""
        return max(0.0, wait_s) + self.chunk_s * streams / self.servers

    def to_dict(self) -> dict[str, Any]:
        return {"request_ms": round(self.request_s * 1000, 4),
                "chunk_ms": round(self.chunk_s * 1000, 4), "servers": self.servers}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "frontend") -> FrontendModel:
        """``where`` names the value in errors ("": none)."""
        at = f"{where}: " if where else ""
        if not isinstance(data, Mapping):
            raise ValueError(f"{at}must be a mapping (request_ms, chunk_ms, servers)")
        unknown = set(data) - {"request_ms", "chunk_ms", "servers"}
        if unknown:
            raise ValueError(f"{at}unknown key(s) {sorted(unknown)}; expected request_ms, "
                             "chunk_ms, servers")
        try:
            return cls(float(data.get("request_ms", 0.0)) / 1000.0,
                       float(data.get("chunk_ms", 0.0)) / 1000.0, int(data.get("servers", 1)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{at}{e}") from None


class Frontend:
    """The API servers over time: each a FIFO of its work, busy until ``busy[s]``.

    Callers go forward in time: :meth:`admit` a request when it is sent, :meth:`emit` each
    engine step's outputs when the step makes them, :meth:`finish` a request once its last
    token is out."""

    __slots__ = ("_chunk", "_server", "busy", "model")

    def __init__(self, model: FrontendModel, start: float = 0.0) -> None:
        self.model = model
        self.busy = [start] * model.servers
        self._server: dict[str, int] = {}
        # each stream's last chunk: (when its server starts it, when it is sent)
        self._chunk: dict[str, tuple[float, float]] = {}

    def wait_s(self, t: float) -> float:
        """The wait a request sent at ``t`` has before its server starts on it."""
        return max(0.0, min(self.busy) - t)

    def admit(self, rid: str, t: float) -> float:
        """A request sent at ``t``: it goes to the server that frees first; returns when it
        reaches the engine."""
        busy = self.busy
        s = min(range(len(busy)), key=busy.__getitem__)
        busy[s] = max(t, busy[s]) + self.model.request_s
        self._server[rid] = s
        return busy[s]

    def emit(self, t: float, rids: Sequence[str]) -> list[float]:
        """One step's outputs, made at ``t`` for ``rids`` (in the engine's order): when each
        reaches its client. A stream whose last chunk has not started yet gets the token in it."""
        busy, chunk, cost = self.busy, self._chunk, self.model.chunk_s
        out = []
        for rid in rids:
            s = self._server.get(rid, 0)
            last = chunk.get(rid)
            if last is not None and last[0] > t:  # (its chunk still waits: merged into it)
                out.append(last[1])
                continue
            start = max(t, busy[s])
            busy[s] = start + cost
            chunk[rid] = (start, busy[s])
            out.append(busy[s])
        return out

    def chunk_end(self, rid: str) -> float:
        """When the stream's last chunk so far is sent (NaN before its first)."""
        last = self._chunk.get(rid)
        return math.nan if last is None else last[1]

    def finish(self, rid: str) -> None:
        """The request's last chunk is out: forget it."""
        self._server.pop(rid, None)
        self._chunk.pop(rid, None)


@dataclass(frozen=True, slots=True)
class Delivered:
    """When a request's first and last tokens reached its client through the frontend."""

    first: float
    last: float


def serve_trace(engine: Any, frontend: Frontend,
                sends: Sequence[tuple[str, float, int, int]]) -> dict[str, Delivered]:
    """Run requests through ``frontend`` and ``engine`` together, in time order: each request
    (``(id, sent, prompt tokens, output tokens)``, in send order) is admitted by the frontend
    when sent and reaches the engine when admitted; each step's outputs go back through the
    frontend when the step makes them. ``engine`` (an :class:`~duetime.engine.engine.Engine`)
    is run until idle. Returns each request's first and last delivery."""
    import heapq

    reach: list[tuple[float, int, str, int, int]] = []  # admitted, not in the engine yet
    out: dict[str, Delivered] = {}
    first: dict[str, float] = {}
    i, n = 0, len(sends)

    def admit_until(t: float) -> None:
        nonlocal i
        while i < n and sends[i][1] <= t:
            rid, sent, prompt, output = sends[i]
            heapq.heappush(reach, (frontend.admit(rid, sent), i, rid, prompt, output))
            i += 1

    while i < n or reach or not engine.idle:
        if engine.idle:  # (nothing to step: the next admission or hand-off comes first)
            nxt = min(reach[0][0] if reach else math.inf, sends[i][1] if i < n else math.inf)
            admit_until(nxt)
            if not reach or reach[0][0] > nxt:
                continue
            engine.run_until(reach[0][0])
        admit_until(engine.time)
        while reach and reach[0][0] <= engine.time:
            t, _, rid, prompt, output = heapq.heappop(reach)
            engine.add(rid, prompt, output, arrival=t)
        ev = engine.step(tokens=True)
        if ev is None:
            continue
        admit_until(ev.outputs_at)  # (sends before the outputs are ahead of their chunks)
        done = frontend.emit(ev.outputs_at, ev.tokens)
        for rid, t in zip(ev.tokens, done, strict=True):
            first.setdefault(rid, t)
        for rid in ev.finished_ids:
            # (the last token's chunk: this step's, or the queued one it merged into)
            out[rid] = Delivered(first[rid], frontend.chunk_end(rid))
            frontend.finish(rid)
    return out
