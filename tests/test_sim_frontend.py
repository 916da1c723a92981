"""The simulator with an API server in front of its instances (engine/frontend.py): without
one nothing changes; with one, each instance's requests go through the exact queue (the same
times as the trace replay through frontend and engine), the estimators see its backlog, and
closed loops and retries run through it (a client sends its next request when the last chunk
of its previous answer is sent)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from duetime.engine import Engine
from duetime.engine.frontend import Frontend, FrontendModel, serve_trace
from duetime.estimate import SfsEstimator
from duetime.estimate.base import forecaster_of
from duetime.estimate.sfs import frontend_delay
from duetime.experiments.runner import Point, Runner
from duetime.policy import make_policy
from duetime.sim import ClusterSim
from duetime.workload import load_workload

PROF = load_workload("paper")
SLOW = FrontendModel(request_s=0.004, chunk_s=0.0005)


def _with_frontend(prof, fm):
    return replace(prof, models={m: replace(s, frontend=fm) for m, s in prof.models.items()})


def _requests(n: int = 300, rate: float = 8.6):
    return Runner(PROF, seed=0).requests(Point("sfs", rate, n))


def test_each_instance_s_clients_see_the_exact_queue():
    reqs = _requests()
    prof = _with_frontend(PROF, SLOW)
    policy = make_policy("round-robin", {}, defaults={"lambda": PROF.lam})
    res = ClusterSim(prof, policy, seed=0).run(reqs)
    plain = ClusterSim(PROF, make_policy("round-robin", {}, defaults={"lambda": PROF.lam}),
                       seed=0).run(reqs)
    assert np.array_equal(res.instance, plain.instance)  # (round robin: the same split)
    models = PROF.model_names
    for k, (_, model) in enumerate(PROF.instance_pairs()):
        mine = np.flatnonzero(res.instance == k)
        mi = models.index(model)
        spec = prof.models[model]
        sends = [(str(i), float(reqs.arrival[i]), int(reqs.prompt[i]), int(reqs.output[i, mi]))
                 for i in mine.tolist()]
        got = serve_trace(Engine(spec.config, spec.batch_time, time=sends[0][1]),
                          Frontend(SLOW), sends)
        assert res.first_token[mine] == pytest.approx([got[s[0]].first for s in sends])
        assert res.finish[mine] == pytest.approx([got[s[0]].last for s in sends])
    # the frontend only delays what the clients see
    assert np.all(res.ttft >= plain.ttft - 1e-9)
    assert np.median(res.ttft - plain.ttft) >= SLOW.own_s - 1e-9


class _WithoutQueue:
    """SFS's forecast less what its frontend term adds (a shadow estimator)."""

    name = "sfs-without-queue"

    def __init__(self) -> None:
        self.sfs = SfsEstimator()

    def ttft(self, view, prompt_tokens, now, *, hashes=None):
        return (self.sfs.ttft(view, prompt_tokens, now, hashes=hashes)
                - frontend_delay(view, forecaster_of(view), now))


def test_sfs_counts_the_queue():
    """SFS's forecasts on a pool whose API servers queue (chunks of tens of streams per step)
    are closer to what the clients see than the same forecasts without the queue (median
    |error| measured at 8.6 and 12 q/s: 7.6-9.5% with it)."""
    reqs = _requests(400, rate=12.0)
    prof = _with_frontend(PROF, SLOW)
    res = ClusterSim(prof, make_policy("sfs", {}, defaults={"lambda": PROF.lam}), seed=0,
                     shadow_estimators=(_WithoutQueue(),)).run(reqs)
    ok = np.isfinite(res.forecast)
    err = np.median(np.abs(res.forecast[ok] / res.ttft[ok] - 1))
    without = np.median(np.abs(res.shadow["sfs-without-queue"][ok] / res.ttft[ok] - 1))
    print(f"median |error| {err:.3f} with the queue, {without:.3f} without")
    assert err < 0.2 and err < without, (err, without)


@pytest.mark.parametrize("policy", ["round-robin", "sfs"])
def test_a_closed_loop_through_a_free_frontend_is_the_closed_loop_without_one(policy):
    """A frontend that costs nothing hands each request over at once and sends each token
    when it is made: the same run as without one, step for step."""
    reqs = _requests(200)
    free = _with_frontend(PROF, FrontendModel(0.0, 0.0))

    def run(prof):
        return ClusterSim(prof, make_policy(policy, {}, defaults={"lambda": PROF.lam}),
                          seed=0).run(reqs, closed_loop=6)

    got, want = run(free), run(PROF)
    assert np.array_equal(got.instance, want.instance)
    assert got.requests.arrival == pytest.approx(want.requests.arrival)
    assert got.first_token == pytest.approx(want.first_token)
    assert got.finish == pytest.approx(want.finish)


