"""GreedyDual-Size-Frequency, made aware of positions in a prefix chain.

A candidate's priority is ``H = L + value`` with ``value = freq * cost / size``
and the lowest H is evicted; the clock ``L`` rises to each victim's H, so
blocks that stop being used age out however high their count once was (GDSF,
Cherkasova 1998).

* ``freq``: publishes plus hits while cached.
* ``cost``: recomputing the block at chain position ``d`` attends over the
  ``d`` blocks before it: ``cost = 1 + depth_cost * d``. The default
  ``depth_cost`` is ``block_size / 32768``: the attention share of a block's
  prefill next to its linear layers, for a model with a 4096-wide hidden state.
* ``size``: one block (cached blocks are always full).
* A block is worth no more than the chain below it: a parent takes the best
  value among the children released since its own last release (``inherit``,
  on by default), so a chain is evicted tail first instead of having its
  middle cut out, which would orphan the rest.
* A block whose parent is no longer cached can never be hit (a prefix hit
  needs every earlier block), so its value is multiplied by
  ``orphan_factor`` (default 0: it goes first). This is checked when the
  block is released, and when its parent is evicted: the parent's waiting
  children are then re-keyed -- at the next eviction, once the pool has
  settled whether a duplicate took over the parent's hash.

Candidates live in a SortedList of ``(H, release ticket, block)``: O(log n)
per event. Each re-keyed orphan was indexed under its parent by its own
release, so re-keying is O(log n) amortised per release.

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) is no access: it resumes the primary's count
and the chain value its children left.
"""

from __future__ import annotations

from itertools import count
from typing import Hashable

from sortedcontainers import SortedList

from .arc import takes_over
from .base import PolicyBase
from prefixkv.checks import real


class GDSFPolicy(PolicyBase):
    name = "gdsf"

    def __init__(self, depth_cost: float | None = None, orphan_factor: float = 0.0, inherit: bool = True) -> None:
        if depth_cost is not None:
            real("depth_cost", depth_cost, low=0.0)
        real("orphan_factor", orphan_factor, low=0.0, high=1.0)
        self._depth_cost_option = depth_cost
        self.depth_cost = 0.0 if depth_cost is None else depth_cost
        self.orphan_factor = orphan_factor
        self.inherit = inherit
        self._chain: dict[Hashable, float] = {}       # parent hash -> best value of children released since
        self.clock = 0.0                              # L
        self._ticket = count()
        self._freq: dict[int, int] = {}               # cached block -> accesses
        self._hash: dict[int, Hashable] = {}          # cached block -> its hash
        self._key: dict[int, tuple[float, int, int]] = {}  # candidate -> its entry in _candidates
        self._value: dict[int, tuple[float, float]] = {}  # candidate -> (L at release, freq * cost)
        self._candidates = SortedList()               # (H, ticket, block)
        self._kids: dict[Hashable, set[int]] = {}     # parent hash -> candidates keyed as non-orphans
        self._kid_of: dict[int, Hashable] = {}        # candidate -> parent hash it is indexed under
        self._evicted_parents: list[Hashable] = []    # hashes whose children may be orphans now
        self._victim: tuple | None = None  # (hash, freq, chain value) of the latest victim, until the next on_cached

    def bind(self, pool) -> None:
        super().bind(pool)
        if self._depth_cost_option is None:
            self.depth_cost = pool.block_size / 32768

    def on_cached(self, block: int) -> None:
        stale = self._hash.get(block)
        if stale is not None:  # its last residency ended in use (taken up a tier), unannounced
            self._chain.pop(stale, None)
            if stale in self._kids:  # its waiting children may be orphans now
                self._evicted_parents.append(stale)
        block_hash = self._hash[block] = self.pool.block_hash[block]
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            self._freq[block] = victim[1]
            if victim[2] is not None:
                self._chain[block_hash] = victim[2]
            return
        self._freq[block] = 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self._forget_candidate(block)
        self._freq[block] += 1

    def on_released(self, block: int) -> None:
        pool = self.pool
        depth = pool.depth[block]
        value = self._freq[block] * (1.0 + self.depth_cost * depth)
        if self.inherit:
            inherited = self._chain.pop(self._hash[block], 0.0)
            if inherited > value:
                value = inherited
        base = self.clock
        parent_hash = pool.parent_hash[block] if depth else None
        if parent_hash is not None and pool.lookup(parent_hash) is None:
            priority = base + value * self.orphan_factor
        else:
            priority = base + value
            if parent_hash is not None:
                self._kids.setdefault(parent_hash, set()).add(block)
                self._kid_of[block] = parent_hash
                if self.inherit and self._chain.get(parent_hash, 0.0) < value:
                    self._chain[parent_hash] = value
        key = (priority, next(self._ticket), block)
        self._key[block] = key
        self._value[block] = (base, value)
        self._candidates.add(key)

    def _forget_candidate(self, block: int, popped: bool = False) -> None:
        key = self._key.pop(block)
        if not popped:
            self._candidates.remove(key)
        del self._value[block]
        parent_hash = self._kid_of.pop(block, None)
        if parent_hash is not None:
            kids = self._kids[parent_hash]
            kids.discard(block)
            if not kids:
                del self._kids[parent_hash]

    def _orphan_children(self) -> None:
        lookup = self.pool.lookup
        for parent_hash in self._evicted_parents:
            if lookup(parent_hash) is not None:
                continue  # a duplicate took over, or the hash was cached again
            for child in self._kids.pop(parent_hash, ()):
                del self._kid_of[child]
                old = self._key[child]
                self._candidates.remove(old)
                base, value = self._value[child]
                key = (base + value * self.orphan_factor, old[1], child)
                self._key[child] = key
                self._candidates.add(key)
        self._evicted_parents.clear()

    def evict(self) -> int:
        if self._evicted_parents:
            self._orphan_children()
        priority, _, block = self._candidates.pop(0)
        self._forget_candidate(block, popped=True)
        if priority > self.clock:
            self.clock = priority
        block_hash = self._hash.pop(block)
        chain = self._chain.pop(block_hash, None)
        if block_hash in self._kids:
            self._evicted_parents.append(block_hash)
        self._victim = (block_hash, self._freq.pop(block), chain)
        return block

    def priority(self, block: int) -> float:
        """A candidate's current H (for inspection and tests)."""
        return self._key[block][0]

    def clear(self) -> None:
        self.clock = 0.0
        self._victim = None
        self._freq.clear()
        self._hash.clear()
        self._key.clear()
        self._value.clear()
        self._candidates.clear()
        self._kids.clear()
        self._kid_of.clear()
        self._evicted_parents.clear()
        self._chain.clear()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def snapshot(self) -> tuple:
        return (self.clock, tuple(self._candidates), tuple(sorted(self._freq.items())),
                tuple(sorted(self._kid_of.items(), key=repr)), tuple(self._evicted_parents))
