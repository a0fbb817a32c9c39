"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), on the evictable set.

Cached blocks are in T1 (seen once: published, never hit) or T2 (hit at least
once). Evicted blocks leave their hash in a ghost list: B1 for T1 victims, B2
for T2 victims. The target size ``p`` of T1 adapts: a hash that comes back
from B1 says T1 was too small (``p`` grows by ``max(|B2|/|B1|, 1)``), one from
B2 says T2 was too small (``p`` shrinks by ``max(|B1|/|B2|, 1)``); either way
the block re-enters in T2. A victim is the least recently released candidate
of T1 if T1 holds more than ``p`` blocks (or T2 has no candidate), else of T2.

Adaptations to the pool's model: ARC's REPLACE runs when the pool asks for a
victim (before the missing block is known), so its tie rule on a B2 hit is
dropped; |T1| and |T2| count blocks in use too, while victims are taken only
among candidates, each list's candidates kept in release order. Ghost lists
are trimmed as in ARC: |T1| + |B1| <= c and all four lists <= 2c, with c the
pool capacity. Every event is O(1).

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) is no ghost hit: the hash never left the
cache and no request missed it, so ``p`` does not move and the residency goes
on in the list the primary was in.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import PolicyBase


def takes_over(pool, block_hash) -> bool:
    """Whether the ``on_cached`` in progress is an active duplicate taking over ``block_hash``
    from a primary that was evicted (or forgotten) just now: the hash never left the cache
    (``pool.promoting``, policies/base.py). A pool without duplicates (a test double) never promotes."""
    return getattr(pool, "promoting", False)


class ARCPolicy(PolicyBase):
    name = "arc"

    def __init__(self) -> None:
        self.capacity = 1 << 62
        self.p = 0.0                                        # target size of T1
        self._list: dict[int, int] = {}                     # cached block -> 1 (T1) | 2 (T2)
        self._size = [0, 0, 0]                              # [unused, |T1|, |T2|], blocks in use included
        self._cands = (None, OrderedDict(), OrderedDict())  # per list: candidates, release order
        self._b1: OrderedDict = OrderedDict()               # ghost hashes, oldest first
        self._b2: OrderedDict = OrderedDict()
        # (hash, list) of the latest victim until the next on_cached: what a duplicate taking
        # the hash over resumes (the pool promotes it right after evict returns)
        self._victim: tuple | None = None

    def bind(self, pool) -> None:
        super().bind(pool)
        self.capacity = pool.num_blocks

    def on_cached(self, block: int) -> None:
        block_hash = self.pool.block_hash[block]
        b1, b2 = self._b1, self._b2
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            which = victim[1]
            # evict's ghost of this hash was the newest entry and its trim dropped nothing (each
            # eviction moves one block from a list to its ghost list): undone exactly
            (b1 if which == 1 else b2).pop(block_hash, None)
        elif block_hash in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[block_hash]
            which = 2
        elif block_hash in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[block_hash]
            which = 2
        else:
            which = 1
        stale = self._list.get(block)
        if stale is not None:  # its last residency ended while in use (taken up a tier): no event said so
            self._size[stale] -= 1
        self._list[block] = which
        self._size[which] += 1
        self._trim()

    def on_hit(self, block: int, was_evictable: bool) -> None:
        which = self._list[block]
        if was_evictable:
            del self._cands[which][block]
        if which == 1:
            self._list[block] = 2
            self._size[1] -= 1
            self._size[2] += 1

    def on_released(self, block: int) -> None:
        self._cands[self._list[block]][block] = None

    def evict(self) -> int:
        _, c1, c2 = self._cands
        if c1 and (self._size[1] > self.p or not c2):
            block = c1.popitem(last=False)[0]
            which, ghost = 1, self._b1
        else:
            block = c2.popitem(last=False)[0]
            which, ghost = 2, self._b2
        del self._list[block]
        self._size[which] -= 1
        block_hash = self.pool.block_hash[block]
        ghost[block_hash] = None
        self._victim = (block_hash, which)
        self._trim()
        return block

    def _trim(self) -> None:
        b1, b2 = self._b1, self._b2
        c = self.capacity
        while b1 and self._size[1] + len(b1) > c:
            b1.popitem(last=False)
        while self._size[1] + self._size[2] + len(b1) + len(b2) > 2 * c:
            (b2 if b2 else b1).popitem(last=False)

    def clear(self) -> None:
        self.p = 0.0
        self._victim = None
        self._list.clear()
        self._size = [0, 0, 0]
        self._cands[1].clear()
        self._cands[2].clear()
        self._b1.clear()
        self._b2.clear()

    def __len__(self) -> int:
        return len(self._cands[1]) + len(self._cands[2])

    def __contains__(self, block: int) -> bool:
        return block in self._cands[1] or block in self._cands[2]

    def snapshot(self) -> tuple:
        return (self.p, tuple(self._cands[1]), tuple(self._cands[2]), tuple(sorted(self._list.items())),
                tuple(self._size), tuple(self._b1), tuple(self._b2))
