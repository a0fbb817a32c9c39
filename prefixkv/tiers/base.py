"""The tier protocol: what the manager asks of a storage tier below the device pool.

Tiers stack: device pool (``prefixkv.pool.BlockPool``) -> host tier
(``prefixkv.tiers.host.HostTier``) -> an optional remote tier. A lookup walks a
prompt's chain of block hashes down the stack: the device answers first, and
where it misses, the tiers below are asked how far they continue the chain.

The protocol is small on purpose:

* ``name``: the tier's medium in KV events and statistics (``"CPU"`` for host
  memory, as vLLM's events name it; ``"REMOTE"`` for a shared store).
* ``synchronous``: True when ``count_leading`` and a load finish inside the
  manager's call (host memory). A tier that is not (a network store) must have
  fetched and verified a block into host staging before the manager counts it:
  ``admit()`` publishes only blocks whose bytes are already on this machine.
* ``count_leading(hashes, start) -> int``: how many consecutive hashes
  ``hashes[start], hashes[start + 1], ...`` the tier holds. One call per
  prompt, not one per block; read-only.
* ``capacity_blocks``: blocks the tier can hold (``None``: unknown, e.g. a
  server's ``maxmemory`` decides).
* ``stats() -> dict``: counters for reports (hits, stores, evictions...).

Moving bytes is the caller's: the manager records transfers as ``(src, dst)``
block pairs in lists the KV store runs (``take_demotions()`` before any write can
reuse a device block, then ``take_loads()``, then ``take_copies()``, all before
the step's writes), the same contract as copy-on-write copies.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tier(Protocol):
    name: str
    synchronous: bool

    def count_leading(self, hashes: Sequence[Hashable], start: int = 0) -> int:
        ...

    @property
    def capacity_blocks(self) -> int | None:
        ...

    def stats(self) -> dict:
        ...
