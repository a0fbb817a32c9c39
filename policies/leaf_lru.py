"""LRU among leaves: a block with a cached child is not evicted.

Evicting the middle of a cached chain orphans everything after it (a prefix
hit needs every earlier block), so -- as in SGLang's radix cache -- only
*leaves* are eligible: candidates whose hash no cached block names as its
parent. When a leaf is evicted and it was its parent's last cached child, the
parent becomes eligible in its own release-order place.

Children are counted per parent *hash* (not block), so the count survives a
duplicate taking over as primary. Counts are kept at ``on_cached`` (from
``pool.parent_hash``) and at eviction; a parent is found with
``pool.lookup``. Eligible and ineligible candidates sit in two sorted maps
keyed by release ticket: O(log n) per event.

The pool can produce a candidate whose only cached children are in use (a
sequence that holds a duplicate of the parent and the primary child). If no
leaf is a candidate, the least recently released ineligible candidate is
evicted: the pool's promise that every candidate can be freed comes first.
"""

from __future__ import annotations

from itertools import count
from typing import Hashable

from sortedcontainers import SortedDict

from .base import PolicyBase


class LeafLRUPolicy(PolicyBase):
    name = "leaf-lru"

    def __init__(self) -> None:
        self._ticket = count()
        self._hash: dict[int, Hashable] = {}      # cached block -> its hash
        self._parent: dict[int, Hashable] = {}    # cached block -> its parent hash (depth > 0)
        self._children: dict[Hashable, int] = {}  # hash -> cached blocks naming it as parent
        self._released: dict[int, int] = {}       # candidate -> release ticket
        self._leaves: SortedDict = SortedDict()   # ticket -> eligible candidate
        self._inner: SortedDict = SortedDict()    # ticket -> candidate with a cached child

    def on_cached(self, block: int) -> None:
        pool = self.pool
        if block in self._hash:  # its last residency ended in use (taken up a tier), unannounced
            stale_parent = self._parent.pop(block, None)
            if stale_parent is not None:
                self._drop_child(stale_parent)
        self._hash[block] = pool.block_hash[block]
        parent_hash = pool.parent_hash[block]
        if parent_hash is None:
            return
        self._parent[block] = parent_hash
        n = self._children.get(parent_hash, 0)
        self._children[parent_hash] = n + 1
        if n == 0:  # the parent (if it waits as a candidate) stops being a leaf
            parent = pool.lookup(parent_hash)
            ticket = self._released.get(parent) if parent is not None else None
            if ticket is not None:
                self._inner[ticket] = self._leaves.pop(ticket)

    def on_released(self, block: int) -> None:
        ticket = next(self._ticket)
        self._released[block] = ticket
        if self._children.get(self._hash[block]):
            self._inner[ticket] = block
        else:
            self._leaves[ticket] = block

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            ticket = self._released.pop(block)
            if self._leaves.pop(ticket, None) is None:
                del self._inner[ticket]

    def evict(self) -> int:
        _, block = (self._leaves or self._inner).popitem(0)
        del self._released[block]
        del self._hash[block]
        parent_hash = self._parent.pop(block, None)
        if parent_hash is not None:
            self._drop_child(parent_hash)
        return block

    def _drop_child(self, parent_hash: Hashable) -> None:
        n = self._children[parent_hash] - 1
        if n:
            self._children[parent_hash] = n
        else:
            del self._children[parent_hash]
            parent = self.pool.lookup(parent_hash)
            ticket = self._released.get(parent) if parent is not None else None
            if ticket is not None:
                self._leaves[ticket] = self._inner.pop(ticket)

    def is_leaf(self, block: int) -> bool:
        """Whether a cached block has no cached child (for inspection and tests)."""
        return not self._children.get(self._hash[block])

    def clear(self) -> None:
        self._hash.clear()
        self._parent.clear()
        self._children.clear()
        self._released.clear()
        self._leaves.clear()
        self._inner.clear()

    def __len__(self) -> int:
        return len(self._released)

    def __contains__(self, block: int) -> bool:
        return block in self._released

    def snapshot(self) -> tuple:
        return (tuple(self._leaves.items()), tuple(self._inner.items()),
                tuple(sorted(self._children.items(), key=repr)), tuple(sorted(self._parent.items(), key=repr)))
