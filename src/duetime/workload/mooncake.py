"""Mooncake (FAST'25) traces: real arrival times, lengths and prefix sharing, as segments.

The format (``kvcache-ai/Mooncake``, ``FAST25-release/traces``) is JSONL, one request a line:
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``.
Timestamps are milliseconds since the first request. Each hash id names one ``block_size``-token
block of the prompt (512 in the released traces; the last block may be partial); requests that
share an id share that block -- in the released traces, with the whole prefix before it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from duetime.workload.prefix import assemble
from duetime.workload.profile import ProfileError, WorkloadProfile
from duetime.workload.requests import RequestSet, read_trace_text
from duetime.workload.segments import TAG_BITS, TAG_MOONCAKE, TAG_MOONCAKE_ANSWER, SegmentIds

_ID_LIMIT = 1 << TAG_BITS
_BASE = TAG_MOONCAKE << TAG_BITS


def _int(row: dict, key: str, where: str, lo: int) -> int:
    if key not in row:
        raise ProfileError(f"{where}: {key}: missing")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProfileError(f"{where}: {key}: must be an integer, got {v!r}")
    if v < lo:
        raise ProfileError(f"{where}: {key}: must be >= {lo}, got {v}")
    return v


def load_mooncake_trace(path: str | Path, profile: WorkloadProfile, rng: np.random.Generator,
                        block_size: int = 512) -> RequestSet:
    """Replay a Mooncake trace. Per row: arrival = (timestamp - the earliest timestamp) / 1000
    s; one segment per hash id (id ``(4 << 56) + hash_id``, so never a generated segment's),
    ``block_size`` tokens long except the last, ``input_length - block_size * (k - 1)``;
    output length ``output_length`` for every model (0 is read as 1: every request here emits
    a first token). Task, quality and the TTFT target come from the profile, as in
    :func:`~duetime.workload.requests.load_trace`. ``session_id`` (optional, any JSON scalar)
    becomes ``session``; other keys are ignored. A bad row is a :class:`ProfileError` naming
    ``file:line`` and the field."""
    path = Path(path)
    text = read_trace_text(path)
    arrival: list[float] = []
    out: list[int] = []
    segments: list[tuple[tuple[int, int], ...]] = []
    sessions: list[int] = []
    session_ids: dict[str, int] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ProfileError(f"{where}: must be a JSON object")
        ts = row.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise ProfileError(f"{where}: timestamp: " + ("missing" if ts is None else
                               f"must be a number (ms), got {ts!r}"))
        n_in = _int(row, "input_length", where, 1)
        n_out = _int(row, "output_length", where, 0)
        ids = row.get("hash_ids")
        if not isinstance(ids, list):
            raise ProfileError(f"{where}: hash_ids: " + ("missing" if ids is None else
                               f"must be a list of integers, got {ids!r}"))
        k = -(-n_in // block_size)
        if len(ids) != k:
            raise ProfileError(f"{where}: hash_ids: {len(ids)} ids for input_length {n_in}; "
                               f"expected {k} (one per {block_size}-token block)")
        for h in ids:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < _ID_LIMIT:
                raise ProfileError(f"{where}: hash_ids: {h!r} is not an integer in [0, 2^56)")
        last = n_in - block_size * (k - 1)
        segments.append(tuple((_BASE + h, block_size if j < k - 1 else last)
                              for j, h in enumerate(ids)))
        arrival.append(float(ts))
        out.append(max(n_out, 1))
        sid = row.get("session_id")
        sessions.append(-1 if sid is None else session_ids.setdefault(json.dumps(sid),
                                                                      len(session_ids)))
    if not segments:
        raise ProfileError(f"{path}: no rows")
    t = np.array(arrival)
    answers = SegmentIds(TAG_MOONCAKE_ANSWER).take(len(segments))  # fresh, not the trace's
    return assemble(profile, rng, (t - t.min()) / 1000.0, segments, answers,
                     np.array(sessions, dtype=np.int64), np.array(out, dtype=np.int64))
