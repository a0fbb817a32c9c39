"""A local disk tier as trace replay models it, below the host tier (above a remote tier).

Two ways to use a disk, as ``mode`` says:

* ``"write-through"`` (what ``prefixkv.tiers.disk_tier.DiskTier`` does): every block a request
  publishes is written once (the background writer skips blocks already there), reads and writes
  both count as uses, and the least recently used block is evicted past ``capacity``. The disk
  holds copies of blocks the device and host also hold: it survives a restart, at the price of
  capacity spent on duplicates.
* ``"exclusive"``: a victim tier of the host tier, as the host tier is of the device: blocks the
  host tier evicts fall to the disk (newest), a disk hit leaves the disk (it moves up), and the
  oldest falls off past ``capacity``. Exclusive LRU device + host + disk is then one LRU stack of
  the summed capacity.

Either way, a lookup continues on the disk past the device and host hits: blocks that continue a
prompt's chain are staged in the host tier before admission (as the real tier stages verified
blocks), and ``admit`` finds them as host hits.
"""

from __future__ import annotations

from collections import OrderedDict
from numbers import Integral
from typing import Hashable, Sequence

from ..errors import InvalidArgument
from .remote_model import RemoteModel

DISK_MODES = ("write-through", "exclusive")


class DiskModel:
    name = "disk"

    def __init__(self, capacity: int, mode: str = "write-through") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, Integral) or capacity <= 0:
            raise InvalidArgument("disk_capacity", f"must be a positive number of blocks, got {capacity!r}")
        if mode not in DISK_MODES:
            raise InvalidArgument("disk_mode", f"expected one of {', '.join(DISK_MODES)}, got {mode!r}")
        self.capacity = capacity
        self.mode = mode
        self.exclusive = mode == "exclusive"
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()
        self.fetched = 0          # blocks read into the host tier
        self.written = 0          # blocks written (write-through: new ones; exclusive: demoted ones)
        self.evictions = 0

    leading = RemoteModel.leading      # how many of hashes[start:] it holds, consecutively

    def read(self, hashes: Sequence[Hashable]) -> None:
        """``hashes`` were staged in the host tier: a use (write-through), or gone up (exclusive)."""
        blocks = self._blocks
        if self.exclusive:
            for h in hashes:
                del blocks[h]
        else:
            for h in hashes:
                blocks.move_to_end(h)
        self.fetched += len(hashes)

    def unread(self, block_hash: Hashable) -> None:
        """The host tier could not take a block just read: it stays (exclusive: back, as the newest)."""
        self.fetched -= 1
        if self.exclusive:
            self._put((block_hash,))
            self.written -= 1

    def write(self, hashes: Sequence[Hashable]) -> None:
        """Write-through: a request published ``hashes`` (or a tier below served them)."""
        if not self.exclusive:
            self._put(hashes)

    def demote(self, hashes: Sequence[Hashable]) -> None:
        """Exclusive: the host tier evicted ``hashes`` (oldest first); they fall here as the newest."""
        if self.exclusive:
            self._put(hashes)

    def _put(self, hashes) -> None:
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
