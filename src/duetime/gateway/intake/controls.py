"""The client's per-request controls, read from its headers (400 with an OpenAI error body on a
bad value):

========================  ==============================================================
``x-duetime-ttft-ms``     the TTFT target (else llm-d's ``x-slo-ttft-ms`` or
                          ``x-llm-d-slo-ttft-ms``, SGLang's ``x-sgl-ttft-slo-ms``; else the
                          pool's rule for the prompt's length)
``x-duetime-tpot-ms``     a time-per-output-token target (else llm-d's ``x-slo-tpot-ms`` or
                          ``x-llm-d-slo-tpot-ms``; SGLang's ``x-sgl-tps-slo``, tokens per
                          second, is its inverse): counted, and ``sfs-deadline`` routes on it
``x-duetime-deadline-ms`` an end-to-end deadline from arrival to the last token (else the
                          pool's ``deadline`` rule; none by default): ``sfs-deadline``
``x-duetime-priority``    ``critical``, ``standard`` (default) or ``sheddable``
``x-duetime-attempted``   models already tried for this question (the retry contract)
``x-session-id``          the session (session affinity)
``x-duetime-task``        the task whose quality table applies
``x-duetime-explain``     1: the decision's explanation in the response's header
``x-duetime-policy``      another registered policy for this request
``x-duetime-lambda``      its lambda (>= 0)
========================  ==============================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duetime.gateway.config import Pool
from duetime.policy import policy_names
from duetime.web.asgi import Scope, header
from duetime.web.errors import ApiError, number_in

PRIORITIES = ("critical", "standard", "sheddable")
MEAN_TASK = "*"  # no task given and no default: each model's mean quality over the tasks


@dataclass(slots=True)
class Controls:
    """The client's per-request controls: TTFT target, models already attempted, session,
    task; its priority, time-per-output-token target and who it is (for fairness among queued
    requests); whether it wants the decision explained, and another policy or lambda."""

    target_s: float
    attempted: frozenset[str]
    session: str | None
    task: str
    priority: str = "standard"
    tpot_target_s: float | None = None
    deadline_s: float | None = None  # from arrival to the last token (None: none)
    client: str = ""
    explain: bool = False
    policy: str | None = None
    lam: float | None = None


def milliseconds(scope: Scope, name: bytes) -> float | None:
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


def _first_ms(scope: Scope, names: tuple[bytes, ...]) -> float | None:
    """The first of these headers that is present, in milliseconds (400 on a bad value)."""
    for name in names:
        ms = milliseconds(scope, name)
        if ms is not None:
            return ms
    return None


def _tpot_ms(scope: Scope) -> float | None:
    """The time-per-output-token target (ms): ours, llm-d's, or SGLang's tokens per second."""
    ms = _first_ms(scope, (b"x-duetime-tpot-ms", b"x-slo-tpot-ms", b"x-llm-d-slo-tpot-ms"))
    if ms is not None:
        return ms
    raw = header(scope, b"x-sgl-tps-slo")
    if raw is None:
        return None
    tps = number_in(raw, 1e-3, 1e6, param="x-sgl-tps-slo", code="invalid_header")
    return 1000.0 / tps


def _priority(scope: Scope) -> str:
    priority = header(scope, b"x-duetime-priority")
    if priority is None:
        return "standard"
    if priority.strip().lower() in PRIORITIES:
        return priority.strip().lower()
    raise ApiError(400, f"x-duetime-priority must be one of {', '.join(PRIORITIES)}, "
                   f"got {priority[:40]!r}", param="x-duetime-priority", code="invalid_header")


def _attempted(scope: Scope) -> frozenset[str]:
    raw = header(scope, b"x-duetime-attempted")
    if raw is None or not raw.strip():
        return frozenset()
    names = [n.strip() for n in raw.split(",")]
    if any(not n for n in names) or len(names) > 100:
        raise ApiError(400, f"x-duetime-attempted must be a comma-separated list of model "
                       f"names, got {raw!r}", param="x-duetime-attempted",
                       code="invalid_header")
    return frozenset(names)


def _task(scope: Scope, tasks: list[str], default: str) -> str:
    task = header(scope, b"x-duetime-task")
    if task is None:
        return default
    if task not in tasks:
        raise ApiError(400, f"x-duetime-task: unknown task {task!r}; known: "
                       f"{', '.join(tasks)}", param="x-duetime-task", code="invalid_header")
    return task


def _policy(scope: Scope) -> tuple[str | None, float | None]:
    """``x-duetime-policy`` (a registered policy's name) and ``x-duetime-lambda`` (its
    lambda, >= 0)."""
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


def read_controls(scope: Scope, pool: Pool, prompt_tokens: int, *, client: str,
                  output_tokens: int | None = None) -> Controls:
    """The request's controls from its headers (``client``: who sends it, for fairness;
    ``output_tokens``: its ``max_tokens``, for the pool's deadline rule)."""
    task = _task(scope, list(pool.quality), pool.default_task or MEAN_TASK)
    target_ms = _first_ms(scope, (b"x-duetime-ttft-ms", b"x-slo-ttft-ms",
                                  b"x-llm-d-slo-ttft-ms", b"x-sgl-ttft-slo-ms"))
    if target_ms is None:
        target_ms = pool.target_ms(prompt_tokens, task)
    tpot_ms = _tpot_ms(scope)
    deadline_ms = milliseconds(scope, b"x-duetime-deadline-ms")
    if deadline_ms is None:
        deadline_ms = pool.deadline_ms(prompt_tokens,
                                       output_tokens or pool.default_output_tokens, task)
    priority = _priority(scope)
    attempted = _attempted(scope)
    session = header(scope, b"x-session-id") or None
    explain = (header(scope, b"x-duetime-explain") or "").strip().lower() in ("1", "true", "yes")
    policy, lam = _policy(scope)
    return Controls(target_ms / 1000.0, attempted, session, task, priority,
                    None if tpot_ms is None else tpot_ms / 1000.0,
                    None if deadline_ms is None else deadline_ms / 1000.0, client, explain,
                    policy, lam)
