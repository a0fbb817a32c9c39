"""W-TinyLFU: a small LRU window in front of an SLRU main cache, with a frequency filter
deciding whether the window's oldest block may push out the main cache's victim.

Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM
Transactions on Storage 13(4), 2017 (the W-TinyLFU of its section 5, as in Caffeine).

Rules: a new block enters the window (an LRU of ``max(1, round(window_fraction x c))``
blocks, 1 % by default); the main cache (the rest) is an SLRU whose protected segment holds
up to ``protected_fraction`` (80 %) of it: a hit in probation moves a block to protected, and
a protected overflow sends its least recent block back to probation's recent end. Every
access (publish or hit) counts once for the block's hash; all counts halve every
``sample_ratio x c`` accesses (10x), so the filter forgets old popularity. To make room,
while the window is full its least recent block is the *candidate*: it is admitted to
probation when its count beats the main victim's (probation's least recent, else
protected's), which is then evicted; otherwise the candidate itself goes. With the window not
full, the main victim goes. A window holding more than its size (a filling cache) spills its
least recent blocks into probation.

Differences from the paper, on purpose: counts are exact (a dict, halved in place: O(1)
amortised per access, since a halving follows ``sample_ratio x c`` accesses), not a
count-min sketch with a doorkeeper, so no hash collisions inflate a count; and on the
evictable set, blocks in use keep their segment and are counted in its size, victims are
taken among candidates (when the rule's segment has no candidate the other gives one).

Measured against libCacheSim 0.3.5's ``WTinyLFU`` on one-block requests this variant
differs (libCacheSim's sketch, and its eviction loop admitting several window blocks per
miss; ``tests/policies/test_libcachesim_equality.py`` pins both counts; the README says by how
much).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's segment; its count is unchanged (no access).
"""

from __future__ import annotations

from collections import OrderedDict

from prefixkv.checks import real

from .arc import takes_over
from .base import PolicyBase

_WINDOW, _PROBATION, _PROTECTED = 0, 1, 2


class WTinyLFUPolicy(PolicyBase):
    name = "wtinylfu"
    reads_chain = False

    def __init__(self, window_fraction: float = 0.01, protected_fraction: float = 0.8,
                 sample_ratio: float = 10.0) -> None:
        real("window_fraction", window_fraction, low=0.0, high=1.0, high_open=True)
        real("protected_fraction", protected_fraction, low=0.0, high=1.0)
        real("sample_ratio", sample_ratio, low=0.0, low_open=True)
        self.window_fraction = window_fraction
        self.protected_fraction = protected_fraction
        self.sample_ratio = sample_ratio
        self.window_size = 1
        self.protected_size = 1 << 62
        self._sample = 1 << 62
        self._accesses = 0                       # since the last halving
        self._count: dict = {}                   # hash -> accesses (halved every sample)
        self._segment: dict[int, int] = {}       # cached block -> _WINDOW | _PROBATION | _PROTECTED
        self._size = [0, 0, 0]                   # cached blocks per segment, blocks in use included
        self._cands = (OrderedDict(), OrderedDict(), OrderedDict())  # per segment: least recent first
        self._victim: tuple | None = None        # (hash, segment) of the latest victim

    def bind(self, pool) -> None:
        super().bind(pool)
        c = pool.num_blocks
        self.window_size = max(1, round(self.window_fraction * c))
        self.protected_size = int(self.protected_fraction * max(0, c - self.window_size))
        self._sample = max(1, int(self.sample_ratio * c))

    def _count_access(self, block_hash) -> None:
        count = self._count
        count[block_hash] = count.get(block_hash, 0) + 1
        self._accesses += 1
        if self._accesses >= self._sample:     # age: every count halves, zeros are forgotten
            self._accesses = 0
            self._count = {h: n >> 1 for h, n in count.items() if n > 1}

    def _move(self, block: int, segment: int) -> None:
        self._size[self._segment[block]] -= 1
        self._segment[block] = segment
        self._size[segment] += 1

    def _demote_overflow(self) -> None:
        protected = self._cands[_PROTECTED]
        while self._size[_PROTECTED] > self.protected_size and protected:
            block = protected.popitem(last=False)[0]
            self._move(block, _PROBATION)
            self._cands[_PROBATION][block] = None

    def on_cached(self, block: int) -> None:
        stale = self._segment.get(block)
        if stale is not None:   # its last residency ended in use (taken up a tier), unannounced
            self._size[stale] -= 1
        block_hash = self.pool.block_hash[block]
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            segment = victim[1]
        else:
            segment = _WINDOW
            self._count_access(block_hash)
        self._segment[block] = segment
        self._size[segment] += 1
        if self._size[_WINDOW] > self.window_size:
            self._spill()

    def _spill(self) -> None:
        """Window blocks beyond its size move to probation's recent end, as in Caffeine: the
        window overflows into the main cache whenever it has room (a filling cache, or the
        window's oldest blocks were in use when a victim was chosen)."""
        window = self._cands[_WINDOW]
        while self._size[_WINDOW] > self.window_size and window:
            block = window.popitem(last=False)[0]
            self._move(block, _PROBATION)
            self._cands[_PROBATION][block] = None

    def on_hit(self, block: int, was_evictable: bool) -> None:
        segment = self._segment[block]
        if was_evictable:
            del self._cands[segment][block]
        self._count_access(self.pool.block_hash[block])
        if segment == _PROBATION:
            self._move(block, _PROTECTED)
            self._demote_overflow()

    def on_released(self, block: int) -> None:
        segment = self._segment[block]
        self._cands[segment][block] = None
        if segment == _PROTECTED:
            self._demote_overflow()
        elif segment == _WINDOW and self._size[_WINDOW] > self.window_size:
            self._spill()

    def _main_victim_segment(self):
        if self._cands[_PROBATION]:
            return _PROBATION
        return _PROTECTED if self._cands[_PROTECTED] else None

    def evict(self) -> int:
        window = self._cands[_WINDOW]
        main = self._main_victim_segment()
        if window and (self._size[_WINDOW] >= self.window_size or main is None):
            candidate = next(iter(window))
            if main is not None:
                victim = next(iter(self._cands[main]))
                block_hash = self.pool.block_hash
                count = self._count
                if count.get(block_hash[candidate], 0) > count.get(block_hash[victim], 0):
                    del window[candidate]           # admitted: the main victim goes instead
                    self._move(candidate, _PROBATION)
                    self._cands[_PROBATION][candidate] = None
                    return self._take(victim, main)
            return self._take(candidate, _WINDOW)
        return self._take(next(iter(self._cands[main])), main)

    def _take(self, block: int, segment: int) -> int:
        del self._cands[segment][block]
        del self._segment[block]
        self._size[segment] -= 1
        self._victim = (self.pool.block_hash[block], segment)
        return block

    def clear(self) -> None:
        self._victim = None
        self._accesses = 0
        self._count = {}
        self._segment.clear()
        self._size = [0, 0, 0]
        for cands in self._cands:
            cands.clear()

    def __len__(self) -> int:
        return sum(map(len, self._cands))

    def __contains__(self, block: int) -> bool:
        segment = self._segment.get(block)
        return segment is not None and block in self._cands[segment]

    def snapshot(self) -> tuple:
        return (tuple(tuple(c) for c in self._cands), tuple(sorted(self._segment.items())), tuple(self._size),
                tuple(sorted(self._count.items(), key=repr)), self._accesses)
