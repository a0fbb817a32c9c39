"""Least recently released first.

Blocks are ordered by the time they became evictable. The manager releases a
sequence's blocks tail-first, so a sequence's private tail is evicted before
the prefix it shares with others. A hit takes the block out; its next release
puts it at the most-recent end.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import PolicyBase


class LRUPolicy(PolicyBase):
    name = "lru"

    def __init__(self) -> None:
        # OrderedDict is a C doubly linked list: O(1) append, unlink and pop-oldest.
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_released(self, block: int) -> None:
        self._order[block] = None

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._order[block]

    def evict(self) -> int:
        return self._order.popitem(last=False)[0]

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self._order)
