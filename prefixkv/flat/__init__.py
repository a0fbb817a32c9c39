"""The pool's hash index in flat arrays driven by compiled loops (numba), where numba is installed.

``available()`` says whether it can be used; ``prefixkv.pool.BlockPool`` stays the pool everywhere
else (and for hashes that are not fixed-width digests, such as a trace's integer ids).
"""

from __future__ import annotations

_AVAILABLE: bool | None = None


def available() -> bool:
    """numba imports here (checked once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import numba  # noqa: F401
            _AVAILABLE = True
        except Exception:       # ImportError, or a numba that does not load on this Python / numpy
            _AVAILABLE = False
    return _AVAILABLE
