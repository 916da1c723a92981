"""numba's ``njit`` when available, else a no-op decorator (the same code runs as Python).

``DUETIME_NO_JIT=1`` forces plain Python (tests use it to check the kernel's source itself).
"""

from __future__ import annotations

import os

try:  # pragma: no cover - which branch runs depends on the environment
    if os.environ.get("DUETIME_NO_JIT"):
        raise ImportError
    from numba import njit

    JIT = True
except ImportError:  # pragma: no cover
    JIT = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

__all__ = ["JIT", "njit"]