def test_a_closed_loop_client_waits_for_its_last_chunk():
    """Behind a slow frontend each client sends its next request when its previous answer's
    last chunk is out: with one client, every send is the previous request's delivered end
    (which the frontend makes later than without it), and each request's times are those of
    the trace replay through frontend and engine."""
    reqs = _requests(60)
    prof = _with_frontend(PROF, SLOW)
    res = ClusterSim(prof, make_policy("round-robin", {}, defaults={"lambda": PROF.lam}),
                     seed=0).run(reqs, closed_loop=1)
    sent = res.requests.arrival
    assert sent[1:] == pytest.approx(res.finish[:-1])
    plain = ClusterSim(PROF, make_policy("round-robin", {}, defaults={"lambda": PROF.lam}),
                       seed=0).run(reqs, closed_loop=1)
    assert res.finish[-1] > plain.finish[-1] + 60 * SLOW.own_s - 1e-9
    models = PROF.model_names
    for k, (_, model) in enumerate(PROF.instance_pairs()):
        mine = np.flatnonzero(res.instance == k)
        mi = models.index(model)
        spec = prof.models[model]
        sends = [(str(i), float(sent[i]), int(reqs.prompt[i]), int(reqs.output[i, mi]))
                 for i in mine.tolist()]
        got = serve_trace(Engine(spec.config, spec.batch_time, time=sends[0][1]),
                          Frontend(SLOW), sends)
        assert res.finish[mine] == pytest.approx([got[s[0]].last for s in sends])


def test_retries_run_through_the_frontend():
    """``run_retries`` behind a frontend: an attempt ends for its client with its delivered
    last chunk. One client, so every attempt runs alone and the same attempts are made: each
    takes at least its hand-off and first chunk longer than without the frontend."""
    from duetime.sim.retry import run_retries

    n = 30
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 1000, n)
    models = {m: PROF.models[m] for m in PROF.model_names}
    output = rng.integers(20, 200, (n, len(models)))
    correct = rng.random((n, len(models))) < 0.6
    success = np.full((n, len(models)), 0.6)

    def run(ms):
        return run_retries(ms, make_policy("round-robin", {}, defaults={"lambda": PROF.lam}),
                           prompt, output, correct, success, clients=1, task="kv",
                           retry_cap=3, seed=0)

    slow = run({m: replace(s, frontend=SLOW) for m, s in models.items()})
    plain = run(models)
    assert sum(len(a) for a in slow.attempts) > n  # (some answers were wrong: retried)
    for a, b in zip(slow.attempts, plain.attempts, strict=True):
        assert [(x[0], x[2]) for x in a] == [(x[0], x[2]) for x in b]
        for (_, t_slow, _), (_, t_plain, _) in zip(a, b, strict=True):
            assert t_slow >= t_plain + SLOW.own_s - 1e-9


def test_duetime_simulate_frontend(tmp_path, capsys):
    """``duetime simulate --frontend REQ_MS,CHUNK_MS``: every instance behind an API server
    (a slower TTFT than without); a bad value or a closed loop: a one-line error."""
    import json

    from duetime.cli import main

    def mean_ttft(*extra: str) -> float:
        out = tmp_path / "_".join(extra or ("plain",))
        assert main(["simulate", "--policy", "round-robin", "--rate", "8", "--requests",
                     "300", "--out", str(out), *extra]) == 0
        return json.loads((out / "summary.json").read_text())["mean_ttft_s"]

    assert mean_ttft("--frontend", "4,0.5") > mean_ttft() + 0.004
    assert main(["simulate", "--policy", "sfs", "--clients", "4", "--requests", "60",
                 "--frontend", "4,0.5", "--out", str(tmp_path / "closed")]) == 0
    for bad, says in ((["--frontend", "4"], "expected REQ_MS,CHUNK_MS[,N]"),):
        assert main(["simulate", "--policy", "sfs", "--requests", "10", "--rate", "1",
                     "--out", str(tmp_path / "x"), *bad]) != 0
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
