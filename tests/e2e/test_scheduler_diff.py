"""The engine schedules exactly as vLLM's own scheduler (the installed vLLM 0.32, driven without
a model by ``vllm_scheduler.py``): seeded random cases across budgets, sequence caps,
thresholds, tight and ample KV, full-sequence admission on and off, watermarks and arrivals
over time, plus the targeted cases of each rule (``scheduler_diff.targeted``). Every case must
agree step for step: scheduled tokens per request in order, preemption victims in order, first
tokens, finishes, and how the run ended. ``python tests/e2e/scheduler_diff.py`` prints the
same counts for other seeds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .scheduler_diff import cases, compare, preemptions, run_engine, run_vllm, targeted

SEED = 0
RANDOM_CASES = 360
MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_engine_schedules_as_vllm(vllm_python: Path, mode: str) -> None:
    asynchronous = mode == "async"
    batch = (cases(SEED, RANDOM_CASES, asynchronous=asynchronous)
             + targeted(asynchronous=asynchronous))
    wants = run_vllm(vllm_python, batch)
    assert len(wants) == len(batch)
    diffs = []
    for case, want in zip(batch, wants, strict=True):
        why = compare(want, run_engine(case))
        if why:
            diffs.append(f"{case['name']}: {why}")
    # the cases exercise what they are for: preemptions, stuck queues, long runs
    assert sum(preemptions(w) for w in wants) > 100
    ends = [w["end"] for w in wants]
    assert ends.count("stuck") >= 3 and ends.count("done") > len(batch) // 3
    assert not diffs, f"{len(diffs)} of {len(batch)} cases differ:\n" + "\n".join(diffs[:10])
