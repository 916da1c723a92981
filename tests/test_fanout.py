"""Simulations fanned out (duetime.experiments.fanout): a plan's schedule and the experiments'
points, over local processes and over a real Ray cluster (a head started on loopback by the
test, stopped after it), the same results as a serial run."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from duetime.cli import main
from duetime.experiments.catalog import run_experiment
from duetime.experiments.fanout import Fanout
from duetime.plan.problem import problem_from_dict
from duetime.plan.schedule import plan_schedule
from duetime.plan.search import search
from redis_server import free_port

MEASURED = ["qwen3-0.6b@h100", "qwen3-8b@h100", "qwen3-32b@h100x2"]


def _problem(tmp_path: Path):
    """A small plan of four intervals, written as plan.yaml in ``tmp_path`` (for the CLI)."""
    (tmp_path / "rates.csv").write_text("start_s,rate\n0,1\n600,3\n1200,6\n1800,2\n")
    data = {"options": MEASURED, "max_replicas": 3, "requests": 400, "max_requests": 800,
            "schedule": {"trace": "rates.csv"},
            "constraints": {"on_time": 0.95, "quality": 0.8}}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    return problem_from_dict(data, "plan.yaml", tmp_path)


def _result(sched) -> list:
    """What a schedule decided: every level's search, as data (wall times left out)."""
    return [(lv, None if r.best is None else r.best.as_dict(), r.simulations,
             sorted(o.as_dict()["cost_per_hour"] for o in r.outcomes))
            for lv, r in sorted(sched.levels.items())]


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serial")
    return _result(plan_schedule(_problem(tmp), fanout=Fanout(1)))


def test_local_processes_give_the_serial_results(serial, tmp_path):
    got = _result(plan_schedule(_problem(tmp_path), fanout=Fanout(2)))
    assert got == serial and len(got) >= 3


def test_a_fanout_keeps_the_order_of_its_inputs():
    assert Fanout(2).map(pow, [(2, k) for k in range(6)]) == [2 ** k for k in range(6)]
    with pytest.raises(ValueError, match="workers"):
        Fanout(0)


def test_imap_yields_in_order_and_draws_items_only_as_calls_can_start():
    drawn = []

    def items():
        for k in range(100):
            drawn.append(k)
            yield (3, k)

    for fanout in (Fanout(1), Fanout(2)):
        drawn.clear()
        with fanout.pool() as workers:
            got = []
            for x in workers.imap(pow, items(), ahead=3):
                got.append(x)
                if len(got) == 5:
                    break
        assert got == [3 ** k for k in range(5)]
        assert len(drawn) <= 5 + 3  # the consumed ones and at most `ahead` beyond


def _search_result(r):
    return None if r.best is None else r.best.as_dict()


@pytest.fixture(scope="module")
def one_rate(tmp_path_factory):
    """A single-rate plan whose search simulates several pools, and its serial answer."""
    p = problem_from_dict({"rate": 6.0, "options": MEASURED, "max_replicas": 3,
                           "requests": 400, "max_requests": 800,
                           "constraints": {"on_time": 0.95, "quality": 0.8}})
    serial = search(p, fanout=Fanout(1))
    assert serial.best is not None and serial.simulations >= 3
    return p, _search_result(serial)


def test_a_search_on_local_processes_finds_the_serial_pool(one_rate):
    p, serial = one_rate
    assert _search_result(search(p, fanout=Fanout(2))) == serial


class RayHead:
    """``ray start --head`` on loopback with its own temporary folder; ``ray stop`` after."""

    def __init__(self) -> None:
        self.ray = Path(sys.executable).parent / "ray"
        if not self.ray.exists():  # (a failure, not a skip: the [test] extra installs Ray)
            pytest.fail("ray is not installed in the test venv: pip install -e '.[test]'")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # (short: Ray's unix sockets live under it and their paths are limited to ~107 bytes)
        self.temp = tempfile.mkdtemp(prefix="dtray", dir="/tmp")
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}

    def start(self) -> None:
        subprocess.run([str(self.ray), "start", "--head", "--node-ip-address", "127.0.0.1",
                        "--port", str(self.port), "--num-cpus", "2",
                        "--include-dashboard", "false", "--disable-usage-stats",
                        "--temp-dir", self.temp], check=True, env=self.env, timeout=180,
                       capture_output=True)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        subprocess.run([str(self.ray), "stop"], env=self.env, timeout=120, capture_output=True)
        shutil.rmtree(self.temp, ignore_errors=True)


def _outputs(out: Path) -> tuple[dict, list[dict]]:
    """An experiment's summary.json and results.csv as data, less what a clock measured."""
    def untimed(x):
        if isinstance(x, dict):
            return {k: untimed(v) for k, v in x.items()
                    if k not in ("wall_s", "realtime_factor") and "decision_us" not in k}
        return [untimed(v) for v in x] if isinstance(x, list) else x

    with open(out / "results.csv") as f:
        rows = [untimed(r) for r in csv.DictReader(f)]
    return untimed(json.loads((out / "summary.json").read_text())), rows


@pytest.mark.parametrize("name", ["estimators", "ttca"])
def test_an_experiment_on_local_processes_gives_the_serial_results(name, tmp_path):
    # estimators: points with given streams, kept results and shadow estimators; ttca: the
    # retry runs (not points) fanned out
    for label, fanout in (("serial", Fanout(1)), ("local", Fanout(2))):
        run_experiment(name, tmp_path / label, quick=True, log=lambda m: None, fanout=fanout)
    serial, local = _outputs(tmp_path / "serial"), _outputs(tmp_path / "local")
    assert local == serial and len(serial[1]) >= 2


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead()
    t0 = time.monotonic()
    try:
        head.start()
        yield head
    finally:
        head.stop()
    assert time.monotonic() - t0 < 400


def test_a_ray_cluster_gives_the_serial_schedule(serial, one_rate, ray_head, tmp_path):
    got = _result(plan_schedule(_problem(tmp_path), fanout=Fanout(ray=ray_head.address)))
    assert got == serial
    p, one = one_rate  # and one rate's search
    assert _search_result(search(p, fanout=Fanout(ray=ray_head.address))) == one
    # and through the command line
    out = tmp_path / "day"
    assert main(["plan", str(tmp_path / "plan.yaml"), "--ray", ray_head.address,
                 "--out", str(out)]) == 0
    serial_csv = tmp_path / "serial"
    assert main(["plan", str(tmp_path / "plan.yaml"), "--workers", "1",
                 "--out", str(serial_csv)]) == 0
    assert (out / "schedule.csv").read_text() == (serial_csv / "schedule.csv").read_text()


def test_a_sweep_on_a_ray_cluster_equals_the_serial_sweep(ray_head, tmp_path):
    for label, how in (("ray", ["--ray", ray_head.address]), ("serial", ["--workers", "1"])):
        assert main(["experiment", "load-sweep", "--quick", "--out", str(tmp_path / label),
                     *how]) == 0
    serial, on_ray = _outputs(tmp_path / "serial"), _outputs(tmp_path / "ray")
    assert on_ray == serial and len(serial[1]) == 42


def test_an_unreachable_ray_head_is_a_one_line_error(tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["experiment", "demo", "--quick", "--ray", f"127.0.0.1:{free_port()}",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ray: no Ray head answers at 127.0.0.1:" in err
    assert time.monotonic() - t0 < 60
