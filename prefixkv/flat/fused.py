"""A pool's batches and the LRU order in one compiled call each (``FusedLRU``).

With ``CompiledLRU`` on a flat index, a batch that moves blocks between the free stack, the
table, the LRU links and the refcounts (acquire hits, release, take into a tier above, allocate,
cache a run) is one ``lru_kernels`` call instead of a Python step per block. ``BlockPool`` hands
a batch here only when ``BlockPool._fused_for`` says the batch qualifies (the one eligibility
rule); every call either does the whole batch or reports that it did nothing (False / None), and
the pool then takes its general path.

The compiled calls view the pool's ``array`` storage; an array exporting its buffer cannot be
resized, so every view lives in a frame of this class that has returned before a fallback (whose
exception and traceback could keep a frame, and its views, alive) or a growth can run.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from ..errors import OutOfBlocks
from . import lru_kernels
from .index import HashRows, _tags, as_block_array
from . import lru
from .lru import CompiledLRU

_NO_FLAGS = np.zeros(0, np.uint8)


def _as_blocks(blocks) -> np.ndarray:
    return as_block_array(blocks if isinstance(blocks, (list, np.ndarray)) else list(blocks))


class FusedLRU:
    """The fused batches of one pool whose policy is ``CompiledLRU`` and whose index is flat."""

    @classmethod
    def for_pool(cls, pool) -> FusedLRU | None:
        """The fused batches of ``pool``, where its policy is ``CompiledLRU`` (None otherwise)."""
        return cls(pool) if type(pool.policy) is CompiledLRU else None

    def __init__(self, pool) -> None:
        # Shorter batches take the pool's general paths (list speed beats a compiled call's set-up).
        self.min_batch = lru.SMALL
        self.pool = pool
        self.index = pool.index
        self.lru: CompiledLRU = pool.policy

    def _refcounts(self) -> np.ndarray:
        return np.frombuffer(self.pool.ref_count, np.int32)

    def _token_counts(self) -> np.ndarray:
        return np.frombuffer(self.pool.num_tokens, np.int64)

    # -- blocks found in the table ------------------------------------------------
    def acquire(self, blocks) -> bool:
        """``acquire_hits``, when every block was evictable (else nothing changes: False)."""
        prev, nxt, ends = self.lru.views()
        return lru_kernels.acquire_evictable(self._refcounts(), prev, nxt, ends, _as_blocks(blocks), _NO_FLAGS)

    def release(self, blocks, priority: int) -> bool:
        """``_release``, when every block drops to 0 and all are cached (to the LRU) or none is (to
        the free stack); else nothing changes: False."""
        arr = _as_blocks(blocks)
        done = self._release_compiled(arr)
        if done == 1:
            pool = self.pool
            if priority or pool._priority is not None:
                prio = pool.priority
                for block in arr.tolist():
                    prio[block] = priority
            return True
        if done == 2:
            self.pool._free.push(arr)
            return True
        return False

    def _release_compiled(self, arr: np.ndarray) -> int:
        """1: released to the LRU; 2: released uncached (to go on the free stack); 0: neither."""
        ref = self._refcounts()
        prev, nxt, ends = self.lru.views()
        if lru_kernels.release_cached(ref, self.index.has, prev, nxt, ends, arr):
            return 1
        return 2 if lru_kernels.release_uncached(ref, self.index.has, arr) else 0

    def take(self, blocks, tags: np.ndarray | None) -> bool:
        """``take_cached`` (acquired, their keys out of the table), when every block was evictable
        and listed once; else nothing changes: False. ``tags``: the keys' tags, when known."""
        if self.pool._duplicates:
            return False
        arr = _as_blocks(blocks)
        index = self.index
        prev, nxt, ends = self.lru.views()
        if not lru_kernels.take_evictable(self._refcounts(), prev, nxt, ends, arr, _NO_FLAGS,
                                          *index.kernel_table(tags, arr.shape[0]), index.no_rows, index.no_tags):
            return False
        index.entries_removed(arr.shape[0])     # evictable: each held its key in the table
        return True

    # -- blocks handed out -----------------------------------------------------------
    def allocate(self, n: int, num_tokens: int | None) -> np.ndarray:
        out = self._claim(n)
        lru_kernels.fill(self._refcounts(), out, 1)
        if num_tokens is not None:
            lru_kernels.fill(self._token_counts(), out, num_tokens)
        return out

    def _claim(self, n: int) -> np.ndarray:
        """``BlockPool._claim(n)`` as an int64 array, the victims taken from the LRU in one call."""
        pool = self.pool
        free = pool._free
        if n <= len(free):
            return free.pop(n)
        fresh = pool.num_blocks - pool._fresh
        available = len(free) + fresh + len(self.lru)
        if n > available:
            raise OutOfBlocks(n, available)
        head = free.pop(len(free))
        if fresh:
            head = np.concatenate((head, as_block_array(pool._take_fresh(min(fresh, n - len(head))))))
        k = n - len(head)
        if not k:
            return head
        index = self.index
        victims = np.empty(k, np.int64)
        if pool.on_evict_many is None:
            rows, tags = index.no_rows, index.no_tags
        else:       # the keys removed, and their tags, for the tier below
            rows, tags = np.empty((k, index.words), np.uint64), np.empty(k, np.int64)
        self._evict(victims, rows, tags)
        index.entries_removed(k)
        pool.evictions += k
        if pool.on_evict_many is not None:
            pool.on_evict_many(victims, HashRows(rows, tags))
        return np.concatenate((head, victims)) if len(head) else victims

    def _evict(self, victims: np.ndarray, rows: np.ndarray, tags: np.ndarray) -> None:
        index = self.index
        prev, nxt, ends = self.lru.views()
        slots, keys, has, _, scratch = index.kernel_table()
        lru_kernels.evict_front(prev, nxt, ends, victims, slots, keys, has, scratch, rows, index.no_tags, tags)

    # -- batches entering the table -------------------------------------------------------
    def cache_run(self, hashes: Sequence[Hashable]) -> np.ndarray:
        """``cache_many`` (claimed, full, entered, evictable at once) as an int64 array."""
        pool, index = self.pool, self.index
        q = index.column(hashes, exact=not index.hashes_checked)
        blocks = self._claim(len(hashes))
        got = index.insert_array(q, blocks, _tags(hashes, 0, len(hashes)), rows_known=True)
        if index.inserted == blocks.shape[0]:
            primaries = blocks
        else:     # a hash cached already: this copy is a duplicate, dropped again at once
            new = got == blocks
            primaries = blocks[new]
            pool._free.push(blocks[~new])
        lru_kernels.fill(self._token_counts(), blocks, pool.block_size)
        if pool._priority is not None:
            prio = pool._priority
            for block in primaries.tolist():
                prio[block] = 0
        lru_kernels.append(*self.lru.views(), primaries)
        return blocks

    def cache_new_run(self, hashes: Sequence[Hashable]) -> np.ndarray | None:
        """``cache_run`` of hashes none of which is cached here, from free-uncached blocks, in one
        compiled check-and-insert: None (nothing changed) when one is cached here."""
        pool, index = self.pool, self.index
        n = len(hashes)
        q = index.column(hashes, exact=not index.hashes_checked)
        blocks = pool._free.pop(n)
        got = np.empty(n, np.int64)
        done = self._cache_absent(q, _tags(hashes, 0, n), blocks, got)
        if done >= 0:       # a hash already here: nothing changed
            pool._free.push(blocks[::-1])       # back as they were
            return None
        index.entries_added(-1 - done)
        if index.inserted != n:     # a hash listed twice in the batch: its second copy is dropped again
            new = got == blocks
            primaries = blocks[new]
            pool._free.push(blocks[~new])
            lru_kernels.fill(self._token_counts(), blocks, pool.block_size)
            lru_kernels.append(*self.lru.views(), primaries)
        return blocks

    def _cache_absent(self, q: np.ndarray, tags, blocks: np.ndarray, got: np.ndarray) -> int:
        prev, nxt, ends = self.lru.views()
        slots, keys, has, given, scratch = self.index.kernel_table(tags, q.shape[0], extra=q.shape[0])
        return lru_kernels.cache_absent(slots, keys, has, q, given, blocks, got, scratch, self._token_counts(),
                                        self.pool.block_size, prev, nxt, ends)

    def publish(self, blocks, hashes: Sequence[Hashable]) -> list[tuple[int, Hashable]]:
        """``publish_many`` of active blocks (the LRU sees nothing: they are held); returns the
        (block, hash) pairs whose hash was cached already (duplicates, for the pool to track)."""
        index = self.index
        arr = _as_blocks(blocks)
        n = min(arr.shape[0], len(hashes))
        q = index.column(hashes[:n], exact=not index.hashes_checked)
        got = index.insert_array(q, arr[:n], _tags(hashes, 0, n))
        if index.inserted == n:
            return []
        return [(block, h) for block, h, primary in zip(arr[:n].tolist(), hashes, got.tolist()) if primary != block]
