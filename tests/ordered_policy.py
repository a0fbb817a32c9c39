"""A plain eviction policy over an OrderedDict, for tests that need a policy of their own (a
broken variant, an unusual victim order): LRUPolicy's own layout is internal. Subclasses change
``evict`` (or another event); no batch events, so the pool calls every single one."""

from __future__ import annotations

from collections import OrderedDict

from prefixkv.policies import PolicyBase


class OrderedPolicy(PolicyBase):
    name = "ordered"

    def __init__(self):
        self._order = OrderedDict()

    def on_released(self, block):
        self._order[block] = None

    def on_hit(self, block, was_evictable):
        if was_evictable:
            del self._order[block]

    def evict(self):
        """The least recently released candidate (LRU)."""
        return self._order.popitem(last=False)[0]

    def clear(self):
        self._order.clear()

    def __len__(self):
        return len(self._order)

    def __contains__(self, block):
        return block in self._order

    def snapshot(self):
        return tuple(self._order)
