"""Eviction policies, chosen by name.

``make_policy("lru")`` builds one; ``register("name")`` adds a class, and
third-party packages can add theirs through the ``prefixkv.policies`` entry
point group (the entry point loads the class; its key is the registry name).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from .base import EvictionPolicy, PolicyBase
from .fifo import FIFOPolicy
from .lru import LRUPolicy

ENTRY_POINT_GROUP = "prefixkv.policies"

_BUILTIN: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
}


class PolicyRegistry:
    """Name -> policy factory. One registry per process is the default; tests
    may build their own."""

    def __init__(self, builtins: dict[str, Callable[..., EvictionPolicy]]) -> None:
        self._factories = dict(builtins)
        self._entry_points_loaded = False

    def register(self, name: str, factory: Callable[..., EvictionPolicy] | None = None):
        """Register ``factory`` under ``name``; usable as a class decorator."""

        def add(cls):
            if name in self._factories and self._factories[name] is not cls:
                raise ValueError(f"eviction policy {name!r} is already registered")
            self._factories[name] = cls
            return cls

        return add if factory is None else add(factory)

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            self._factories.setdefault(ep.name, ep.load())

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._factories)

    def make(self, name: str, **options) -> EvictionPolicy:
        if name not in self._factories:
            self._load_entry_points()
        try:
            factory = self._factories[name]
        except KeyError:
            raise ValueError(
                f"unknown eviction policy {name!r}; available: {', '.join(self.names())}"
            ) from None
        return factory(**options)


REGISTRY = PolicyRegistry(_BUILTIN)
register = REGISTRY.register
make_policy = REGISTRY.make
available_policies = REGISTRY.names

__all__ = [
    "EvictionPolicy",
    "PolicyBase",
    "LRUPolicy",
    "FIFOPolicy",
    "REGISTRY",
    "register",
    "make_policy",
    "available_policies",
]
