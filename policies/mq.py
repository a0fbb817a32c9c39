"""MQ (Multi-Queue): LRU queues by access frequency, with expiry that demotes idle blocks.

Zhou, Philbin, Li, "The Multi-Queue Replacement Algorithm for Second Level Buffer Caches",
USENIX ATC 2001.

Rules, as in the paper (and libCacheSim's ``MQ``): a block accessed ``f`` times lives in LRU
queue ``min(floor(log2 f), n_queues - 1)``; each access (publish or hit) sets its expiry to
``now + lifetime`` and then runs *Adjust*: the clock ticks, and the least recent block of
every queue above 0 whose expiry has passed moves down one queue (to its most recent end),
with a fresh expiry. The victim is the least recent block of the lowest non-empty queue; its
hash and count go to the history Qout (a FIFO of ``ghost_ratio x capacity`` hashes), and a
block whose hash comes back from Qout resumes its count plus one. Defaults are libCacheSim's:
8 queues, lifetime 10,000 accesses, Qout 4x the cache.

On the evictable set: each queue holds its candidates in release order (a block in use keeps
its queue and expiry; Adjust and eviction see candidates only). An access's Adjust runs at the
next release or eviction, so the accessed block is back in its queue first, as in MQ where it
is linked before Adjust runs. Qout is looked up as if before the eviction (``policies/ghosts.py``).
Every event is O(n_queues). With one-block requests this is exactly libCacheSim's ``MQ``
(``tests/policies/test_libcachesim_equality.py``).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's count, queue and expiry; its Qout entry is taken back.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixkv.checks import integer, real

from .arc import takes_over
from .base import PolicyBase
from .ghosts import GhostList


class MQPolicy(PolicyBase):
    name = "mq"
    reads_chain = False

    def __init__(self, n_queues: int = 8, lifetime: int = 10_000, ghost_ratio: float = 4.0) -> None:
        self.n_queues = integer("n_queues", n_queues, low=1, high=64, integral_float=True)
        self.lifetime = integer("lifetime", lifetime, low=1, integral_float=True)
        real("ghost_ratio", ghost_ratio, low=0.0)
        self.ghost_ratio = ghost_ratio
        self._vtime = 0                 # Adjust runs so far, pending ones included
        self._pending = 0               # Adjust runs owed (accesses since the last release/eviction)
        self._freq: dict[int, int] = {}     # cached block -> access count
        self._queue: dict[int, int] = {}    # cached block -> its queue
        self._expire: dict[int, int] = {}   # cached block -> expiry (virtual time)
        self._cands: list[OrderedDict] = [OrderedDict() for _ in range(self.n_queues)]
        self._ghost = GhostList(1 << 62)    # Qout: hash -> count
        self._victim: tuple | None = None   # (hash, freq, queue, expiry) of the latest victim

    def bind(self, pool) -> None:
        super().bind(pool)
        self._ghost.limit = int(pool.num_blocks * self.ghost_ratio)

    def _queue_of(self, freq: int) -> int:
        return min(freq.bit_length() - 1, self.n_queues - 1)

    def _access(self, block: int, freq: int) -> None:
        self._freq[block] = freq
        self._queue[block] = self._queue_of(freq)
        self._expire[block] = self._vtime + self.lifetime
        self._vtime += 1
        self._pending += 1

    def _adjust(self) -> None:
        """The owed Adjust runs, each at its own virtual time."""
        cands = self._cands
        expire = self._expire
        queue = self._queue
        lifetime = self.lifetime
        for vtime in range(self._vtime - self._pending + 1, self._vtime + 1):
            for k in range(1, self.n_queues):
                q = cands[k]
                if q:
                    block = next(iter(q))
                    if expire[block] < vtime:
                        del q[block]
                        cands[k - 1][block] = None
                        queue[block] = k - 1
                        expire[block] = vtime + lifetime
        self._pending = 0

    def on_cached(self, block: int) -> None:
        block_hash = self.pool.block_hash[block]
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            self._ghost.undo(block_hash)
            _, self._freq[block], self._queue[block], self._expire[block] = victim
            return
        self._access(block, self._ghost.take(block_hash, 0) + 1)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._cands[self._queue[block]][block]
        self._access(block, self._freq[block] + 1)

    def on_released(self, block: int) -> None:
        self._cands[self._queue[block]][block] = None
        if self._pending:
            self._adjust()

    def evict(self) -> int:
        if self._pending:
            self._adjust()
        for q in self._cands:
            if q:
                block = q.popitem(last=False)[0]
                break
        else:
            raise IndexError("evict() with no evictable block")
        freq = self._freq.pop(block)
        block_hash = self.pool.block_hash[block]
        self._ghost.add(block_hash, freq)
        self._victim = (block_hash, freq, self._queue.pop(block), self._expire.pop(block))
        return block

    def clear(self) -> None:
        self._victim = None
        self._vtime = self._pending = 0
        self._freq.clear()
        self._queue.clear()
        self._expire.clear()
        for q in self._cands:
            q.clear()
        self._ghost.clear()

    def __len__(self) -> int:
        return sum(map(len, self._cands))

    def __contains__(self, block: int) -> bool:
        queue = self._queue.get(block)
        return queue is not None and block in self._cands[queue]

    def snapshot(self) -> tuple:
        return (tuple(tuple(q) for q in self._cands), tuple(sorted(self._freq.items())),
                tuple(sorted(self._queue.items())), tuple(sorted(self._expire.items())), self._vtime,
                self._pending, self._ghost.snapshot())
