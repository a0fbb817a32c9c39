"""The disk tier: a persistent, verified ``DiskBlockStore`` below the host tier (extra ``torch``).

A host-local store that survives restarts and needs no server: a new process (or an engine built
again on the same directory) serves the blocks an earlier one wrote, verified, and several
processes on one host may share one directory. Prefetch, write-back and verification are
``prefixkv.tiers.store_tier``'s; the store's guarantees (atomic renames, the fsync policy, the
shared capacity bound, full or read-only disks dropping writes, refused values deleted and
counted) are ``prefixkv.tiers.disk_store``'s. Below a disk tier, a remote tier's blocks are kept on
disk too (``StoreTier.keep``), so the next restart serves them locally.
"""

from __future__ import annotations

import os

from ..checks import integer
from ..errors import InvalidArgument
from .disk_store import DiskBlockStore, DiskStoreConfig
from .store_tier import StoreTier

__all__ = ["DiskTier", "MEDIUM"]

MEDIUM = "DISK"


class DiskTier(StoreTier):
    """Blocks in ``path`` (a directory, made when missing), at most ``capacity_bytes`` of them."""

    name = MEDIUM

    def __init__(self, path, capacity_bytes: int, *, config: DiskStoreConfig | None = None, **options) -> None:
        """A tier for a manager's stack (``KVCacheManager(tiers=[HostTier(n), DiskTier(path, bytes)])``),
        opened by ``manager.tiers.bind(kv, weights=...)``. ``config``: a ``DiskStoreConfig`` (fsync
        policy, queue bounds); ``options``: ``StoreTier``'s."""
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument("path", f"expected a directory path, got {type(path).__name__}")
        if config is not None and not isinstance(config, DiskStoreConfig):
            raise InvalidArgument("config", f"expected a DiskStoreConfig, got {type(config).__name__}")
        super().__init__(**options)
        self.path = os.path.abspath(os.fspath(path))
        self.capacity_bytes = integer("capacity_bytes", capacity_bytes, low=1)
        self.config = config

    def _open_store(self, fingerprint) -> DiskBlockStore:
        return DiskBlockStore(self.path, fingerprint, self.capacity_bytes, self.config)

    def _where(self) -> dict:
        return dict(path=self.path)

    @property
    def capacity_blocks(self) -> int | None:
        return None if self.store is None else self.store.capacity_blocks()

    def __repr__(self) -> str:
        state = "unbound" if self.store is None else f"fingerprint={self.store.fingerprint.hex[:12]}…"
        return f"DiskTier({self.path!r}, {self.capacity_bytes}, {state})"
