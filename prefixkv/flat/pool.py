"""``BlockPool`` with its hash index in flat arrays (``FlatIndex``): same states, events and results.

The base class reads and writes its index through ``self._cached`` (a dict: hash -> primary
block) and ``self.block_hash`` (a list: block -> hash or None). Here both are views of one
``FlatIndex`` (``_IndexMap``, ``_HashColumn``) with every dict / list operation the base class and
the policies use, so every path of ``BlockPool`` works unchanged, element by element; the batch
paths that matter for speed (prefix lookups, publishing, eviction bursts, releases, host-tier
takes) are overridden with one compiled call each. Keys are fixed-width digests (``bytes``); a
hash read back is a fresh ``bytes`` equal to the one stored.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Hashable, Iterable, Iterator, Sequence

import numpy as np

from ..errors import OutOfBlocks
from ..pool import BlockPool
from . import lru_kernels
from .index import FlatIndex, HashRows, as_block_array as index_blocks
from .lru import SMALL, CompiledLRU
from .stack import FreeStack


# Slots keep ``block + 1`` in 32 bits.
MAX_BLOCKS = 2**32 - 2
_NO_FLAGS = np.zeros(0, np.uint8)


def _tags(hashes, start: int, stop: int) -> np.ndarray | None:
    """The index tags of ``hashes[start:stop]``, when ``hashes`` are rows that carry them."""
    if type(hashes) is HashRows and hashes.tags is not None:
        return hashes.tags[start:stop]
    return None


def _materialised(blocks):
    """A batch of blocks as a list or an int64 array (an iterator read once)."""
    return blocks if isinstance(blocks, (list, np.ndarray)) else list(blocks)


def _block_list(blocks) -> list[int]:
    return blocks.tolist() if isinstance(blocks, np.ndarray) else blocks


def _as_blocks(blocks) -> np.ndarray:
    return index_blocks(blocks if isinstance(blocks, (list, np.ndarray)) else list(blocks))


class _IndexMap(Mapping):
    """The index as ``dict[hash, block]``, for the base class's per-element paths and readers."""

    __slots__ = ("_index",)

    def __init__(self, index: FlatIndex) -> None:
        self._index = index

    def __getitem__(self, h) -> int:
        block = self._index.get(h)
        if block is None:
            raise KeyError(h)
        return block

    def get(self, h, default=None):
        return self._index.get(h, default)

    def __contains__(self, h) -> bool:
        return self._index.get(h) is not None

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._index.hashes_of(self._index.blocks()))

    def __setitem__(self, h, block: int) -> None:
        self._index.assign(h, block)

    def __delitem__(self, h) -> None:
        self._index.remove(h)

    def clear(self) -> None:
        self._index.clear()


class _HashColumn(Sequence):
    """The index as ``list[hash | None]`` by block, covering the blocks handed out so far."""

    __slots__ = ("_index", "_covered")

    def __init__(self, index: FlatIndex, covered: list) -> None:
        self._index = index
        self._covered = covered        # the pool's ref_count list: its length is the coverage

    def __len__(self) -> int:
        return len(self._covered)

    def __getitem__(self, block):
        if isinstance(block, slice):
            return [self[b] for b in range(*block.indices(len(self)))]
        if not 0 <= block < len(self._covered):
            if block < 0 and -len(self._covered) <= block:
                return self._index.hash_of(block + len(self._covered))
            raise IndexError(f"block {block} out of range")
        return self._index.hash_of(block)

    def __setitem__(self, block: int, h) -> None:
        if not 0 <= block < len(self._covered):
            raise IndexError(f"block {block} out of range")
        self._index.set_held(block, h)

    def __iter__(self) -> Iterator:
        hash_of = self._index.hash_of
        return (hash_of(b) for b in range(len(self._covered)))


