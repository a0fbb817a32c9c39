"""The host tier: a pool of host-memory blocks with its own prefix-hash index and policy.

It is one pool for two uses, so ``num_host_blocks`` means one thing everywhere:

* swap space: a swapped-out sequence holds host blocks (refcount 1) until it is
  swapped back in; with caching on, its full blocks are also published, so a
  preemption by swap feeds the cache;
* a cache: a block evicted from the device is *demoted* here (it becomes an
  evictable cached block of this pool, ordered by its own eviction policy) and a
  later lookup that continues past the device hits finds it; a hit *promotes*
  it back to the device. Exclusive by default (a promoted block leaves the host
  tier once its copy has run); ``inclusive=True`` keeps it.

The pool is a ``BlockPool``, so every registered policy orders it and the same
conservation holds: active (swap-held or pinned for a load) + evictable cached
+ free uncached = ``num_blocks``. Nothing here moves bytes; the manager records
``(device, host)`` / ``(host, device)`` pairs for the KV store to run.
"""

from __future__ import annotations

from itertools import compress
from typing import Hashable, Sequence

import numpy as np

from .checks import integer
from .copies import BlockCopies
from .errors import InvalidArgument
from .events import BlockStored
from .policies.registry import make_policy
from .pool import BlockPool

MEDIUM = "CPU"


