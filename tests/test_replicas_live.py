"""Three ``duetime serve`` processes over the same emulated instances, sharing state through a
real ``redis-server``, against the same run with independent replicas
(``benchmarks/replicas_live.py --quick``: 80 requests at 6/s spread round-robin over the
replicas): with the store each replica's view of the instances holds the other replicas'
requests, without it none; the forecast error of both is measured and printed (the targets are
judged on the full benchmark, not in a test on a shared machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_replicas_share_their_requests_through_redis(tmp_path):
    out = tmp_path / "replicas.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/replicas_live.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {r["variant"]: r for r in json.loads(out.read_text())}
    ind, shared = by["independent"], by["shared"]
    for r in (ind, shared):  # every request answered, with a forecast and a first token
        assert r["scored"] == r["requests"] == 80 and r["errors"] == 0, r["error_samples"]
        assert 0.0 <= r["median_abs_err"] < 10.0
    assert ind["remote_seen"] == [0, 0, 0] and ind["staleness_ms"] is None
    assert all(n > 0 for n in shared["remote_seen"]), shared["remote_seen"]
    assert shared["staleness_ms"] is not None
