"""numba's ``njit`` when available, else a no-op decorator (the same code runs as Python).

``DUETIME_NO_JIT=1`` forces plain Python (tests use it to check the kernel's source itself).

Compiled functions are cached on disk (``cache=True``), in a folder named after a fingerprint
of this package's sources. numba invalidates a cached function when *its own* file changes,
not when a function it calls (and inlines) in another file does: after an edit of
``block_pool_kernel.py``, the kernel's cached steps ran the old pool code on the new layout and
corrupted a forecast's undo silently. A folder per fingerprint makes any edit here recompile
everything once; the folders of other fingerprints not used for a day are removed (an
installed package never changes its sources, but a working tree piled up 78 MB of them).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

try:  # pragma: no cover - which branch runs depends on the environment
    if os.environ.get("DUETIME_NO_JIT"):
        raise ImportError
    import numba

    JIT = True
except ImportError:  # pragma: no cover
    JIT = False


def _cache_dir() -> str:
    """The folder of the fingerprint of every source that compiles with this ``njit`` (the
    engine's and the predictors'): ~1 ms at import."""
    here = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=8)
    for path in sorted([*here.glob("*.py"), *(here.parent / "predict").glob("*.py")]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return str(here / "__pycache__" / f"numba-{h.hexdigest()}")


def _prune(keep: str, max_age_s: float = 86_400.0) -> None:
    """Remove the cache folders of other fingerprints untouched for ``max_age_s`` (best
    effort: another process may be using one; a removed one is only compiled again)."""
    for old in Path(keep).parent.glob("numba-*"):
        with contextlib.suppress(OSError):  # (raced with another remover)
            if str(old) != keep and time.time() - old.stat().st_mtime > max_age_s:
                shutil.rmtree(old, ignore_errors=True)


if JIT:
    _CACHE_DIR = _cache_dir()
    _prune(_CACHE_DIR)

    def njit(*args, **kwargs):
        """``numba.njit``; with ``cache=True`` the cache goes to this package's fingerprinted
        folder (numba reads its cache folder when a function is decorated; other users of
        numba in the process keep theirs)."""
        if args and callable(args[0]):
            return njit(**kwargs)(args[0])

        def decorate(f):
            if not kwargs.get("cache"):
                return numba.njit(**kwargs)(f)
            old = numba.config.CACHE_DIR
            numba.config.CACHE_DIR = _CACHE_DIR
            try:
                return numba.njit(**kwargs)(f)
            finally:
                numba.config.CACHE_DIR = old

        return decorate
else:
    def njit(*args, **kwargs):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

__all__ = ["JIT", "njit"]
