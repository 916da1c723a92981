"""vLLM keeps an idle connection longer than duetime's clients hold one (see
``tests/test_instance_keep_alive.py``): read from the vLLM the e2e servers run, in their
environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

from duetime.web.limits import INSTANCE_KEEP_ALIVE_S

from .conftest import _clean_env


def test_vllm_holds_idle_connections_longer_than_duetime(vllm_python: Path) -> None:
    out = subprocess.run(
        [str(vllm_python), "-c",
         "import vllm.envs as e; print(e.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)"],
        env=_clean_env(), capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.split()[-1]) > INSTANCE_KEEP_ALIVE_S
