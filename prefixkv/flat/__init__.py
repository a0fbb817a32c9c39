"""The pool's hash index in flat arrays driven by compiled loops (numba), where numba is installed.

``available()`` says whether it can be used; ``prefixkv.pool.BlockPool`` stays the pool everywhere
else (and for hashes that are not fixed-width digests, such as a trace's integer ids).
"""

from __future__ import annotations

_AVAILABLE: bool | None = None


def available() -> bool:
    """numba and the compiled loops import here (checked once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import numba  # noqa: F401

            from . import kernels  # noqa: F401  (decorating them can fail where numba imports)
            _AVAILABLE = True
        except Exception:       # ImportError, or a numba that does not load on this Python / numpy
            _AVAILABLE = False
    return _AVAILABLE


def make_policy(policy):
    """The policy a flat pool runs for ``policy`` (a registry name or a policy object): ``"lru"`` by
    name is ``CompiledLRU`` (the same order, kept in arrays); anything else as the registry makes it."""
    if policy == "lru":
        from .lru import CompiledLRU
        return CompiledLRU()
    from ..policies.registry import make_policy as by_name
    return by_name(policy) if isinstance(policy, str) else policy
