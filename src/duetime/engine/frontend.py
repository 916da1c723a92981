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

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


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


class FrontedEngine:
    """An engine behind a frontend, stepped forward in time: a request submitted at ``t`` is
    admitted by the frontend then and reaches the engine's waiting tail when handed over;
    each step's outputs go back through the frontend when the step makes them. A step's
    outputs are applied once time passes them (:meth:`advance` to a later time), so a request
    sent while the step runs is ahead of them at the server, as it is on a real one."""

    __slots__ = ("_first", "_handing", "_outputs", "_seq", "delivered", "ended", "engine",
                 "frontend")

    def __init__(self, engine: Any, frontend: Frontend) -> None:
        """``engine``: an :class:`~duetime.engine.engine.Engine`."""
        self.engine = engine
        self.frontend = frontend
        self.delivered: dict[str, Delivered] = {}  # requests whose last token is out
        self.ended: list[str] = []  # ... the ids delivered since a caller last took them
        # admitted, not at the engine yet: (reach, order, id, prompt, output, predicted, keys)
        self._handing: list[tuple[float, int, str, int, int, int | None, Sequence[int]]] = []
        self._seq = 0
        # steps' outputs not applied yet: (made at, ids with a token, ids finished)
        self._outputs: list[tuple[float, list[str], list[str]]] = []
        self._first: dict[str, float] = {}

    def busy_until(self) -> float:
        """When there is next something to do (inf when nothing): the engine's clock while it
        has work (a request handed over meanwhile joins at that step boundary), else the next
        hand-off; or outputs not applied yet, if sooner."""
        eng, handing = self.engine, self._handing
        t = eng.time if not eng.idle else handing[0][0] if handing else math.inf
        return min(t, self._outputs[0][0]) if self._outputs else t

    def submit(self, rid: str, prompt: int, output: int, t: float, *,
               predicted: int | None = None, hashes: Sequence[int] = (),
               lora: int = 0) -> None:
        """A request sent at ``t`` (after :meth:`advance` to ``t``; ``lora``: its adapter)."""
        reach = self.frontend.admit(rid, t)
        self._seq += 1
        heapq.heappush(self._handing, (reach, self._seq, rid, prompt, output, predicted,
                                       hashes, lora))

    def advance(self, t: float) -> None:
        """Step until the clock is at ``t`` (the last step may end after it), handing requests
        over as they reach the engine; then apply the outputs made by ``t``."""
        eng, handing = self.engine, self._handing
        while True:
            if eng.idle:
                if not handing or handing[0][0] >= t:
                    if t != math.inf:
                        eng.set_clock(t)
                    break
                eng.set_clock(handing[0][0])
            elif eng.time >= t:
                break
            while handing and handing[0][0] <= eng.time:
                reach, _, rid, prompt, output, predicted, hashes, lora = heapq.heappop(handing)
                eng.add(rid, prompt, output, predicted_output_tokens=predicted, arrival=reach,
                        hashes=hashes, lora=lora)
            ev = eng.step(tokens=True)
            if ev is not None:
                self._outputs.append((ev.outputs_at, ev.tokens, ev.finished_ids))
        self._apply(t)

    def drain(self) -> None:
        """Run until nothing is left (requests still in the frontend included)."""
        self.advance(math.inf)

    def hand_over(self, t: float) -> None:
        """Hand over now the requests that reached the engine by ``t`` and that its next step
        would take anyway (a busy engine: those that reached it by its clock; an idle one: at
        ``t``, which is then its clock), so that a forecast made at ``t`` sees them queued:
        the same steps as :meth:`advance` makes, sooner."""
        eng, handing = self.engine, self._handing
        while handing and handing[0][0] <= t:
            if eng.idle:
                eng.set_clock(max(eng.time, handing[0][0]))
            elif handing[0][0] > eng.time:
                break
            reach, _, rid, prompt, output, predicted, hashes, lora = heapq.heappop(handing)
            eng.add(rid, prompt, output, predicted_output_tokens=predicted, arrival=reach,
                    hashes=hashes, lora=lora)

    def next_event(self) -> list[tuple[str, float]]:
        """Do the next thing due (:meth:`busy_until`: a hand-off, a step, outputs to send)
        and return the requests whose last token that delivered, with when their clients got
        it (a closed loop's clients send their next request then)."""
        t = self.busy_until()
        if t == math.inf:
            return []
        self.advance(float(np.nextafter(t, math.inf)))
        got, self.ended = self.ended, []
        return [(rid, self.delivered[rid].last) for rid in got]

    def _apply(self, t: float) -> None:
        fe, first, outputs = self.frontend, self._first, self._outputs
        k = 0
        while k < len(outputs) and outputs[k][0] <= t:
            at, tokens, finished = outputs[k]
            for rid, sent in zip(tokens, fe.emit(at, tokens), strict=True):
                first.setdefault(rid, sent)
            for rid in finished:
                # (the last token's chunk: this step's, or the queued one it merged into)
                self.delivered[rid] = Delivered(first.pop(rid), fe.chunk_end(rid))
                self.ended.append(rid)
                fe.finish(rid)
            k += 1
        del outputs[:k]


def serve_trace(engine: Any, frontend: Frontend,
                sends: Sequence[tuple[str, float, int, int]]) -> dict[str, Delivered]:
    """Run requests through ``frontend`` and ``engine`` together, in time order: each request
    (``(id, sent, prompt tokens, output tokens)``, in send order) is admitted by the frontend
    when sent and reaches the engine when admitted; each step's outputs go back through the
    frontend when the step makes them (:class:`FrontedEngine`). ``engine`` (an
    :class:`~duetime.engine.engine.Engine`) is run until idle. Returns each request's first
    and last delivery."""
    fronted = FrontedEngine(engine, frontend)
    for rid, sent, prompt, output in sends:
        fronted.advance(sent)
        fronted.submit(rid, prompt, output, sent)
    fronted.drain()
    return fronted.delivered
