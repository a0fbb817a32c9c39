"""``BlockPool`` with its hash index in flat arrays (``FlatIndex``): same states, events and results.

The pool is ``BlockPool`` itself; what differs is its index component (``prefixkv.index``): a
``FlatIndex`` of fixed-width digests (``bytes``; a hash read back is a fresh ``bytes`` equal to
the one stored), probed by compiled loops one call per batch, and with ``CompiledLRU`` the fused
batches of ``prefixkv.flat.fused``.
"""

from __future__ import annotations

from ..pool import BlockPool
from .fused import FusedLRU
from .index import FlatIndex

# Slots keep ``block + 1`` in 32 bits.
MAX_BLOCKS = 2**32 - 2


class FlatBlockPool(BlockPool):
    """A ``BlockPool`` whose hash index is a ``FlatIndex`` of ``digest_size``-byte keys.

    ``hashes_checked``: the owner vouches that every hash it hands in is a digest of this width
    (the manager checks them; a host tier takes the device index's), which spares a check per
    hash when keys are entered."""

    def __init__(self, num_blocks: int, block_size: int, policy, *, digest_size: int = 16,
                 hashes_checked: bool = False, **kwargs) -> None:
        if kwargs.get("verify"):
            raise ValueError("verify mode keeps each block's content and reads the chain per block: "
                             "use BlockPool (index='dict')")
        if num_blocks > MAX_BLOCKS:
            raise ValueError(f"a flat index addresses at most {MAX_BLOCKS:,} blocks (32-bit slots), got "
                             f"{num_blocks:,}: use BlockPool (index='dict')")
        index = FlatIndex(digest_size)
        index.hashes_checked = hashes_checked
        super().__init__(num_blocks, block_size, policy, index=index, fused=FusedLRU.for_pool, **kwargs)
