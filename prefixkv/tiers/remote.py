"""The remote tier: a shared Redis block store below the host tier (extras ``[redis]``, ``torch``).

Replicas (and a restarted process) reuse each other's prefixes through it. What every store tier
does (prefetch into the host tier, write-back after a step, verification) is
``prefixkv.tiers.store_tier``'s; this module adds the Redis store and what is particular to a
network store:

* **Failure**: every store call has 0.2 s timeouts and no retries, and a circuit breaker; while it
  is open, prefetch and write-back cost a few attribute reads and do nothing. Outputs never change:
  a block that is not fetched and verified is computed.

Replicas share only when everything in the fingerprint agrees (weights digest, dtype, dims, block
size, TP, layout, hash algorithm and seed).
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgument
from .fingerprint import model_weights_digest
from .redis_net import masked_url
from .redis_store import RedisBlockStore, RedisStoreConfig
from .store_tier import StoreTier

__all__ = ["RemoteTier", "MEDIUM", "model_weights_digest"]   # the digest: from .fingerprint, as before

MEDIUM = "REMOTE"

class RemoteTier(StoreTier):
    """A ``RedisBlockStore`` as the tier below ``manager``'s host tier, staging through ``kv.host``."""

    name = MEDIUM

    def __init__(self, store, manager=None, kv=None, *, config: RedisStoreConfig | None = None,
                 **options: Any) -> None:
        """``RemoteTier(url, config=...)``: a tier for a manager's stack, opened by
        ``manager.tiers.bind(kv, weights=...)``. ``RemoteTier(store, manager, kv)``: over a
        ``RedisBlockStore`` built for ``kv``'s blocks and ``manager``'s hashing (``connect`` does
        it), bound now. ``options``: ``StoreTier``'s (``max_prefetch_blocks``,
        ``staging_blocks``, ``max_held``)."""
        super().__init__(**options)
        if isinstance(store, str):
            if manager is not None or kv is not None:
                raise InvalidArgument("store", "RemoteTier(url) is bound later (manager.tiers.bind); to bind now "
                                               "use RemoteTier.connect(url, manager, kv, weights=...)")
            masked_url(store)
            self.url, self.config = store, config
            return
        if manager is None or kv is None:
            raise InvalidArgument("manager", "RemoteTier(store, manager, kv): a store needs its manager and KV store")
        self.url, self.config = store.url, store.config
        self._attach(store, manager, kv)

    @classmethod
    def connect(cls, url: str, manager, kv, *, weights: bytes, config: RedisStoreConfig | None = None,
                tp_rank: int = 0, tp_size: int = 1, **kwargs: Any) -> "RemoteTier":
        """A store at ``url`` (``redis://host:port/db``, ``unix:///path.sock``, ``redis+cluster://h:p,h:p``)
        for ``kv``'s blocks under ``manager``'s hashing. ``weights``: ``model_weights_digest(model)``.
        Makes no round trip (a cluster URL reads the slot map, bounded by the timeouts)."""
        return cls(url, config=config, **kwargs).bind(manager, kv, weights=weights, tp_rank=tp_rank, tp_size=tp_size)

    def _open_store(self, fingerprint) -> RedisBlockStore:
        return RedisBlockStore(self.url, fingerprint, self.config)

    def _where(self) -> dict:
        return dict(url=masked_url(self.url))

    def _down(self) -> bool:
        return self.store.topology.all_down()

    def __repr__(self) -> str:
        if self.store is None:
            return f"RemoteTier({masked_url(self.url)!r}, unbound)"
        return f"RemoteTier({masked_url(self.store.url)!r}, fingerprint={self.store.fingerprint.hex[:12]}…)"