class FlatBlockPool(BlockPool):
    """A ``BlockPool`` whose hash index is a ``FlatIndex`` of ``digest_size``-byte keys."""

    _index_stores_hashes = True

    def __init__(self, num_blocks: int, block_size: int, policy, *, digest_size: int = 16,
                 hashes_checked: bool = False, **kwargs) -> None:
        if kwargs.get("verify"):
            raise ValueError("verify mode keeps each block's content and reads the chain per block: "
                             "use BlockPool (index='dict')")
        if num_blocks > MAX_BLOCKS:
            raise ValueError(f"a flat index addresses at most {MAX_BLOCKS:,} blocks (32-bit slots), got "
                             f"{num_blocks:,}: use BlockPool (index='dict')")
        self.index = FlatIndex(digest_size)
        self._column: tuple | None = None       # (hashes, their keys) checked by cache_many
        # True from an owner whose every hash is already known to be a digest of this width (the
        # manager: its hasher's, or precomputed ones it checked; a host tier: the device index's):
        # entering keys then skips the check per hash (~35 ns each; 2,048 in a long prompt).
        self.hashes_checked = hashes_checked
        super().__init__(num_blocks, block_size, policy, **kwargs)
        # The LRU order in arrays: batches move blocks in and out of it with their refcounts in one
        # compiled call (``_compiled``); any other policy takes the base class's paths.
        self._lru = policy if type(policy) is CompiledLRU else None
        self._free = FreeStack()

    def _compiled(self, n: int = SMALL) -> CompiledLRU | None:
        """The compiled LRU, for a batch of ``n`` blocks that a compiled call pays for (``SMALL`` or
        more) when nothing needs a per-block step: no KV events, no reuse tracking, no active
        duplicates. Shorter batches take the base class's paths (list speed)."""
        if n >= SMALL and self.events is None and self._reused is None and not self._duplicate_hash:
            return self._lru
        return None

    def _make_index(self) -> None:
        # refcounts and token counts in int64 arrays: Python indexes them as fast as lists, and the
        # compiled batch operations view them (np.frombuffer, per call: an array that exports its
        # buffer cannot grow)
        self.ref_count = array("i")      # (int32: a block held by 2^31 tables is not a thing)
        self.num_tokens = array("q")
        index = self.index
        self._cached = self.cached_map = _IndexMap(index)
        self.block_hash = _HashColumn(index, self.ref_count)
        self.lookup = index.get

    def _grow_hashes(self, grow: int) -> None:
        # (called after ref_count grew: it has the new length)
        self.index.ensure_blocks(len(self.ref_count))

    def is_cached(self, block: int) -> bool:
        return self.index.held(block)

    # -- lookups ---------------------------------------------------------------
    def leading_hits(self, hashes: Sequence[Hashable], start: int, limit: int) -> list[int]:
        if start >= limit or self.index.get(hashes[start]) is None:
            return []       # a fresh prompt: told by one probe, not a column of its hashes
        try:
            q = self.index.column(hashes[start:limit])
        except (TypeError, ValueError):     # not all digests of this width: none of those is cached
            return super().leading_hits(hashes, start, limit)
        return self.index.lookup_run(q, _tags(hashes, start, limit))

    def leading_run(self, hashes: Sequence[Hashable], start: int, limit: int) -> np.ndarray:
        """``leading_hits`` as an int64 array."""
        if start >= limit or self.index.get(hashes[start]) is None:
            return index_blocks(())
        try:
            q = self.index.column(hashes[start:limit])
        except (TypeError, ValueError):     # not all digests of this width: none of those is cached
            return index_blocks(super().leading_hits(hashes, start, limit))
        return self.index.lookup_run_array(q, _tags(hashes, start, limit))

    def probe_keys(self, hashes: list[Hashable]) -> Sequence[Hashable]:
        """The hashes' key rows with their tags (``HashRows``), joined once; the list itself for
        one hash, or for hashes that are not digests of this width (none of those is cached)."""
        if len(hashes) > 1:
            try:
                return HashRows.tagged(self.index.column(hashes))
            except (TypeError, ValueError):
                pass
        return hashes

    def leading_run_outside(self, other: BlockPool, keys: Sequence[Hashable], start: int,
                            limit: int) -> tuple[Sequence[int], bool | None]:
        if type(keys) is HashRows and keys.tags is not None and isinstance(other, FlatBlockPool):
            # both indexes flat: the run here and the other index's absence from it in one pass
            return self.index.lookup_run_outside(other.index, keys.rows[start:limit], keys.tags[start:limit])
        return super().leading_run_outside(other, keys, start, limit)

    def key_tags(self, keys: Sequence[Hashable], indices: Sequence[int]):
        if type(indices) is range and type(keys) is HashRows and keys.tags is not None:
            return keys.tags[indices.start:indices.stop]
        return None

    def holds_none(self, hashes: Iterable[Hashable]) -> bool:
        if type(hashes) is not HashRows:
            hashes = list(hashes)
        if not hashes:
            return True
        try:
            q = self.index.column(hashes)
        except (TypeError, ValueError):
            return super().holds_none(hashes)
        return int(self.index.lookup_many(q, _tags(hashes, 0, len(hashes))).max()) < 0

    def num_unused_cached(self) -> int | None:
        reused = self._reused
        if reused is None:
            return None
        return sum(1 for block in self.index.blocks() if not reused[block])

    def _hash_flags(self):
        return self.index.flags, 0      # (bytearray items are small ints: 0 is CPython's one 0)

    def _uncached_among(self, blocks: list[int]) -> int:
        return len(blocks) - self.index.count_held(blocks)

    # -- inserting -------------------------------------------------------------
    def _setdefault_many(self, hashes: list[Hashable], blocks: list[int]) -> list[int]:
        index = self.index
        if len(hashes) > len(blocks):      # paired as zip pairs them: the extra hashes are not entered
            hashes = hashes[:len(blocks)]
        column = self._column
        if column is not None and column[0] is hashes:
            q = column[1]          # checked by cache_many already
        elif len(blocks) == 1 and hashes:
            # a decode step's one new full block: no join, no arrays of one
            return [index.setdefault_one(index.key(hashes[0]), blocks[0])]
        else:
            q = index.column(hashes, exact=not self.hashes_checked)
        return index.setdefault_many(q, blocks)

    def cache_many(self, hashes: list[Hashable], parents: list[Hashable | None], depths: list[int]) -> list[int]:
        # A hash this index cannot key raises before a block is claimed (or a victim evicted) for it:
        # the base class claims the blocks first and enters the hashes after.
        q = self.index.column(hashes, exact=not self.hashes_checked)
        self._column = (hashes, q)
        try:
            return super().cache_many(hashes, parents, depths)
        finally:
            self._column = None

    # -- evicting --------------------------------------------------------------
    def _evict_valid(self, k: int, out: list[int]) -> None:
        victims = self._victims(k)
        self.index.remove_blocks(victims, False)
        self._took(victims, out)
        if self.on_evict_many is not None:
            # the removed blocks' key rows stay readable until the blocks take new keys
            self.on_evict_many(victims, self.index.hashes_of(victims))

    def _uncache_checked(self, victims: list, k: int):
        index = self.index
        try:
            arr = index_blocks(victims)
            if len(victims) != k or (k and (int(arr.min()) < 0 or int(arr.max()) >= len(self.ref_count))):
                return None
        except (TypeError, ValueError, OverflowError):       # not block ids
            return None
        if any(map(self.ref_count.__getitem__, victims)) or index.remove_blocks(arr, True) >= 0:
            return None
        # the removed blocks' key rows stay readable until the blocks take new keys
        return index.hashes_of(victims) if self.on_evict_many is not None else ()

    def _uncache(self, blocks: list[int]) -> None:
        self.index.remove_blocks(blocks, False)

    def _clear_index(self) -> None:
        self.index.clear()

    # -- batches in compiled calls (the LRU order in arrays) ----------------------
    # The compiled calls view the pool's array('q') storage; an array exporting its buffer cannot be
    # resized, so every view lives in a helper's frame that has returned before a fallback (whose
    # exception and traceback could keep a frame, and its views, alive) or a growth can run.
    def _acquire_compiled(self, lru: CompiledLRU, arr: np.ndarray) -> bool:
        prev, nxt, ends = lru.views()
        return lru_kernels.acquire_evictable(np.frombuffer(self.ref_count, np.int32), prev, nxt, ends, arr,
                                             _NO_FLAGS)

    def acquire_hits(self, blocks: Iterable[int], *, distinct: bool = False) -> None:
        blocks = _materialised(blocks)
        lru = self._compiled(len(blocks))
        if lru is not None and self._acquire_compiled(lru, _as_blocks(blocks)):
            return
        super().acquire_hits(_block_list(blocks), distinct=distinct)

    def _release_compiled(self, lru: CompiledLRU, arr: np.ndarray) -> int:
        """1: released to the LRU; 2: released uncached (to go on the free stack); 0: neither."""
        ref = np.frombuffer(self.ref_count, np.int32)
        prev, nxt, ends = lru.views()
        if lru_kernels.release_cached(ref, self.index.has, prev, nxt, ends, arr):
            return 1
        return 2 if lru_kernels.release_uncached(ref, self.index.has, arr) else 0

    def _release(self, blocks_in_order: Iterable[int], priority: int, all_cached: bool = False) -> None:
        blocks_in_order = _materialised(blocks_in_order)
        lru = self._compiled(len(blocks_in_order))
        if lru is not None:
            arr = _as_blocks(blocks_in_order)
            done = self._release_compiled(lru, arr)
            if done == 1:
                if priority or self._priority is not None:
                    prio = self.priority
                    for block in arr.tolist():
                        prio[block] = priority
                return
            if done == 2:
                self._free.push(arr)
                return
        super()._release(_block_list(blocks_in_order), priority, all_cached)

    def take_cached(self, blocks: list[int], *, distinct: bool = False, tags: np.ndarray | None = None) -> None:
        """``tags``: the tags of the blocks' keys in the index (``HashRows.tags`` of the hashes they
        were found by), when the caller has them."""
        blocks = _materialised(blocks)
        lru = self._compiled(len(blocks))
        if lru is not None and not self._duplicates and self._take_compiled(lru, _as_blocks(blocks), tags):
            self.forgotten += len(blocks)
            return
        super().take_cached(_block_list(blocks), distinct=distinct)

    def _take_compiled(self, lru: CompiledLRU, arr: np.ndarray, tags: np.ndarray | None) -> bool:
        index = self.index
        prev, nxt, ends = lru.views()
        if not lru_kernels.take_evictable(np.frombuffer(self.ref_count, np.int32), prev, nxt, ends, arr, _NO_FLAGS,
                                          *index.kernel_table(tags, arr.shape[0]), index.no_rows, index.no_tags):
            return False
        index.entries_removed(arr.shape[0])     # evictable: each held its key in the table
        return True

    def _claim_array(self, n: int, lru: CompiledLRU) -> np.ndarray:
        """``_claim(n)`` as an int64 array, the victims taken from the compiled LRU in one call."""
        free = self._free
        if n <= len(free):
            return free.pop(n)
        fresh = self.num_blocks - self._fresh
        available = len(free) + fresh + len(lru)
        if n > available:
            raise OutOfBlocks(n, available)
        head = free.pop(len(free))
        if fresh:
            head = np.concatenate((head, index_blocks(self._take_fresh(min(fresh, n - len(head))))))
        k = n - len(head)
        if not k:
            return head
        index = self.index
        victims = np.empty(k, np.int64)
        if self.on_evict_many is None:
            rows, tags = index.no_rows, index.no_tags
        else:       # the keys removed, and their tags, for the tier below
            rows, tags = np.empty((k, index.words), np.uint64), np.empty(k, np.int64)
        self._evict_compiled(lru, victims, rows, tags)
        index.entries_removed(k)
        self.evictions += k
        if self.on_evict_many is not None:
            self.on_evict_many(victims, HashRows(rows, tags))
        return np.concatenate((head, victims)) if len(head) else victims

    def _evict_compiled(self, lru: CompiledLRU, victims: np.ndarray, rows: np.ndarray, tags: np.ndarray) -> None:
        index = self.index
        prev, nxt, ends = lru.views()
        slots, keys, has, _, scratch = index.kernel_table()
        lru_kernels.evict_front(prev, nxt, ends, victims, slots, keys, has, scratch, rows, index.no_tags, tags)

    def allocate_run(self, n: int, num_tokens: int | None = None) -> Sequence[int]:
        """``allocate``: an int64 array for a batch a compiled call pays for, else a list."""
        lru = self._compiled(n)
        if lru is None or self._duplicates:
            return super().allocate(n, num_tokens)
        out = self._claim_array(n, lru)
        lru_kernels.fill(np.frombuffer(self.ref_count, np.int32), out, 1)
        if num_tokens is not None:
            lru_kernels.fill(np.frombuffer(self.num_tokens, np.int64), out, num_tokens)
        return out

    def allocate(self, n: int, num_tokens: int | None = None) -> list[int]:
        return _block_list(self.allocate_run(n, num_tokens))

    def cache_run(self, hashes, parents, depths) -> Sequence[int]:
        """``cache_many``: an int64 array for a batch a compiled call pays for, else a list."""
        lru = self._compiled(len(hashes))
        if lru is None or self._duplicates or self.verify or self._keep_chain:
            return self.cache_many(hashes, parents, depths)
        q = self.index.column(hashes, exact=not self.hashes_checked)
        blocks = self._claim_array(len(hashes), lru)
        got = self.index.insert_array(q, blocks, _tags(hashes, 0, len(hashes)), rows_known=True)
        if self.index.inserted == blocks.shape[0]:
            primaries = blocks
        else:     # a hash cached already: this copy is a duplicate, dropped again at once
            new = got == blocks
            primaries = blocks[new]
            self._free.push(blocks[~new])
        lru_kernels.fill(np.frombuffer(self.num_tokens, np.int64), blocks, self.block_size)
        if self._priority is not None:
            prio = self._priority
            for block in primaries.tolist():
                prio[block] = 0
        lru_kernels.append(*lru.views(), primaries)
        return blocks

    def cache_new_run(self, hashes) -> np.ndarray | None:
        """``cache_run`` of hashes none of which is cached here, taking free-uncached blocks, in one
        compiled check-and-insert: None (nothing changed) when one is cached here, or when the
        batch would evict or keep more than hashes and blocks (the caller takes the general way:
        ``holds_none``, then ``cache_run``)."""
        n = len(hashes)
        lru = self._compiled(n)
        if (lru is None or self._duplicates or self.verify or self._keep_chain or self._priority is not None
                or not n or n > len(self._free)):
            return None
        index = self.index
        q = index.column(hashes, exact=not self.hashes_checked)
        blocks = self._free.pop(n)
        got = np.empty(n, np.int64)
        done = self._cache_compiled(lru, q, _tags(hashes, 0, n), blocks, got)
        if done >= 0:       # a hash already here: nothing changed
            self._free.push(blocks[::-1])       # back as they were
            return None
        index.entries_added(-1 - done)
        if index.inserted != n:     # a hash listed twice in the batch: its second copy is dropped again
            new = got == blocks
            primaries = blocks[new]
            self._free.push(blocks[~new])
            lru_kernels.fill(np.frombuffer(self.num_tokens, np.int64), blocks, self.block_size)
            lru_kernels.append(*lru.views(), primaries)
        return blocks

    def _cache_compiled(self, lru: CompiledLRU, q: np.ndarray, tags, blocks: np.ndarray, got: np.ndarray) -> int:
        prev, nxt, ends = lru.views()
        slots, keys, has, given, scratch = self.index.kernel_table(tags, q.shape[0], extra=q.shape[0])
        return lru_kernels.cache_absent(slots, keys, has, q, given, blocks, got, scratch,
                                        np.frombuffer(self.num_tokens, np.int64), self.block_size, prev, nxt, ends)

    def publish_many(self, blocks: list[int], hashes: list[Hashable], parents: Sequence[Hashable | None],
                     depths: Sequence[int]) -> None:
        if (self._compiled(len(blocks)) is not None and not self.verify and not self._keep_chain
                and self._on_cached is None):
            arr = _as_blocks(blocks)
            n = min(arr.shape[0], len(hashes))
            q = self.index.column(hashes[:n], exact=not self.hashes_checked)
            got = self.index.insert_array(q, arr[:n], _tags(hashes, 0, n))
            if self.index.inserted != n:     # some already cached: duplicates of their primaries
                for block, h, primary in zip(arr[:n].tolist(), hashes, got.tolist()):
                    if primary != block:
                        self._duplicate_hash[block] = h
                        self._duplicates.setdefault(h, []).append(block)
            return
        if isinstance(blocks, np.ndarray):
            blocks = blocks.tolist()
        if not self.hashes_checked and (self.verify or self.events is not None
                                        or (self._on_cached is not None and self._cached_batch is None)):
            # the base class publishes block by block here: a hash this index cannot key must raise
            # before the first is entered (the batch path checks them all first)
            self.index.column(hashes[:len(blocks)], exact=True)
        super().publish_many(blocks, hashes, parents, depths)
