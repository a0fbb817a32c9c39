"""LRFU on the workload's own time scale, with ghost memory and a learned dead-leaf penalty.

Score. Each access of a block (its publish, every hit) adds 1 to its combined
recency-frequency value, and all values halve every ``H`` releases:
``CRF = sum 2**(-age_i / H)`` over its accesses (LRFU, Lee et al., IEEE TC
2001). The lowest CRF is evicted, ties going to the least recently released
block. ``H`` small is LRU, large is LFU.

Time scale. ``H`` is not tied to the cache size but to the workload: it is
``half_life`` times the median reuse distance -- releases between two
accesses of the same hash, hits and re-publishes alike -- tracked online from
every access whose previous access is still remembered (a stochastic
approximation of the median: multiply by ``exp(+-step)`` per observation; the
tracker remembers the accesses of the last ``memory`` medians' worth of
releases, and of at most 64 times the pool's capacity; the lengths derived from
the median are recomputed whenever it has moved by 1%). So a block's frequency is
forgotten over a few of the workload's typical reuse intervals, whatever the
cache holds: at a tight capacity that is many cache turnovers (frequency
outweighs recency), at a generous one less than one. Because ``H`` moves,
scores live on a warped clock: ``tau`` advances ``1 / H`` per release, and a
block's key is fixed at its last access as the log-score
``s = tau + log2 CRF``. Every candidate decays at the same rate at every
moment, so their order never changes while they wait: one sorted list,
O(log n) per release, hit and eviction (the tracker and the experiments below
are O(1) amortised).

Ghost memory. An evicted block leaves its log-score behind under its hash (at
most ``ghost * H`` hashes, the oldest forgotten first). A hash cached again
while remembered resumes from that score plus the new access; a hash never
seen (or forgotten) starts at CRF 1, below every block with a recent second
access. This is the cheap admission filter: content that is never reused
passes through the cold end, and a working set larger than the cache (agent
sessions that re-read ever longer contexts) cannot flush the blocks that keep
being reused, as it does under LRU. Without ghosts, the frequency a block
earned would die with each eviction.

Chains. A parent is accessed whenever its child is, so its CRF is never lower,
and it is released after the child (tail first), so on a tie it is younger:
chains are evicted tail first (in a cache-only replay no victim ever has a
cached block under it; the leaf penalty below keeps that).

Dead leaves. Whether the tail of a request -- a block released with no cached
child -- is reused depends on the workload: a Mooncake request ends in a partly
filled block whose hash the next turn cannot match (almost never reused), an
agent session extends exactly there (its likeliest continuation point). So the
policy learns it, with no look-ahead: each release is an experiment, open for
``window * H`` releases, of one kind (leaf or inner); an access of its hash
while open scores 1 for its kind, expiry 0. ``p_leaf`` and ``p_inner`` are
exponentially weighted means of those outcomes (step ``rate``, both starting at
0.5), and a leaf's log-score is lowered by ``log2(p_leaf / p_inner)`` when that
is negative. Never raised: a leaf ranked above its parent would be orphaned
when the parent goes first, while lowering a block with no cached child can
orphan nothing. ``leaf_penalty=False`` turns it off.

``reuse_distance`` sets the median's starting value (default: the pool's
capacity); with ``step=0`` it stays there, which makes ``H`` a fixed number of
releases. Learned estimates, ghosts and the reuse tracker describe hashes and
the workload, not blocks: ``clear()`` keeps them.

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) is no access and no ghost hit: the hash never
left the cache. It resumes the primary's score, and the ghost that eviction
left (with any older ghost it pushed out) is taken back.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from math import exp, log2
from typing import Hashable

from sortedcontainers import SortedList

from .arc import takes_over
from .base import PolicyBase
from prefixkv.checks import real

_FLOOR = 1e-3  # reuse estimates are floored here for the log ratio (a leaf penalty of at most ~10 half-lives)


def bump(score: float | None, now: float) -> float:
    """Log-score after one more access at clock ``now``: ``log2(2**score + 2**now)``."""
    if score is None:
        return now
    d = score - now
    if d > 0.0:
        return score + log2(1.0 + 2.0 ** -d)
    return now + log2(1.0 + 2.0 ** d)


class LRFUPolicy(PolicyBase):
    name = "lrfu"

    def __init__(self, half_life: float = 2.0, ghost: float = 0.5, step: float = 0.002, memory: float = 8.0,
                 reuse_distance: float | None = None, window: float = 1.0, rate: float = 0.01,
                 leaf_penalty: bool = True) -> None:
        for name, value in (("half_life", half_life), ("ghost", ghost), ("step", step), ("memory", memory),
                            ("reuse_distance", reuse_distance), ("window", window), ("rate", rate)):
            if value is not None:
                real(name, value)   # a number, finite: the lengths below are ints of them
        if (half_life <= 0 or ghost < 0 or step < 0 or memory <= 0 or window <= 0 or not 0.0 < rate <= 1.0
                or (reuse_distance is not None and reuse_distance <= 0)):
            raise ValueError("need half_life, memory, window, reuse_distance > 0, ghost, step >= 0 "
                             "and 0 < rate <= 1")
        # the median moves by a factor exp(+-step) per observation: a larger step overflows it within
        # a few observations (and is no approximation of anything)
        real("step", step, high=1.0)
        self.half_life = half_life
        self.ghost = ghost
        self.step = step
        self.memory = memory
        self.reuse_distance = reuse_distance
        self.window = window
        self.rate = rate
        self.leaf_penalty = leaf_penalty
        self.p_leaf = 0.5                            # reuse within the window: leaves / inner blocks
        self.p_inner = 0.5
        self._median = float(reuse_distance or 1024)  # of the reuse distance (releases)
        self._up, self._down = exp(step), exp(-step)
        self._low = self._high = 0.0                 # rescale when the median leaves (low, high)
        self._h = 1.0                                # H, the half-life in releases (set by _rescale)
        self._inv_h = 1.0
        self._ghost_limit = 0
        self._window = 1
        self._memory = 1
        self._memory_cap = 1 << 62                   # tracker memory <= 64 * capacity releases
        self._now = 0                                # releases so far
        self._tau = 0.0                              # the warped clock, in half-lives
        self._hashes: list = []                      # the pool's block_hash / parent_hash lists
        self._parents: list = []
        self._score: dict[int, float] = {}           # cached block -> log-score at its last access
        self._key: dict[int, tuple] = {}             # candidate -> (key, release tick, block)
        self._order = SortedList()                   # candidates' entries, lowest (first out) first
        self._kids: dict[Hashable, int] = {}         # hash -> number of cached blocks under it
        self._parent_of: dict[int, Hashable] = {}    # cached block -> the parent hash it counts under
        self._ghosts: OrderedDict = OrderedDict()    # evicted hash -> log-score, oldest first
        self._last: dict[Hashable, int] = {}         # hash -> tick of its last access (reuse tracker)
        self._accesses: deque = deque()              # (tick, hash) of the remembered accesses
        # Leaf experiments in release order, (tick, hash, is leaf); the open ones by hash. A later
        # release of a hash supersedes its entry.
        self._released: deque = deque()
        self._open: dict[Hashable, tuple] = {}
        # (hash, score, ghosts it pushed out) of the latest victim until the next on_cached: what a
        # duplicate taking the hash over resumes
        self._victim: tuple | None = None
        self._rescale()

    def bind(self, pool) -> None:
        super().bind(pool)
        self._hashes = pool.block_hash      # refilled in place on reset: safe to keep
        self._parents = pool.parent_hash
        if self.reuse_distance is None:
            self._median = float(pool.num_blocks)
        self._memory_cap = 64 * pool.num_blocks
        self._rescale()

    # -- learning ----------------------------------------------------------------------------------------
    def _rescale(self) -> None:
        """Derive the lengths from the median; redone whenever it has moved by 1%."""
        median = self._median
        self._low = median * 0.99
        self._high = median * 1.01
        h = self._h = self.half_life * median
        self._inv_h = 1.0 / h
        self._ghost_limit = int(self.ghost * h)
        self._window = max(1, int(self.window * h))
        self._memory = min(int(self.memory * median) + 1, self._memory_cap)

    def _accessed(self, block_hash: Hashable) -> None:
        """Every access: feed the reuse-distance median, close the hash's open leaf experiment."""
        now = self._now
        last = self._last
        if self.step:
            previous = last.get(block_hash)
            if previous is not None:
                # Stochastic approximation of the median (multiplicative steps: in the log domain).
                median = self._median
                median = self._median = median * (self._up if now - previous + 0.5 > median else self._down)
                if not self._low < median < self._high:
                    self._rescale()
        last[block_hash] = now
        accesses = self._accesses
        accesses.append((now, block_hash))
        if accesses[0][0] < now - self._memory:
            limit = now - self._memory
            while accesses[0][0] < limit:
                tick, old = accesses.popleft()
                if last.get(old) == tick:
                    del last[old]
        if self._open:
            entry = self._open.pop(block_hash, None)
            if entry is not None:
                self._learn(entry[2], 1.0)

    def _learn(self, leaf: bool, outcome: float) -> None:
        if leaf:
            self.p_leaf += self.rate * (outcome - self.p_leaf)
        else:
            self.p_inner += self.rate * (outcome - self.p_inner)

    def penalty(self) -> float:
        """What a leaf's log-score loses now (half-lives, >= 0)."""
        if not self.leaf_penalty:
            return 0.0
        ratio = max(self.p_leaf, _FLOOR) / max(self.p_inner, _FLOOR)
        return -log2(ratio) if ratio < 1.0 else 0.0

    @property
    def median_reuse_distance(self) -> float:
        return self._median

    @property
    def half_life_releases(self) -> float:
        return self._h

    # -- events ------------------------------------------------------------------------------------------
    def on_cached(self, block: int) -> None:
        block_hash = self._hashes[block]
        parent_hash = self._parents[block]
        if block in self._score:  # its last residency ended in use (taken up a tier), unannounced
            self._drop_kid(block)
        if parent_hash is not None:
            kids = self._kids
            kids[parent_hash] = kids.get(parent_hash, 0) + 1
            self._parent_of[block] = parent_hash
        ghosts = self._ghosts
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            ghosts.pop(block_hash, None)
            for entry in reversed(victim[2]):  # back where they were, the oldest
                if entry[0] != block_hash:
                    ghosts[entry[0]] = entry[1]
                    ghosts.move_to_end(entry[0], last=False)
            self._score[block] = victim[1]
            return
        self._score[block] = bump(ghosts.pop(block_hash, None) if ghosts else None, self._tau)
        self._accessed(block_hash)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self._order.remove(self._key.pop(block))
        self._score[block] = bump(self._score[block], self._tau)
        self._accessed(self._hashes[block])

    def on_released(self, block: int) -> None:
        now = self._now = self._now + 1
        self._tau += self._inv_h
        block_hash = self._hashes[block]
        leaf = block_hash not in self._kids
        score = self._score[block]
        if leaf and self.leaf_penalty:
            score -= self.penalty()
        key = (score, now, block)
        self._key[block] = key
        self._order.add(key)
        entry = (now, block_hash, leaf)
        opened = self._open
        opened[block_hash] = entry
        released = self._released
        released.append(entry)
        if released[0][0] <= now - self._window:  # close (as not reused) what left the window
            horizon = now - self._window
            while released[0][0] <= horizon:
                old = released.popleft()
                if opened.get(old[1]) is old:
                    del opened[old[1]]
                    self._learn(old[2], 0.0)

    def evict(self) -> int:
        _, _, block = self._order.pop(0)
        del self._key[block]
        score = self._score.pop(block)
        ghosts = self._ghosts
        block_hash = self._hashes[block]
        ghosts[block_hash] = score
        dropped = ()
        if len(ghosts) > self._ghost_limit:
            dropped = []
            while len(ghosts) > self._ghost_limit:
                dropped.append(ghosts.popitem(last=False))
        self._victim = (block_hash, score, dropped)
        self._drop_kid(block)
        return block

    def _drop_kid(self, block: int) -> None:
        parent_hash = self._parent_of.pop(block, None)
        if parent_hash is not None:
            kids = self._kids
            left = kids[parent_hash] - 1
            if left:
                kids[parent_hash] = left
            else:
                del kids[parent_hash]

    def crf(self, block: int) -> float:
        """A cached block's combined recency-frequency value now (for inspection and tests)."""
        return 2.0 ** (self._score[block] - self._tau)

    def clear(self) -> None:
        self._victim = None
        self._score.clear()
        self._key.clear()
        self._order.clear()
        self._kids.clear()
        self._parent_of.clear()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def snapshot(self) -> tuple:
        return (self._now, self._tau, self._median, self.p_leaf, self.p_inner, tuple(self._order),
                tuple(sorted(self._score.items())), tuple(sorted(self._kids.items(), key=repr)),
                tuple(self._ghosts.items()), tuple(sorted(self._last.items(), key=repr)),
                tuple(e for e in self._released if self._open.get(e[1]) is e))
