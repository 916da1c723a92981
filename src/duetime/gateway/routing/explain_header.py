"""A decision's explanation in a response: the ``x-duetime-explain`` header a request gets when
it sends ``x-duetime-explain: 1`` (the explanation itself: :mod:`duetime.policy.explain`)."""

from __future__ import annotations

import json
from typing import Any

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