class HostTier:
    name = MEDIUM
    synchronous = True

    def __init__(self, num_blocks: int, block_size: int | None = None, *, policy="lru", cache: bool = True,
                 inclusive: bool = False, record_events: bool = False, digest_size: int | None = None) -> None:
        """``cache=False`` keeps today's swap-only host space: nothing is published or found here.
        ``block_size=None``: a tier for a manager's stack (``KVCacheManager(tiers=[HostTier(n)])``),
        whose pool the manager builds for its own block size, index and event stream; given, the
        pool is built now. ``digest_size``: the device pool keeps a flat index of digests this wide
        (``prefixkv.flat``), so this pool does too; None: a dict index, as the device's."""
        num_blocks = integer("num_blocks", num_blocks, low=1)
        if isinstance(policy, str):
            if policy == "belady":
                raise InvalidArgument("host_policy", "the belady policy (MIN) needs every block's next use: "
                                                     "it cannot order a host tier")
            make_policy(policy)       # an unknown name or bad options fail here, before anything is built
        elif getattr(policy, "pool", None) is not None:
            raise InvalidArgument("host_policy", f"this {type(policy).__name__} object already serves another "
                                                 "pool; give the host tier a fresh one or a name")
        self.num_blocks = num_blocks
        self.policy = policy
        self.cache = cache
        self.inclusive = inclusive
        self.pool = None
        self.stores = 0            # demotions written here
        self.dropped = 0           # demotions refused: every host block held by swapped sequences
        self.hits = 0              # blocks promoted from here
        if block_size is not None:
            self.build(block_size, record_events=record_events, digest_size=digest_size)

    def build(self, block_size: int, *, record_events: bool = False, digest_size: int | None = None,
              enable_caching: bool = True) -> None:
        """Build the pool (once): the manager calls this for a tier it was given unbuilt."""
        if self.pool is not None:
            raise InvalidArgument("tiers", "this HostTier already has a pool (it serves another manager): "
                                           "give each manager a HostTier of its own")
        policy = self.policy
        if digest_size is None:
            policy = make_policy(policy) if isinstance(policy, str) else policy
            self.pool = BlockPool(self.num_blocks, block_size, policy, record_events=record_events, medium=MEDIUM)
        else:
            from . import flat
            from .flat.pool import FlatBlockPool
            # its hashes come from the device's index (demoted, or swapped out): checked already
            self.pool = FlatBlockPool(self.num_blocks, block_size, flat.make_policy(policy), digest_size=digest_size,
                                      hashes_checked=True, record_events=record_events, medium=MEDIUM)
        self.cache = self.cache and enable_caching

    # -- questions -----------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.pool.lookup(block_hash) if self.cache else None

    def count_leading(self, hashes: Sequence[Hashable], start: int = 0) -> int:
        if not self.cache:
            return 0
        return len(self.pool.leading_hits(hashes, start, len(hashes)))

    def stats(self) -> dict:
        pool = self.pool
        return dict(capacity=pool.num_blocks, active=pool.num_active, cached=pool.num_evictable,
                    free=pool.num_free_uncached, stores=self.stores, dropped=self.dropped, hits=self.hits,
                    evictions=pool.evictions)

    # -- promotion -----------------------------------------------------------
    def pin(self, blocks: list[int], *, distinct: bool = False, tags=None) -> None:
        """Hold blocks a load will read, so no demotion overwrites them before it has run.
        Exclusive: their hashes leave this tier now (the device holds them from the admission
        on); inclusive: they stay cached here. ``distinct``: no block is listed twice (a prefix
        match's blocks); ``tags``: a flat index's tags of their keys, when the caller has them."""
        if self.inclusive:
            self.pool.acquire_hits(blocks, distinct=distinct)
        elif tags is not None:
            self.pool.take_cached(blocks, distinct=distinct, tags=tags)
        else:
            self.pool.take_cached(blocks, distinct=distinct)
        self.hits += len(blocks)

    def unpin(self, blocks: Sequence[int]) -> None:
        """The loads reading ``blocks`` have run: let the blocks go."""
        self.pool.release(blocks)

    # -- demotion ------------------------------------------------------------
    @property
    def keeps_chain(self) -> bool:
        """Whether a demotion must bring each block's parent hash and depth (the host policy
        reads them, or KV events report them)."""
        return self.pool.keep_chain or self.pool.events is not None

    def store(self, block_hash: Hashable, parent_hash: Hashable | None, depth: int) -> int | None:
        """A host block to copy an evicted device block into, published under ``block_hash`` and
        evictable at once; None when the hash is already here or every host block is held."""
        pairs = self.store_many([-1], [block_hash], [parent_hash], [depth])
        return pairs[0][1] if pairs else None

    def store_many(self, blocks: Sequence[int], hashes: Sequence[Hashable],
                   parents: list[Hashable | None] | None = None, depths: list[int] | None = None) -> BlockCopies:
        """Demote a batch of evicted (full) device blocks, in eviction order (parallel lists;
        ``parents`` / ``depths`` may be None unless ``keeps_chain``; ``blocks`` a list or an
        int64 array); returns the ``(device block, host block)`` copies to run. Hashes already here are skipped; when
        fewer host blocks are free than needed, the most recently evicted are kept (the rest
        are dropped and counted). One pass for the batch, in eviction order, so the host
        policy sees them oldest first."""
        pool = self.pool
        if not self.cache or not len(blocks):
            return BlockCopies()
        fast = getattr(pool, "cache_new_run", None)
        if fast is not None and (parents is None or not pool.keep_chain):
            # (a flat pool: none of the hashes here and room in its free blocks, in one pass)
            host_blocks = fast(hashes)
            if host_blocks is not None:
                self.stores += len(host_blocks)
                return BlockCopies(blocks, host_blocks)
        if parents is None or depths is None:
            parents, depths = [None] * len(blocks), [0] * len(blocks)
        if not pool.holds_none(hashes):
            new = [p is None for p in map(pool.lookup, hashes)]
            if isinstance(blocks, np.ndarray):
                blocks = blocks.tolist()
            blocks, hashes, parents, depths = (list(compress(values, new)) for values in (blocks, hashes, parents, depths))
        room = pool.num_free
        if len(blocks) > room:
            cut = len(blocks) - room
            self.dropped += cut
            blocks, hashes, parents, depths = (values[cut:] for values in (blocks, hashes, parents, depths))
        if not len(blocks):
            return BlockCopies()
        events = pool.events
        mark = len(events) if events is not None else 0
        host_blocks = pool.cache_run(hashes, parents, depths)
        if events is not None and len(events) - mark > 1:
            _parents_first(events, mark)
        self.stores += len(host_blocks)
        return BlockCopies(blocks, host_blocks)

    # -- swap space ----------------------------------------------------------
    def hold(self, n: int) -> list[int]:
        """``n`` host blocks for a swapped-out sequence (raises ``OutOfBlocks``, changing nothing)."""
        return self.pool.allocate(n)

    def publish_held(self, block: int, block_hash: Hashable, parent_hash: Hashable | None, depth: int,
                     num_tokens: int) -> None:
        """Cache a swapped-out full block here too (it stays cached after the swap-in)."""
        if self.cache:
            self.pool.num_tokens[block] = num_tokens
            self.pool.publish(block, block_hash, parent_hash, depth)

    def release(self, blocks_in_order: Sequence[int]) -> None:
        self.pool.release(blocks_in_order)

    def clear(self) -> None:
        """Forget every cached host block; blocks held by swapped-out sequences stay held."""
        self.pool.clear_cache(keep_active=True)


def _parents_first(events: list, start: int) -> None:
    """Reorder the ``BlockStored`` among ``events[start:]`` (one demotion batch) so that a parent stored
    in the batch comes before its children, as the device's events do: the device evicts a chain tail
    first, and the host keeps that order for its policy (oldest first), not for its events. Other
    events (the host's own evictions) keep their places."""
    slots = [i for i in range(start, len(events)) if isinstance(events[i], BlockStored)]
    if len(slots) < 2:
        return
    batch = [events[i] for i in slots]
    first: dict = {}
    for j, event in enumerate(batch):
        first.setdefault(event.block_hash, j)
    out: list = []
    emitted = [False] * len(batch)
    for j in range(len(batch)):
        chain = []              # j and its ancestors in the batch not yet emitted, child first
        k = j
        while k is not None and not emitted[k]:
            emitted[k] = True   # marked as it is queued: a cycle of hashes cannot loop
            chain.append(k)
            parent = batch[k].parent_hash
            k = first.get(parent) if parent is not None else None
        out.extend(batch[k] for k in reversed(chain))
    for i, event in zip(slots, out):
        events[i] = event
