"""LRU in flat arrays: the ``lru`` policy of a pool with a flat index.

Same order and the same victims as ``policies.lru.LRUPolicy`` (least recently released first; a
hit takes a block out; a release puts it at the most recent end), kept as a doubly linked list in
two int64 arrays (``lru_kernels``): 16 bytes per block and no Python object per block. Its point
is that a ``FlatBlockPool`` moves blocks in and out of it together with their refcounts in one
compiled call per batch (``FlatBlockPool`` looks for ``arrays``); driven alone, block by block,
through the policy protocol it is correct but no faster than ``LRUPolicy``.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvariantViolation
from ..policies.base import PolicyBase
from . import lru_kernels as k
from .index import as_block_array


class CompiledLRU(PolicyBase):
    name = "lru"
    reads_chain = False
    valid_victims = True

    def __init__(self) -> None:
        self.prev = np.full(0, k.OUT, np.int64)
        self.nxt = np.full(0, k.NONE, np.int64)
        self.ends = np.array([k.NONE, k.NONE, 0], np.int64)     # least recent, most recent, count

    def bind(self, pool) -> None:
        super().bind(pool)
        self.on_grow(len(pool.ref_count))

    def on_grow(self, num_blocks: int) -> None:
        have = self.prev.shape[0]
        if num_blocks <= have:
            return
        prev = np.full(num_blocks, k.OUT, np.int64)
        nxt = np.full(num_blocks, k.NONE, np.int64)
        prev[:have] = self.prev
        nxt[:have] = self.nxt
        self.prev, self.nxt = prev, nxt

    def _blocks(self, blocks) -> np.ndarray:
        arr = as_block_array(blocks if isinstance(blocks, (list, np.ndarray)) else list(blocks))
        if arr.shape[0] and (int(arr.min()) < 0 or int(arr.max()) >= self.prev.shape[0]):
            top = int(arr.max())
            if int(arr.min()) < 0:
                raise IndexError(f"block {int(arr.min())} out of range")
            self.on_grow(top + 1)       # driven without a pool (tests): grow on demand
        return arr

    def on_released(self, block: int) -> None:
        self.on_released_batch((block,))

    def on_released_batch(self, blocks) -> None:
        arr = self._blocks(blocks)      # (first: it may grow the arrays)
        k.append(self.prev, self.nxt, self.ends, arr)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            arr = self._blocks((block,))
            k.unlink(self.prev, self.nxt, self.ends, arr)

    def on_hit_batch(self, blocks) -> None:
        arr = self._blocks(blocks)
        k.unlink(self.prev, self.nxt, self.ends, arr)

    def evict(self) -> int:
        return self.evict_many(1)[0]

    def pop(self, n: int) -> np.ndarray:
        """``evict_many(n)`` as an int64 array."""
        if n > self.ends[2]:
            raise IndexError(f"evict_many({n}) with {int(self.ends[2])} evictable blocks")
        out = np.empty(n, np.int64)
        k.pop_front(self.prev, self.nxt, self.ends, out)
        return out

    def evict_many(self, n: int) -> list[int]:
        return self.pop(n).tolist()

    def clear(self) -> None:
        self.prev.fill(k.OUT)
        self.nxt.fill(k.NONE)
        self.ends[:] = (k.NONE, k.NONE, 0)

    def __len__(self) -> int:
        return int(self.ends[2])

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self.prev.shape[0] and self.prev[block] != k.OUT

    def snapshot(self) -> tuple[int, ...]:
        """The order, least recent first; checks the links on the way (tests read it after every
        step): ``prev`` mirrors ``nxt``, both ends and the count agree, nothing else is marked in."""
        count = int(self.ends[2])
        out = np.empty(count + 1, np.int64)
        n = k.order(self.prev, self.nxt, self.ends, out)
        order = out[:n]
        back = np.empty(n, np.int64)
        if n:
            back[0] = k.NONE
            back[1:] = order[:-1]
        inside = np.count_nonzero(self.prev != k.OUT)
        if (n != count or inside != count or not np.array_equal(self.prev[order], back)
                or (n and (self.ends[1] != order[-1] or self.nxt[order[-1]] != k.NONE))
                or (not n and (self.ends[0] != k.NONE or self.ends[1] != k.NONE))):
            raise InvariantViolation(f"compiled LRU links disagree: {n} blocks reached of {count}, "
                                     f"{inside} marked in the order")
        return tuple(order.tolist())
