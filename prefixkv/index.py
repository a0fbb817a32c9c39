"""The prefix cache's hash index as a component of the pool, and its dict implementation.

An index keeps, for the pool's *primary* blocks, hash -> block (``get``, ``mapping``) and
block -> hash (``hashes``, read by policies). The pool changes it only through the calls below,
each of which keeps both directions in step; batch calls take a whole run, so an index whose
probes are compiled (``prefixkv.flat``) pays one call per batch, not one per block.

Reads: ``get(h)``, ``hashes[block]`` (None: holds no hash), ``mapping`` (read-only), ``len``,
``held(block)``, ``count_held(blocks)`` / ``count_unheld``, ``held_flags()`` (a per-block sequence and its value for
"no hash", compared by identity: the release loop's test), ``primaries()``, ``hashes_of(blocks)``,
``run(hashes, start, limit)`` / ``run_array`` (the leading run of hits), ``holds_none(hashes)``,
``probe_keys`` / ``run_outside`` / ``key_tags`` (a prompt's keys prepared once, probed often).

Writes: ``prepare(hashes)`` (check and convert a batch before anything changes: raises for a
hash this index cannot key), ``enter_many(keys, hashes, blocks)`` (``setdefault`` per pair: a new
hash becomes its block's), ``insert(h, block)`` (a new primary), ``remove(h)`` (returns its
block), ``take_blocks(blocks, want_hashes)`` (drop the hashes of primary blocks),
``take_blocks_checked`` (the same, all or nothing, when every block holds a hash once),
``ensure_blocks(n)``, ``clear()``.

Construction: ``block_storage()`` (the pool's per-block refcounts, token counts and free stack,
as this index's batch paths want them). An index may come with fused batches, given to the pool
beside it (``BlockPool(..., fused=)``: the pool's batches and its eviction order in one compiled
call each; ``prefixkv.flat.fused``).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Hashable, Sequence

__all__ = ["DictIndex", "gather", "leading"]

# Map entries above which a burst of deletions pays for a lookup pass first (take_blocks), and
# from which a batch of insertions does (enter_many): measured on a 32 MiB L3.
_MAP_OUTGROWS_CACHES = 1 << 16
_MAP_OUTGROWS_LLC = 1 << 19


def gather(values: Sequence, indices: Sequence[int]) -> Sequence:
    """``values[i]`` for each ``i`` in ``indices`` (a tuple, or a list below two): one itemgetter
    call reads them in C, about twice as fast as ``map(values.__getitem__, indices)``."""
    if len(indices) > 1:
        return itemgetter(*indices)(values)
    return [values[i] for i in indices]


def leading(get, hashes: Sequence[Hashable], start: int, limit: int) -> list:
    """``get(h)`` for ``hashes[start:limit]`` up to the first None (a prefix's run of hits).
    Looking up in C (map) beats a Python loop that stops at the first miss; in doubling chunks, so
    a miss early in a long prompt does not look up all the rest."""
    found: list = []
    step = 32
    while start < limit:
        part = list(map(get, hashes[start:min(start + step, limit)]))
        if None in part:
            found += part[:part.index(None)]
            return found
        found += part
        start += step
        step *= 2
    return found


class DictIndex:
    """Any hashable keys: a dict (hash -> primary block) and a list (block -> hash or None)."""

    digest_size = None          # keys are not fixed-width digests

    def __init__(self) -> None:
        self.map: dict[Hashable, int] = {}
        # by block; refilled in place on clear (policies keep a reference to it)
        self.hashes: list[Hashable | None] = []
        self.mapping = self.map     # read-only to callers
        self.get = self.map.get     # bound once: the hottest call

    def block_storage(self) -> tuple[list, list, list]:
        return [], [], []

    def ensure_blocks(self, n: int) -> None:
        if n > len(self.hashes):
            self.hashes.extend([None] * (n - len(self.hashes)))

    def __len__(self) -> int:
        return len(self.map)

    # -- reads -----------------------------------------------------------------
    def held(self, block: int) -> bool:
        return self.hashes[block] is not None

    def count_held(self, blocks: Sequence[int]) -> int:
        return len(blocks) - self.count_unheld(blocks)

    def count_unheld(self, blocks: Sequence[int]) -> int:
        return gather(self.hashes, blocks).count(None)

    def held_flags(self) -> tuple[Sequence, None]:
        return self.hashes, None

    def primaries(self):
        return self.map.values()

    def hashes_of(self, blocks: Sequence[int]) -> Sequence[Hashable]:
        return gather(self.hashes, blocks)

    def run(self, hashes: Sequence[Hashable], start: int, limit: int) -> list[int]:
        """A fresh prompt misses at once and a cached one usually hits to its end: both are told by
        one lookup each; all hits are read by one itemgetter call (C)."""
        get = self.get
        if start >= limit or get(hashes[start]) is None:
            return []
        if limit - start == 1:
            return [get(hashes[start])]
        if get(hashes[limit - 1]) is not None:
            try:
                return list(itemgetter(*hashes[start:limit])(self.map))
            except KeyError:
                pass
        return leading(get, hashes, start, limit)

    run_array = run

    def holds_none(self, hashes) -> bool:
        return self.map.keys().isdisjoint(hashes)

    def probe_keys(self, hashes: list[Hashable]) -> Sequence[Hashable]:
        return hashes

    def run_outside(self, other, keys, start: int, limit: int) -> tuple[Sequence[int], bool | None]:
        return self.run_array(keys, start, limit), None

    def key_tags(self, keys, indices) -> None:
        return None

    # -- writes ----------------------------------------------------------------
    def prepare(self, hashes: Sequence[Hashable]) -> Sequence[Hashable]:
        return hashes       # any hashable is a key

    def check_keys(self, hashes: Sequence[Hashable]) -> None:
        pass

    def enter_many(self, keys, hashes: Sequence[Hashable], blocks: list[int]) -> list[int]:
        cached = self.map
        if len(cached) > _MAP_OUTGROWS_LLC and len(hashes) > 1:
            # Each new hash probes a map far bigger than the last-level cache, several dependent
            # misses per insertion. Hashing them first and then probing for them in one tight C
            # loop lets the CPU overlap those misses; setdefault below finds the slots cached
            # (1M blocks: 47 -> 37 us per 128 hashes; around 2^19 entries it was a wash).
            all(map(hash, hashes))
            cached.keys().isdisjoint(hashes)
        got = list(map(cached.setdefault, hashes, blocks))
        by_block = self.hashes
        if got == blocks:
            for block, h in zip(blocks, hashes):
                by_block[block] = h
        else:
            for block, h, primary in zip(blocks, hashes, got):
                if primary == block:
                    by_block[block] = h
        return got

    def insert(self, h: Hashable, block: int) -> None:
        self.map[h] = block
        self.hashes[block] = h

    def remove(self, h: Hashable) -> int:
        block = self.map.pop(h)
        self.hashes[block] = None
        return block

    def take_blocks(self, blocks: Sequence[int], want_hashes: bool = True) -> Sequence[Hashable]:
        hashes = gather(self.hashes, blocks)
        if len(self.map) > _MAP_OUTGROWS_CACHES and len(hashes) > 1:
            # A map this big misses the caches at every victim: one lookup pass in C lets the
            # CPU overlap those misses, so the deletions below find their slots cached (1M blocks:
            # 25 -> 16 us per 128 victims; in-cache maps would only pay for the pass).
            itemgetter(*hashes)(self.map)
        self._drop(blocks, hashes)
        return hashes

    def take_blocks_checked(self, blocks: Sequence[int], want_hashes: bool = True) -> Sequence[Hashable] | None:
        hashes = gather(self.hashes, blocks)
        if None in hashes or len(set(blocks)) != len(blocks):
            return None
        self._drop(blocks, hashes)
        return hashes

    def _drop(self, blocks: Sequence[int], hashes: Sequence[Hashable]) -> None:
        cached, by_block = self.map, self.hashes
        for block, h in zip(blocks, hashes):
            del cached[h]
            by_block[block] = None

    def clear(self) -> None:
        self.map.clear()
        self.hashes[:] = [None] * len(self.hashes)
