"""The tier protocol: what a manager's stack asks of a tier below the host tier.

Tiers stack: device pool (``prefixkv.pool.BlockPool``) -> host tier (``prefixkv.host_tier.HostTier``,
in the core: the manager drives it on every admission, eviction and release) -> the tiers below
it, top first (a disk tier, then a remote tier), each talking only to the one above it. The
manager's ``tiers`` (``prefixkv.tier_stack.TierStack``) makes exactly these calls, and nothing in
the core imports a module of this package. ``store_tier.StoreTier`` implements them over any block
store with the calls ``probe`` / ``fetch`` / ``put`` / ``flush`` / ``stats`` / ``clear`` /
``close`` (``disk_store.DiskBlockStore``, ``redis_store.RedisBlockStore``); another engine's
storage interface (batch exists / get / set of pages by key) sits on those stores too.

* ``name``: the tier's medium in statistics and KV events (``"DISK"``, ``"REMOTE"``).
* ``synchronous``: False: a lower tier never makes the manager wait; ``admit()`` only counts
  blocks whose verified bytes were staged in host memory before it.
* ``bind(manager, kv, *, weights, tp_rank, tp_size)``: open the store for ``kv``'s blocks under
  ``manager``'s hashing (the fingerprint: weights digest, dtype, dims, block size, TP, layout,
  hash algorithm and seed); refuses what cannot work before anything opens.
* ``count_leading(hashes, start) -> int``: how many consecutive hashes from ``hashes[start]``
  the tier holds: how far it continues a chain (a hint; read-only).
* ``prefetch(prompt, *, compute_last_token=True) -> int``: stage (verified) the continuation of
  ``prompt``'s chain past the device, the host tier and the tiers above, into free host blocks,
  published there only holding verified bytes; returns the blocks staged. Never raises for the
  store's trouble (a miss). ``last_staged``: (chain, start, payloads, contents) of the last one.
* ``write_back(records=None) -> int``: take the blocks published from computed KV
  (``manager.take_published()``'s records) and queue them for the store's background writer;
  never waits. ``keep(staged) -> int``: take blocks a tier below staged (``last_staged``).
* ``capacity_blocks``: blocks the tier can hold (None: unknown).
* ``stats() -> dict``, ``clear() -> int``, ``flush(timeout_s) -> bool``, ``close(flush_timeout_s)``.

Moving bytes between device and host is the caller's: the manager records transfers as
``(src, dst)`` block pairs the KV store runs (``take_demotions()`` before any write can reuse a
device block, then ``take_loads()``, then ``take_copies()``, all before the step's writes).
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tier(Protocol):
    name: str
    synchronous: bool

    def bind(self, manager, kv, *, weights: bytes, tp_rank: int = 0, tp_size: int = 1) -> "Tier":
        ...

    def count_leading(self, hashes: Sequence[Hashable], start: int = 0) -> int:
        ...

    def prefetch(self, prompt, *, compute_last_token: bool = True) -> int:
        ...

    def write_back(self, records: list | None = None) -> int:
        ...

    def keep(self, staged) -> int:
        ...

    @property
    def capacity_blocks(self) -> int | None:
        ...

    def stats(self) -> dict:
        ...

    def clear(self) -> int:
        ...

    def flush(self, timeout_s: float = 10.0) -> bool:
        ...

    def close(self, flush_timeout_s: float = 5.0) -> None:
        ...
