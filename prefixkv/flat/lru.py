"""LRU in flat arrays: the ``lru`` policy of a pool with a flat index.

Same order and the same victims as ``policies.lru.LRUPolicy`` (least recently released first; a
hit takes a block out; a release puts it at the most recent end), kept as a doubly linked list in
two arrays (int32 where every block id fits, else int64): 8 bytes per block and no Python object
per block. Its point is that a
``FlatBlockPool`` moves a long batch of blocks in and out of it together with their refcounts in
one compiled call (``lru_kernels``, on ``views()`` of the arrays). A short batch (a decode step's
block, a short prompt's release) costs less as a few Python index operations on the arrays
(``array``: Python reads them at list speed) than as a compiled call, so below ``SMALL``
blocks the policy protocol's events run here in Python.
"""

from __future__ import annotations

from array import array

import numpy as np

from ..errors import InvariantViolation
from ..policies.base import PolicyBase
from . import lru_kernels as k
from .index import as_block_array

OUT, NONE = k.OUT, k.NONE
# Batches shorter than this run as Python loops (a compiled call costs ~2 us to set up, a block
# ~0.3 us in Python); the pool uses the same bound for its compiled batches.
SMALL = 16


class CompiledLRU(PolicyBase):
    name = "lru"
    reads_chain = False
    valid_victims = True

    def __init__(self) -> None:
        k.warm()
        self._code, self._dtype = "q", np.int64
        self._prev = array("q")
        self._nxt = array("q")
        self._ends = array("q", (NONE, NONE, 0))     # least recent, most recent, count

    def views(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``prev``, ``nxt`` and ``ends`` as arrays for the kernels; views of the storage, to drop
        before the pool grows (a buffer cannot be resized while it is exported)."""
        return (np.frombuffer(self._prev, self._dtype), np.frombuffer(self._nxt, self._dtype),
                np.frombuffer(self._ends, np.int64))

    def bind(self, pool) -> None:
        super().bind(pool)
        if not len(self._prev) and pool.num_blocks < 2**31 - 1:
            # links of 4 bytes where every block id fits (16 -> 8 bytes per block)
            self._code, self._dtype = "i", np.int32
            self._prev, self._nxt = array("i"), array("i")
        self.on_grow(len(pool.ref_count))

    def on_grow(self, num_blocks: int) -> None:
        grow = num_blocks - len(self._prev)
        if grow > 0:
            self._prev.extend(array(self._code, (OUT,)) * grow)
            self._nxt.extend(array(self._code, (NONE,)) * grow)

    def _check(self, blocks) -> list | np.ndarray:
        """``blocks`` as a list or int64 array, the storage grown to cover them (driven without a
        pool, as tests do)."""
        if not isinstance(blocks, (list, np.ndarray)):
            blocks = list(blocks)
        if len(blocks):
            low, high = min(blocks), max(blocks)
            if low < 0:
                raise IndexError(f"block {int(low)} out of range")
            if high >= len(self._prev):
                self.on_grow(int(high) + 1)
        return blocks

    # -- events ----------------------------------------------------------------
    def on_released(self, block: int) -> None:
        self.on_released_batch((block,))

    def on_released_batch(self, blocks) -> None:
        blocks = self._check(blocks)
        if len(blocks) >= SMALL:
            prev, nxt, ends = self.views()
            k.append(prev, nxt, ends, as_block_array(blocks))
            return
        prev, nxt, ends = self._prev, self._nxt, self._ends
        for b in blocks:
            b = int(b)
            if prev[b] != OUT:
                self._unlink(b)
            tail = ends[1]
            prev[b] = tail
            nxt[b] = NONE
            if tail == NONE:
                ends[0] = b
            else:
                nxt[tail] = b
            ends[1] = b
            ends[2] += 1

    def _unlink(self, b: int) -> None:
        prev, nxt, ends = self._prev, self._nxt, self._ends
        p, n = prev[b], nxt[b]
        if p == NONE:
            ends[0] = n
        else:
            nxt[p] = n
        if n == NONE:
            ends[1] = p
        else:
            prev[n] = p
        prev[b] = OUT
        ends[2] -= 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self.on_hit_batch((block,))

    def on_hit_batch(self, blocks) -> None:
        blocks = self._check(blocks)
        if len(blocks) >= SMALL:
            prev, nxt, ends = self.views()
            k.unlink(prev, nxt, ends, as_block_array(blocks))
            return
        prev = self._prev
        for b in blocks:
            if prev[b] != OUT:
                self._unlink(int(b))

    def evict(self) -> int:
        return self.evict_many(1)[0]

    def pop(self, n: int) -> np.ndarray:
        """``evict_many(n)`` as an int64 array (one compiled walk)."""
        if n > self._ends[2]:
            raise IndexError(f"evict_many({n}) with {self._ends[2]} evictable blocks")
        out = np.empty(n, np.int64)
        prev, nxt, ends = self.views()
        k.pop_front(prev, nxt, ends, out)
        return out

    def evict_many(self, n: int) -> list[int]:
        if n >= SMALL:
            return self.pop(n).tolist()
        prev, nxt, ends = self._prev, self._nxt, self._ends
        if n > ends[2]:
            raise IndexError(f"evict_many({n}) with {ends[2]} evictable blocks")
        out = []
        b = ends[0]
        for _ in range(n):
            out.append(b)
            prev[b] = OUT
            b = nxt[b]
        if n:
            ends[0] = b
            if b == NONE:
                ends[1] = NONE
            else:
                prev[b] = NONE
            ends[2] -= n
        return out

    def clear(self) -> None:
        n = len(self._prev)
        self._prev[:] = array(self._code, (OUT,)) * n
        self._nxt[:] = array(self._code, (NONE,)) * n
        self._ends[:] = array("q", (NONE, NONE, 0))

    def __len__(self) -> int:
        return self._ends[2]

    def __contains__(self, block: int) -> bool:
        return 0 <= block < len(self._prev) and self._prev[block] != OUT

    def snapshot(self) -> tuple[int, ...]:
        """The order, least recent first; checks the links on the way (tests read it after every
        step): ``prev`` mirrors ``nxt``, both ends and the count agree, nothing else is marked in."""
        prev, nxt, ends = self.views()
        count = int(ends[2])
        out = np.empty(count + 1, np.int64)
        n = k.order(prev, nxt, ends, out)
        order = out[:n]
        back = np.empty(n, np.int64)
        if n:
            back[0] = NONE
            back[1:] = order[:-1]
        inside = np.count_nonzero(prev != OUT)
        if (n != count or inside != count or not np.array_equal(prev[order], back)
                or (n and (ends[1] != order[-1] or nxt[order[-1]] != NONE))
                or (not n and (ends[0] != NONE or ends[1] != NONE))):
            raise InvariantViolation(f"compiled LRU links disagree: {n} blocks reached of {count}, "
                                     f"{inside} marked in the order")
        return tuple(order.tolist())

    def __repr__(self) -> str:
        return f"CompiledLRU(candidates={len(self)})"
