"""A shared remote tier (a Redis server) as trace replay models it.

The real tier (``prefixkv.tiers.remote``) is reached through the host tier: before a
request is admitted, blocks that continue its chain past the device and host hits are
fetched from the server into host-tier blocks, where ``admit`` finds them as host hits;
after a request, every block it published is written to the server (write-through, as
the background writer does with ``SET NX``). The server keeps ``capacity`` blocks and
evicts the least recently used (``maxmemory`` with ``allkeys-lru``); reads and writes
both count as uses.
"""

from __future__ import annotations

from collections import OrderedDict
from numbers import Integral
from typing import Hashable, Sequence

from ..errors import InvalidArgument


class RemoteModel:
    name = "remote"

    def __init__(self, capacity: int) -> None:
        # A NaN capacity compares false with every size: the model would never evict.
        if isinstance(capacity, bool) or not isinstance(capacity, Integral) or capacity <= 0:
            raise InvalidArgument("capacity", f"remote capacity must be a positive number of blocks, got {capacity!r}")
        self.capacity = capacity
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()
        self.fetched = 0          # blocks read into the host tier
        self.written = 0          # blocks the server did not have, written
        self.evictions = 0

    def leading(self, hashes: Sequence[Hashable], start: int) -> int:
        """How many of ``hashes[start:]`` the server holds, consecutively (one probe)."""
        blocks = self._blocks
        n = 0
        for h in hashes[start:]:
            if h not in blocks:
                break
            n += 1
        return n

    def read(self, hashes: Sequence[Hashable]) -> None:
        move = self._blocks.move_to_end
        for h in hashes:
            move(h)
        self.fetched += len(hashes)

    def unread(self, block_hash: Hashable) -> None:
        """The host tier could not take a block just read."""
        self.fetched -= 1

    def write(self, hashes: Sequence[Hashable]) -> None:
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
                continue
            blocks[h] = None
            self.written += 1
            if len(blocks) > self.capacity:
                blocks.popitem(last=False)
                self.evictions += 1
