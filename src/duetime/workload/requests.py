"""Request sets: what arrives, with everything the simulator knows about each request.

Column by column (numpy), one row per request: arrival time, task, prompt tokens, the output
length each model *would* produce, the quality each model's answer *would* get (the "truth" of
a simulation), and the TTFT target. Shared-prefix workloads (``duetime.workload.prefix``) also
say *which* tokens a prompt holds, as segments, so that a simulator can hash its KV blocks.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duetime.workload.profile import ProfileError, WorkloadProfile


@dataclass(slots=True)
class RequestSet:
    arrival: np.ndarray         # (n,) seconds
    task: np.ndarray            # (n,) task index into tasks
    prompt: np.ndarray          # (n,) tokens
    output: np.ndarray          # (n, models) tokens each model would generate
    quality: np.ndarray         # (n, models) realised quality of each model's answer, in [0, 1]
    target: np.ndarray          # (n,) TTFT target, seconds
    tasks: list[str]
    models: list[str]
    # Optional, for prefix caching (None elsewhere): per request, the segments of its prompt,
    # ((segment id, length), ...) -- equal leading segments = equal leading tokens; see
    # duetime.workload.prefix.block_hashes. The sum of a request's lengths is its prompt.
    segments: list[tuple[tuple[int, int], ...]] | None = None
    session: np.ndarray | None = None         # (n,) int64 session id, -1 if none
    # (n,) int64: the segment its output tokens form; request i's prompt + answer as model m
    # gives it is segments[i] + ((answer_segment[i], output[i, m]),)
    answer_segment: np.ndarray | None = None
    # (n,) int64: the LoRA adapter each request names (vLLM's lora_int_id, the same on every
    # instance; 0: the base model), or None: all on the base model
    adapter: np.ndarray | None = None
    # (n,) float: seconds after its arrival by which each request must have finished (its
    # end-to-end deadline; inf: none), and its time-per-output-token target (s; inf: none);
    # None: no request has one
    deadline: np.ndarray | None = None
    tpot: np.ndarray | None = None
    # (n,) int64: the tenant (client key) each request comes from, where tenants matter (the
    # simulator's admission queue is fair across them); None: one tenant
    tenant: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival)

    def head(self, n: int) -> RequestSet:
        """The first ``n`` requests (all of them if fewer), every column cut alike."""
        def cut(a):
            return None if a is None else a[:n]
        return RequestSet(self.arrival[:n], self.task[:n], self.prompt[:n], self.output[:n],
                          self.quality[:n], self.target[:n], self.tasks, self.models,
                          cut(self.segments), cut(self.session), cut(self.answer_segment),
                          cut(self.adapter), cut(self.deadline), cut(self.tpot),
                          cut(self.tenant))


def sample_requests(profile: WorkloadProfile, arrival: np.ndarray,
                    rng: np.random.Generator) -> RequestSet:
    """Requests for the given arrival times, drawn from the profile."""
    n = len(arrival)
    tasks = profile.task_names
    models = profile.model_names
    share = np.array([profile.tasks[t].share for t in tasks])
    task = rng.choice(len(tasks), size=n, p=share / share.sum())
    prompt = np.zeros(n, dtype=np.int64)
    output = np.zeros((n, len(models)), dtype=np.int64)
    quality = np.zeros((n, len(models)))
    k = profile.quality_concentration
    for ti, t in enumerate(tasks):
        idx = np.flatnonzero(task == ti)
        if not idx.size:
            continue
        spec = profile.tasks[t]
        prompt[idx] = spec.prompt.sample(rng, idx.size)
        base = spec.output.sample(rng, idx.size)  # one "natural" length per request
        for mi, m in enumerate(models):
            scale = spec.output_scale[m] * np.exp(rng.normal(0.0, 0.1, idx.size))
            output[idx, mi] = np.clip(np.rint(base * scale), 1, spec.output.hi * 2)
            mean = min(max(spec.accuracy[m], 1e-3), 1 - 1e-3)
            quality[idx, mi] = rng.beta(mean * k, (1 - mean) * k, idx.size)
    target = profile.target.sample(rng, prompt)
    for ti, t in enumerate(tasks):  # classes with their own rule (drawn after: the rest of
        rule = profile.tasks[t].target  # the stream is what it is without them)
        idx = np.flatnonzero(task == ti)
        if rule is not None and idx.size:
            target[idx] = rule.sample(rng, prompt[idx])
    return RequestSet(np.asarray(arrival, dtype=float), task, prompt, output, quality, target,
                      tasks, models)


def read_trace_text(path: Path) -> str:
    """A trace file's text; a :class:`ProfileError` naming it if it cannot be read."""
    try:
        return path.read_text()
    except OSError as e:
        raise ProfileError(f"{path}: cannot read ({e.strerror or e})") from None


TRACE_COLUMNS = ("arrival", "task", "prompt_tokens", "output_tokens", "ttft_target_ms")


def load_trace(path: str | Path, profile: WorkloadProfile,
               rng: np.random.Generator) -> RequestSet:
    """Replay a trace (CSV with a header, or JSONL). Columns / keys:

    ``arrival`` (seconds, required), ``task`` (a task of the profile, required),
    ``prompt_tokens`` (required), ``output_tokens`` (optional: the same for every model;
    else drawn from the profile), ``ttft_target_ms`` (optional: else the profile's rule),
    ``quality_<model>`` (optional: else drawn from the profile). Rows are sorted by arrival.
    """
    path = Path(path)
    text = read_trace_text(path)
    rows: list[dict] = []
    if path.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ProfileError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    else:
        rows = list(csv.DictReader(text.splitlines()))
    if not rows:
        raise ProfileError(f"{path}: no rows")
    tasks, models = profile.task_names, profile.model_names
    n = len(rows)
    base = sample_requests(profile, np.zeros(n), rng)
    arrival = np.zeros(n)
    given_target = np.zeros(n, dtype=bool)
    for i, row in enumerate(rows):
        line = f"{path}:{i + 2 if path.suffix != '.jsonl' else i + 1}"
        try:
            arrival[i] = float(row["arrival"])
            t = str(row["task"])
            if t not in tasks:
                raise ProfileError(f"{line}: task: unknown task {t!r} (profile tasks: {tasks})")
            base.task[i] = tasks.index(t)
            base.prompt[i] = int(row["prompt_tokens"])
            if base.prompt[i] < 1:
                raise ValueError("prompt_tokens must be >= 1")
            if row.get("output_tokens") not in (None, ""):
                base.output[i, :] = int(row["output_tokens"])
            if row.get("ttft_target_ms") not in (None, ""):
                base.target[i] = float(row["ttft_target_ms"]) / 1000.0
                given_target[i] = True
            for mi, m in enumerate(models):
                q = row.get(f"quality_{m}")
                if q not in (None, ""):
                    base.quality[i, mi] = float(q)
        except KeyError as e:
            raise ProfileError(f"{line}: {e.args[0]}: missing") from None
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{line}: {e}") from None
    # targets by the profile's rule, from the trace's own prompt lengths
    rule = profile.target.sample(rng, base.prompt)
    base.target = np.where(given_target, base.target, rule)
    order = np.argsort(arrival, kind="stable")
    return RequestSet(arrival[order], base.task[order], base.prompt[order], base.output[order],
                      base.quality[order], base.target[order], tasks, models)
