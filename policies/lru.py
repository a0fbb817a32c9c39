"""Least recently released first.

Blocks are ordered by the time they became evictable. The manager releases a
sequence's blocks tail-first, so a sequence's private tail is evicted before
the prefix it shares with others. A hit takes the block out; its next release
puts it at the most-recent end.

Layout, chosen for Python's costs (no per-block hash-table work): the order is a
queue of *runs*, one per release batch, oldest first, each a list of blocks in
release order. A block's ``stamp`` is the serial of the run it was last released
in; it is evictable while that run is not behind the front one and the stamp is
not 0. A hit only zeroes the stamp; the stale entry it leaves in its run is
skipped when the run reaches the front (its stamp no longer names that run), and
the runs are compacted when stale entries outnumber live ones. An eviction burst
takes a slice of the front run at C speed; the blocks of a run it takes whole
need no store (their serial falls behind the front), the part taken from a run
that stays is zeroed.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import eq, itemgetter

from .base import PolicyBase


class LRUPolicy(PolicyBase):
    name = "lru"
    reads_chain = False     # never reads pool.parent_hash / pool.depth (policies/base.py)
    valid_victims = True    # evict_many returns only live entries (tests/policies/test_lru_batches.py)

    def __init__(self) -> None:
        self._runs: deque[list] = deque()   # [serial, blocks, next index], oldest first
        self._stamp: list[int] = []         # per block: serial of its last run, 0 once hit
        self._serial = 0
        self._len = 0                       # evictable blocks
        self._entries = 0                   # entries not yet consumed in the runs (live + stale)

    def bind(self, pool) -> None:
        super().bind(pool)
        self._stamp = [0] * len(pool.block_hash)

    def on_grow(self, num_blocks: int) -> None:
        self._stamp.extend([0] * (num_blocks - len(self._stamp)))

    def on_released(self, block: int) -> None:
        if block >= len(self._stamp):     # driven without a pool (tests): grow on demand
            self._stamp.extend([0] * (block + 1 - len(self._stamp)))
        self.on_released_batch((block,))

    def on_released_batch(self, blocks) -> None:
        blocks = list(blocks)
        if not blocks:      # no run: evict_many never meets an empty one
            return
        self._serial = serial = self._serial + 1
        stamp = self._stamp
        for block in blocks:
            stamp[block] = serial
        self._runs.append([serial, blocks, 0])
        self._len += len(blocks)
        self._entries += len(blocks)
        if self._entries > 2 * self._len + 4096:
            self._compact()

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self._stamp[block] = 0
            self._len -= 1

    def on_hit_batch(self, blocks: list[int]) -> None:
        stamp = self._stamp
        for block in blocks:
            stamp[block] = 0
        self._len -= len(blocks)

    def evict(self) -> int:
        return self.evict_many(1)[0]

    def evict_many(self, k: int) -> list[int]:
        if k > self._len:
            raise IndexError(f"evict_many({k}) with {self._len} evictable blocks")
        out: list[int] = []
        runs = self._runs
        stamp = self._stamp
        while k:
            run = runs[0]
            serial, blocks, pos = run
            # at most k live entries: never takes too many (a run taken whole is not copied)
            chunk = blocks[pos:pos + k] if pos or len(blocks) > k else blocks
            stamps = itemgetter(*chunk)(stamp) if len(chunk) > 1 else (stamp[chunk[0]],)
            if stamps.count(serial) != len(chunk):      # stale entries: skip them
                chunk = list(compress(chunk, map(eq, stamps, repeat(serial))))
            if out:
                out += chunk
            else:
                out = chunk
            k -= len(chunk)
            pos += len(stamps)
            self._entries -= pos - run[2]
            if pos == len(blocks):
                runs.popleft()
            else:
                run[2] = pos
                for block in chunk:
                    stamp[block] = 0
        self._len -= len(out)
        return out

    def _compact(self) -> None:
        """Drop stale entries (O(entries), after at least as many releases); a run's stamps are
        read and counted in C, so a run left whole or emptied by hits costs no Python step per entry."""
        stamp = self._stamp
        runs: deque[list] = deque()
        for run in self._runs:
            serial, blocks, pos = run
            rest = blocks[pos:] if pos else blocks
            stamps = itemgetter(*rest)(stamp) if len(rest) > 1 else (stamp[rest[0]],)
            live = stamps.count(serial)
            if live == len(rest):
                runs.append(run if not pos else [serial, rest, 0])
            elif live:
                runs.append([serial, list(compress(rest, map(eq, stamps, repeat(serial)))), 0])
        self._runs = runs
        self._entries = self._len

    def clear(self) -> None:
        self._runs.clear()
        self._stamp[:] = [0] * len(self._stamp)
        self._len = self._entries = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        if not 0 <= block < len(self._stamp):
            return False
        serial = self._stamp[block]
        return serial != 0 and serial >= (self._runs[0][0] if self._runs else self._serial + 1)

    def snapshot(self) -> tuple[int, ...]:
        stamp = self._stamp
        return tuple(b for serial, blocks, pos in self._runs for b in blocks[pos:] if stamp[b] == serial)
