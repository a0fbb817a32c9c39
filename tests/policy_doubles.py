"""Policy doubles shared by the pool tests."""

from prefixkv.policies import LRUPolicy


class SingleEventLRU(LRUPolicy):
    """LRU told block by block: overriding the single events hides every batch from the pool."""
    name = "lru-single"

    def on_cached(self, block):
        pass

    def on_released(self, block):
        LRUPolicy.on_released(self, block)

    def on_hit(self, block, was_evictable):
        LRUPolicy.on_hit(self, block, was_evictable)

    def evict(self):
        return LRUPolicy.evict(self)
