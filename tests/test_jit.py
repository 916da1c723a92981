"""The compiled functions' cache folders: one per fingerprint of the sources, old ones pruned."""

from __future__ import annotations

import os
import time

from duetime.engine import _jit


def test_old_cache_folders_of_other_fingerprints_are_removed(tmp_path) -> None:
    keep, old, recent = (tmp_path / f"numba-{x}" for x in ("keep", "old", "recent"))
    for d in (keep, old, recent):
        d.mkdir()
        (d / "f.nbi").write_bytes(b"x")
    two_days_ago = time.time() - 2 * 86_400
    for d in (keep, old):
        os.utime(d, (two_days_ago, two_days_ago))
    (tmp_path / "other").mkdir()  # not a cache folder: left alone
    os.utime(tmp_path / "other", (two_days_ago, two_days_ago))
    _jit._prune(str(keep))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["numba-keep", "numba-recent", "other"]
