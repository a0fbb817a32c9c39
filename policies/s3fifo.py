"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO, a main FIFO and a ghost queue.

Rules, as in the paper:

* a block enters the small queue S when it is cached -- or the main queue M if
  its hash is in the ghost queue G (it was evicted from S recently and came
  back, so it deserved better);
* a hit only bumps a 2-bit frequency (capped at ``max_freq``); no reordering;
* while S holds at least ``small_fraction`` of the pool, victims come from S:
  the oldest S block moves to M if it was hit at least ``move_threshold``
  times, else it is evicted and its hash remembered in G (G keeps as many
  hashes as M can hold);
* otherwise the oldest M block is evicted if its frequency is 0, else it gets
  a second chance: reinserted at the head of M with frequency - 1.

Adapted to the evictable-set model: S and M order *every* cached block by the
time it entered the queue (queue sizes count blocks in use too), but a victim
is only ever taken among candidates, so each queue's candidates live in a
sorted map keyed by that entry ticket and a block in use keeps its place while
it is held. Evictions are O(log n) amortised: each extra step of the loop is
paid for by an earlier hit (a frequency unit) or an earlier insertion (an S to
M move).

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) is not a hash coming back from G: the hash
never left the cache. It resumes the primary's queue, place and frequency, and
the ghost that eviction left is taken back.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from sortedcontainers import SortedDict

from .arc import takes_over
from .base import PolicyBase
from prefixkv.checks import integer, real

_SMALL, _MAIN = 0, 1


class S3FIFOPolicy(PolicyBase):
    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1, move_threshold: int = 1, max_freq: int = 3) -> None:
        real("small_fraction", small_fraction, low=0.0, high=1.0, low_open=True, high_open=True)
        move_threshold = integer("move_threshold", move_threshold, low=1, integral_float=True)
        max_freq = integer("max_freq", max_freq, low=move_threshold, integral_float=True)
        self.small_fraction = small_fraction
        self.move_threshold = move_threshold
        self.max_freq = max_freq
        self._small_target = 1
        self._ghost_size = 1 << 62
        self._ticket = count()
        self._queue: dict[int, int] = {}     # cached block -> _SMALL | _MAIN
        self._entered: dict[int, int] = {}   # cached block -> ticket of its entry into its queue
        self._freq: dict[int, int] = {}      # cached block -> hits, capped
        self._size = [0, 0]                  # cached blocks per queue (active ones included)
        self._cands = (SortedDict(), SortedDict())  # per queue: ticket -> candidate block
        self._ghost: OrderedDict = OrderedDict()     # hashes evicted from S, oldest first
        # the latest victim until the next on_cached, for a duplicate taking its hash over:
        # (hash, queue, ticket, freq, whether it left a ghost, the ghost that made room or None)
        self._victim: tuple | None = None

    def bind(self, pool) -> None:
        super().bind(pool)
        self._small_target = max(1, round(self.small_fraction * pool.num_blocks))
        self._ghost_size = max(1, pool.num_blocks - self._small_target)

    def _enter(self, block: int, queue: int) -> int:
        ticket = next(self._ticket)
        self._queue[block] = queue
        self._entered[block] = ticket
        return ticket

    def on_cached(self, block: int) -> None:
        block_hash = self.pool.block_hash[block]
        stale = self._queue.get(block)
        if stale is not None:  # its last residency ended while in use (taken up a tier): no event said so
            self._size[stale] -= 1
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            _, queue, ticket, freq, ghosted, dropped = victim
            if ghosted:
                ghost = self._ghost
                ghost.pop(block_hash, None)
                if dropped is not None:  # back where it was, the oldest
                    ghost[dropped] = None
                    ghost.move_to_end(dropped, last=False)
            self._queue[block] = queue
            self._entered[block] = ticket
            self._freq[block] = freq
            self._size[queue] += 1
            return
        if block_hash in self._ghost:
            del self._ghost[block_hash]
            queue = _MAIN
        else:
            queue = _SMALL
        self._enter(block, queue)
        self._freq[block] = 0
        self._size[queue] += 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._cands[self._queue[block]][self._entered[block]]
        freq = self._freq[block]
        if freq < self.max_freq:
            self._freq[block] = freq + 1

    def on_released(self, block: int) -> None:
        self._cands[self._queue[block]][self._entered[block]] = block

    def evict(self) -> int:
        small, main = self._cands
        size = self._size
        freq = self._freq
        while True:
            if small and (size[_SMALL] >= self._small_target or not main):
                _, block = small.popitem(0)
                if freq[block] >= self.move_threshold:    # lazy promotion
                    size[_SMALL] -= 1
                    size[_MAIN] += 1
                    main[self._enter(block, _MAIN)] = block
                    continue
                size[_SMALL] -= 1
                ghost = self._ghost
                block_hash = self.pool.block_hash[block]
                ghost[block_hash] = None
                dropped = ghost.popitem(last=False)[0] if len(ghost) > self._ghost_size else None
                self._victim = (block_hash, _SMALL, self._entered[block], freq[block], True, dropped)
                break
            _, block = main.popitem(0)
            if freq[block]:                                # second chance
                freq[block] -= 1
                main[self._enter(block, _MAIN)] = block
                continue
            size[_MAIN] -= 1
            self._victim = (self.pool.block_hash[block], _MAIN, self._entered[block], 0, False, None)
            break
        del self._queue[block], self._entered[block], freq[block]
        return block

    def clear(self) -> None:
        self._victim = None
        self._queue.clear()
        self._entered.clear()
        self._freq.clear()
        self._size = [0, 0]
        for cands in self._cands:
            cands.clear()
        self._ghost.clear()

    def __len__(self) -> int:
        return len(self._cands[_SMALL]) + len(self._cands[_MAIN])

    def __contains__(self, block: int) -> bool:
        queue = self._queue.get(block)
        return queue is not None and self._entered[block] in self._cands[queue]

    def snapshot(self) -> tuple:
        return (tuple(self._cands[_SMALL].items()), tuple(self._cands[_MAIN].items()),
                tuple(sorted(self._queue.items())), tuple(sorted(self._entered.items())),
                tuple(sorted(self._freq.items())), tuple(self._size), tuple(self._ghost))
