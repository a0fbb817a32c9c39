"""The eviction policies beyond LRU/FIFO: each against a brute-force reference,
each shown to differ from LRU where it should, each run through the real manager.

The unit tests drive a policy through a ``FakePool`` (just the metadata a
policy reads) with random *legal* event sequences: a block is cached once
while active, released, hit (taking it back if it waited), evicted only when
it waits. Hashes come from a fixed tree (``parent_of``), so chains, orphans
and hashes that come back after eviction (ghost hits) all happen. Every
reference below is a plain-list restatement of the policy's rule, O(n) per
step and independent of the policy's indexes.
"""

from __future__ import annotations

import math
import random
import time
from math import inf, log, log2

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import BlockPool, BlockRemoved, KVCacheManager
from prefixkv.policies import (ARCPolicy, BeladyPolicy, EvictionPolicy, GDSFPolicy, LeafLRUPolicy, LFUPolicy,
                               LRFUPolicy, LRUPolicy, PolicyRegistry, PriorityPolicy, S3FIFOPolicy, SessionHint,
                               SessionPolicy, SLRUPolicy, WorkloadPolicy, available_policies, make_policy)
import prefixkv.policies as policies_module

NAMES = ["lru", "fifo", "lfu", "slru", "s3fifo", "arc", "leaf-lru", "gdsf", "workload", "lrfu", "session", "belady"]
NUM_BLOCKS = 8
NUM_HASHES = 14


def parent_of(h):
    """A fixed binary forest of hashes: 0 and 1 are roots, 2k+2 and 2k+3 are children of k."""
    return None if h < 2 else (h - 2) // 2


def depth_of(h):
    d = 0
    while (h := parent_of(h)) is not None:
        d += 1
    return d


class FakePool:
    """The part of BlockPool a policy reads."""

    def __init__(self, num_blocks: int = NUM_BLOCKS) -> None:
        self.num_blocks = num_blocks
        self.block_size = 4
        self.block_hash = [None] * num_blocks
        self.parent_hash = [None] * num_blocks
        self.depth = [0] * num_blocks
        self.priority = [0] * num_blocks
        self.num_tokens = [4] * num_blocks
        self._cached: dict = {}
        self.lookup = self._cached.get
        self.hint = None   # the SessionHint of the release in progress (set by the driver)
        self.release_size = 0   # blocks handed to that release (set by the driver)

    def cache(self, block, h, parent=None, depth=None):
        self.block_hash[block] = h
        self.parent_hash[block] = parent_of(h) if parent is None and depth is None else parent
        self.depth[block] = depth_of(h) if depth is None else depth
        self._cached[h] = block

    def drop(self, block):
        del self._cached[self.block_hash[block]]
        self.block_hash[block] = None


# -- brute-force references ----------------------------------------------------------------------------------
class Ref:
    """Candidates with their release tick; subclasses state the victim rule."""

    def __init__(self, pool):
        self.pool = pool
        self.tick = 0
        self.rel = {}  # candidate -> release tick (larger = more recent)

    def cached(self, b):
        pass

    def released(self, b):
        self.tick += 1
        self.rel[b] = self.tick

    def hit(self, b, was_evictable):
        if was_evictable:
            del self.rel[b]

    def evict(self):
        """Choose (and forget) the victim; the driver checks the policy picks the same."""
        victim = self.choose()
        del self.rel[victim]
        self.forget(victim)
        return victim

    def forget(self, b):
        pass

    def clear(self):
        self.rel.clear()

    def lru(self, blocks):
        return min(blocks, key=self.rel.__getitem__)


class RefLRU(Ref):
    def choose(self):
        return self.lru(self.rel)


class RefLFU(Ref):
    """Exact integer weights: an access in epoch k adds 2**k (counts halve every half_life accesses)."""

    def __init__(self, pool, half_life):
        super().__init__(pool)
        self.half_life = half_life
        self.accesses = 0
        self.weight = {}

    def access(self, b):
        self.weight[b] = self.weight.get(b, 0) + 2 ** (self.accesses // self.half_life)
        self.accesses += 1

    def cached(self, b):
        self.weight.pop(b, None)
        self.access(b)

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        self.access(b)

    def choose(self):
        return min(self.rel, key=lambda b: (self.weight[b], self.rel[b]))

    def forget(self, b):
        del self.weight[b]

    def clear(self):
        super().clear()
        self.weight.clear()
        self.accesses = 0


class RefSLRU(Ref):
    def __init__(self, pool, limit):
        super().__init__(pool)
        self.limit = limit
        self.protected = {}   # cached block -> bool
        self.probation_q = []  # candidates in order
        self.protected_q = []

    def demote(self):
        while sum(self.protected.values()) > self.limit and self.protected_q:
            d = self.protected_q.pop(0)
            self.protected[d] = False
            self.probation_q.append(d)

    def cached(self, b):
        self.protected[b] = False

    def released(self, b):
        super().released(b)
        (self.protected_q if self.protected[b] else self.probation_q).append(b)
        if self.protected[b]:
            self.demote()

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        if was_evictable:
            (self.protected_q if self.protected[b] else self.probation_q).remove(b)
        if not self.protected[b]:
            self.protected[b] = True
            self.demote()

    def choose(self):
        return (self.probation_q or self.protected_q)[0]

    def forget(self, b):
        (self.probation_q if b in self.probation_q else self.protected_q).remove(b)
        del self.protected[b]

    def clear(self):
        super().clear()
        self.protected.clear()
        self.probation_q.clear()
        self.protected_q.clear()


class RefS3FIFO(Ref):
    """Queues of every cached block in entry order; the victim search skips blocks in use."""

    def __init__(self, pool, small_target, ghost_size, threshold=1, max_freq=3):
        super().__init__(pool)
        self.small_target, self.ghost_size, self.threshold, self.max_freq = small_target, ghost_size, threshold, max_freq
        self.small, self.main, self.ghost, self.freq = [], [], [], {}

    def cached(self, b):
        h = self.pool.block_hash[b]
        if h in self.ghost:
            self.ghost.remove(h)
            self.main.append(b)
        else:
            self.small.append(b)
        self.freq[b] = 0

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        self.freq[b] = min(self.freq[b] + 1, self.max_freq)

    def choose(self):
        while True:
            s = [b for b in self.small if b in self.rel]
            m = [b for b in self.main if b in self.rel]
            if s and (len(self.small) >= self.small_target or not m):
                t = s[0]
                self.small.remove(t)
                if self.freq[t] >= self.threshold:
                    self.main.append(t)
                    continue
                self.ghost.append(self.pool.block_hash[t])
                del self.ghost[:-self.ghost_size]
                return t
            t = m[0]
            self.main.remove(t)
            if self.freq[t]:
                self.freq[t] -= 1
                self.main.append(t)
                continue
            return t

    def forget(self, b):
        del self.freq[b]

    def clear(self):
        super().clear()
        self.small, self.main, self.ghost, self.freq = [], [], [], {}


class RefARC(Ref):
    def __init__(self, pool, capacity):
        super().__init__(pool)
        self.c = capacity
        self.p = 0.0
        self.where = {}  # cached block -> 1 | 2
        self.b1, self.b2 = [], []

    def trim(self):
        t1 = sum(1 for w in self.where.values() if w == 1)
        while self.b1 and t1 + len(self.b1) > self.c:
            self.b1.pop(0)
        while len(self.where) + len(self.b1) + len(self.b2) > 2 * self.c:
            (self.b2 if self.b2 else self.b1).pop(0)

    def cached(self, b):
        h = self.pool.block_hash[b]
        if h in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self.b1.remove(h)
            self.where[b] = 2
        elif h in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self.b2.remove(h)
            self.where[b] = 2
        else:
            self.where[b] = 1
        self.trim()

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        self.where[b] = 2

    def choose(self):
        c1 = [b for b in self.rel if self.where[b] == 1]
        c2 = [b for b in self.rel if self.where[b] == 2]
        t1 = sum(1 for w in self.where.values() if w == 1)
        return self.lru(c1) if c1 and (t1 > self.p or not c2) else self.lru(c2)

    def forget(self, b):
        (self.b1 if self.where.pop(b) == 1 else self.b2).append(self.pool.block_hash[b])
        self.trim()

    def clear(self):
        super().clear()
        self.p = 0.0
        self.where.clear()
        self.b1, self.b2 = [], []


class RefLeafLRU(Ref):
    """A candidate is eligible iff no cached block names its hash as parent."""

    def choose(self):
        pool = self.pool
        cached = list(pool._cached.values())
        leaves = [b for b in self.rel if not any(pool.parent_hash[c] == pool.block_hash[b] for c in cached)]
        return self.lru(leaves or self.rel)


class RefGDSF(Ref):
    def __init__(self, pool, depth_cost=None, orphan_factor=0.0, inherit=True):
        super().__init__(pool)
        self.depth_cost = pool.block_size / 32768 if depth_cost is None else depth_cost
        self.orphan_factor, self.inherit = orphan_factor, inherit
        self.clock = 0.0
        self.freq, self.h, self.value, self.keyed_under, self.chain = {}, {}, {}, {}, {}
        self.pending = []

    def cached(self, b):
        self.freq[b] = 1

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        if was_evictable:
            del self.h[b], self.value[b]
            self.keyed_under.pop(b, None)
        self.freq[b] += 1

    def released(self, b):
        super().released(b)
        pool = self.pool
        value = self.freq[b] * (1.0 + self.depth_cost * pool.depth[b])
        if self.inherit:  # worth at least the best child released since this block's last release
            value = max(value, self.chain.pop(pool.block_hash[b], 0.0))
        self.value[b] = (self.clock, value)
        parent = pool.parent_hash[b] if pool.depth[b] else None
        if parent is not None and pool.lookup(parent) is None:
            self.h[b] = self.clock + value * self.orphan_factor
        else:
            self.h[b] = self.clock + value
            if parent is not None:
                self.keyed_under[b] = parent
                if self.inherit:
                    self.chain[parent] = max(self.chain.get(parent, 0.0), value)

    def choose(self):
        for parent in self.pending:  # orphan the waiting children of parents that stayed uncached
            if self.pool.lookup(parent) is None:
                for b in [b for b, p in self.keyed_under.items() if p == parent]:
                    base, value = self.value[b]
                    self.h[b] = base + value * self.orphan_factor
                    del self.keyed_under[b]
        self.pending = []
        victim = min(self.rel, key=lambda b: (self.h[b], self.rel[b]))
        self.clock = max(self.clock, self.h[victim])
        return victim

    def forget(self, b):
        del self.h[b], self.value[b], self.freq[b]
        self.keyed_under.pop(b, None)
        self.chain.pop(self.pool.block_hash[b], None)
        if self.pool.block_hash[b] in self.keyed_under.values():
            self.pending.append(self.pool.block_hash[b])

    def clear(self):
        super().clear()
        self.clock = 0.0
        self.freq, self.h, self.value, self.keyed_under, self.chain = {}, {}, {}, {}, {}
        self.pending = []


class RefWorkload(Ref):
    def __init__(self, pool, rate=0.05, prior=0.5, horizon=0.1, window=2.0, by_depth=False):
        super().__init__(pool)
        self.rate, self.by_depth = rate, by_depth
        self.tau, self.window = horizon * pool.num_blocks, window * pool.num_blocks
        self.mean = prior
        self.est, self.root, self.cls = {}, {}, {}
        self.ghost = []  # (hash, class, release tick) in eviction order
        self.tick = -1   # 0-based release ticks, as the policy counts them

    def cached(self, b):
        pool = self.pool
        ph = pool.parent_hash[b]
        if ph is None:
            root = pool.block_hash[b]
        else:
            parent = pool.lookup(ph)
            root = self.root.get(parent, ph) if parent is not None else ph
        self.root[b] = root
        self.cls[b] = (root, pool.depth[b].bit_length()) if self.by_depth else root
        self.est.setdefault(self.cls[b], self.mean)
        for g in self.ghost:
            if g[0] == pool.block_hash[b]:
                self.ghost.remove(g)
                self.learn(g[1], 1.0)
                break

    def learn(self, c, outcome):
        e = self.est.get(c, self.mean)
        self.est[c] = e + self.rate * (outcome - e)
        self.mean += self.rate * (outcome - self.mean)

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        if was_evictable:
            self.learn(self.cls[b], 1.0)

    def rank(self, b):
        p = min(max(self.est[self.cls[b]], 1e-6), 1.0 - 1e-6)
        return (self.rel[b] + self.tau * log(p / (1.0 - p)), self.rel[b])

    def choose(self):
        victim = min(self.rel, key=self.rank)
        self.ghost.append((self.pool.block_hash[victim], self.cls[victim], self.rel[victim]))
        while self.ghost and (self.ghost[0][2] < self.tick - self.window or len(self.ghost) > 4 * self.pool.num_blocks):
            self.learn(self.ghost.pop(0)[1], 0.0)
        return victim

    def forget(self, b):
        del self.root[b], self.cls[b]

    def clear(self):
        super().clear()
        self.root.clear()
        self.cls.clear()
        self.ghost.clear()


class RefLRFU(Ref):
    """Log-scores ``log2 sum 2**clock_i`` on the warped clock (the policy's float steps), the median
    reuse distance and the lengths derived from it, ghosts, the access memory and the leaf experiments
    as plain lists; a leaf is a released block with no cached block under its hash (a scan)."""

    def __init__(self, pool, half_life=2.0, ghost=0.5, step=0.002, memory=8.0, reuse_distance=None,
                 window=1.0, rate=0.01, leaf_penalty=True):
        super().__init__(pool)
        self.half_life, self.ghost, self.step, self.memory_f, self.window_f = half_life, ghost, step, memory, window
        self.rate, self.leaf_penalty = rate, leaf_penalty
        self.median = float(reuse_distance or pool.num_blocks)
        self.rescale()
        self.clock = 0.0
        self.p = {True: 0.5, False: 0.5}   # reuse estimates of leaves / inner blocks
        self.score, self.key, self.cached_blocks = {}, {}, set()
        self.ghosts = []     # [hash, score] in eviction order
        self.accesses = []   # [tick, hash] of the remembered accesses, in order
        self.last = {}       # hash -> tick of its last remembered access
        self.history = []    # [hash, is leaf, release tick]: the open leaf experiments, in release order

    def rescale(self):
        self.scaled_at = self.median
        self.H = self.half_life * self.median
        self.ghost_limit = int(self.ghost * self.H)
        self.window = max(1, int(self.window_f * self.H))
        self.memory = min(int(self.memory_f * self.median) + 1, 64 * self.pool.num_blocks)

    @staticmethod
    def add(score, now):
        if score is None:
            return now
        d = score - now
        return score + log2(1.0 + 2.0 ** -d) if d > 0.0 else now + log2(1.0 + 2.0 ** d)

    def learn(self, leaf, outcome):
        self.p[leaf] += self.rate * (outcome - self.p[leaf])

    def accessed(self, h):
        if self.step and h in self.last:
            longer = self.tick - self.last[h] + 0.5 > self.median
            self.median = self.median * (math.exp(self.step) if longer else math.exp(-self.step))
            if not self.scaled_at * 0.99 < self.median < self.scaled_at * 1.01:
                self.rescale()
        self.last[h] = self.tick
        self.accesses.append([self.tick, h])
        while self.accesses[0][0] < self.tick - self.memory:
            tick, old = self.accesses.pop(0)
            if self.last.get(old) == tick:
                del self.last[old]
        for entry in self.history:
            if entry[0] == h:
                self.history.remove(entry)
                self.learn(entry[1], 1.0)
                break

    def cached(self, b):
        h = self.pool.block_hash[b]
        old = None
        for entry in self.ghosts:
            if entry[0] == h:
                self.ghosts.remove(entry)
                old = entry[1]
                break
        self.score[b] = self.add(old, self.clock)
        self.cached_blocks.add(b)
        self.accessed(h)

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        self.score[b] = self.add(self.score[b], self.clock)
        self.accessed(self.pool.block_hash[b])

    def released(self, b):
        super().released(b)
        self.clock += 1.0 / self.H
        h = self.pool.block_hash[b]
        leaf = not any(self.pool.parent_hash[c] == h for c in self.cached_blocks)
        key = self.score[b]
        if leaf and self.leaf_penalty:
            ratio = max(self.p[True], 1e-3) / max(self.p[False], 1e-3)
            key -= -log2(ratio) if ratio < 1.0 else 0.0
        self.key[b] = key
        self.history = [e for e in self.history if e[0] != h] + [[h, leaf, self.tick]]
        while self.history and self.history[0][2] <= self.tick - self.window:
            self.learn(self.history.pop(0)[1], 0.0)

    def choose(self):
        return min(self.rel, key=lambda b: (self.key[b], self.rel[b]))

    def forget(self, b):
        score = self.score.pop(b)
        del self.key[b]
        self.cached_blocks.discard(b)
        self.ghosts.append([self.pool.block_hash[b], score])
        while len(self.ghosts) > self.ghost_limit:
            self.ghosts.pop(0)

    def clear(self):
        super().clear()
        self.score, self.key, self.cached_blocks = {}, {}, set()


class RefBelady(Ref):
    def __init__(self, pool):
        super().__init__(pool)
        self.next = {}

    def choose(self):
        return min(self.rel, key=lambda b: (-self.next.get(self.pool.block_hash[b], inf), self.rel[b]))


class RefPriorityLRU(Ref):
    """PriorityPolicy over LRU. ``rel`` holds every candidate; ``inner`` the ones LRU may take, in
    order; ``aside`` the protected ones with (pinned, priority, order, until)."""

    def __init__(self, pool, min_priority):
        super().__init__(pool)
        self.min_priority = min_priority
        self.now = 0
        self.pins = {}
        self.inner = []
        self.aside = {}

    def protection(self, b):
        h = self.pool.block_hash[b]
        until = self.pins.get(h)
        if until is not None and until <= self.now:
            del self.pins[h]
            until = None
        prio = self.pool.priority[b]
        if until is None and (self.min_priority is None or prio < self.min_priority):
            return None
        self.tick += 1
        return (until is not None, prio, self.tick, until)

    def place(self, b):
        p = self.protection(b)
        if p is None:
            self.inner.append(b)
        else:
            self.aside[b] = p

    def cached(self, b):
        self.now += 1

    def released(self, b):
        self.now += 1
        self.rel[b] = None
        self.place(b)

    def hit(self, b, was_evictable):
        self.now += 1
        if was_evictable:
            del self.rel[b]
            if b in self.aside:
                del self.aside[b]
            else:
                self.inner.remove(b)

    def pin(self, h, until):
        self.pins[h] = until
        self.reconsider(h)

    def unpin(self, h):
        if self.pins.pop(h, None) is not None:
            self.reconsider(h)

    def reconsider(self, h):
        b = self.pool.lookup(h)
        if b is None or b not in self.rel:
            return
        if b in self.aside:
            del self.aside[b]
            self.place(b)
        elif self.protection(b) is not None:
            self.inner.remove(b)
            self.place(b)

    def choose(self):
        self.now += 1
        expired = sorted((p[3], p[2], b) for b, p in self.aside.items() if p[0] and p[3] <= self.now)
        for _, _, b in expired:
            del self.aside[b]
            self.place(b)
        if self.inner:
            return self.inner.pop(0)
        victim = min(self.aside, key=lambda b: self.aside[b][:3])
        del self.aside[victim]
        return victim

    def clear(self):
        super().clear()
        self.inner.clear()
        self.aside.clear()


class RefSession(Ref):
    """The session policy restated block by block. Forecasts: per class (end reason, else turn bucket)
    means (running, then EWMA) of log(1 + gap) and of return outcomes (1: the session came back; 0: not within timeout x gap);
    per session and class an EWMA of its own log gaps. A hinted block waits until due = t + g / p (p ** w for turn
    classes); the latest due goes first, then the latest hinted release, then the earliest released block. Overdue, unhinted
    and shared blocks are aged: oldest release time first. The oldest aged block goes if now + kappa * its
    age >= the latest due."""

    def __init__(self, pool, rate=0.05, timeout=8.0, kappa=1.0, weight=0.5):
        super().__init__(pool)
        self.rate, self.timeout, self.kappa, self.weight = rate, timeout, kappa, weight
        self.now = 0.0
        self.hint = None
        self.hints = 0
        self.info = {}      # candidate -> (due or None, hint number, release time)
        self.owner = {}
        self.sessions = {}  # session -> dict(last, klass, n, mu, deadline)
        self.mu, self.p, self.mu_all = {}, {}, log(61.0)

    def klass(self, hint):
        if hint.end is not None:
            return hint.end
        t = hint.turn
        return ("turn", None if t is None else (t if t < 4 else (4 if t < 8 else 8)))

    def mean(self, table, k, x, prior):
        value, n = table.get(k, (prior, 0))
        table[k] = (value + max(self.rate, 1.0 / (n + 2)) * (x - value), n + 1)

    def learn_p(self, k, outcome):
        self.mean(self.p, k, outcome, 0.5)

    def on_hint(self, hint):
        if hint.time > self.now:
            self.now = hint.time
            expired = sorted((s["deadline"], s["opened"], name) for name, s in self.sessions.items()
                             if s["deadline"] is not None and s["deadline"] <= self.now)
            for _, _, name in expired:
                self.sessions[name]["deadline"] = None
                self.learn_p(self.sessions[name]["klass"], 0.0)
        s = self.sessions.setdefault(hint.session, dict(last=None, klass=None, mu={}, deadline=None))
        if s["last"] is not None:
            lg = log(1.0 + self.now - s["last"])
            self.mean(self.mu, s["klass"], lg, self.mu_all)
            self.mu_all += self.rate * (lg - self.mu_all)
            own, n = s["mu"].get(s["klass"], (lg, 0))      # the session's own gaps after this class
            s["mu"][s["klass"]] = (own + 0.5 * (lg - own), n + 1)
            if s["deadline"] is not None:
                s["deadline"] = None
                self.learn_p(s["klass"], 1.0)
        k = self.klass(hint)
        m = self.mu.get(k, (self.mu_all,))[0]
        if k in s["mu"]:
            own, n = s["mu"][k]
            w = n / (n + 1.0)
            m = w * own + (1 - w) * m
        p, g = max(self.p.get(k, (0.5,))[0], 0.02), math.exp(m) - 1.0
        s.update(last=self.now, klass=k)
        self.hints += 1
        s["deadline"], s["opened"] = self.now + self.timeout * max(g, 1.0), self.hints
        self.hint = hint
        self.due = self.now + g / (p if hint.end is not None else p ** self.weight)

    def released(self, b):
        super().released(b)
        hint = self.pool.hint
        if hint is not None and hint is self.hint and self.owner.get(b, hint.session) == hint.session:
            self.owner[b] = hint.session
            self.info[b] = (self.due if self.due > self.now else None, self.hints, self.now)
            return
        if hint is not None and hint is self.hint:
            self.owner[b] = "shared"
        self.info[b] = (None, 0, self.now)

    def hit(self, b, was_evictable):
        super().hit(b, was_evictable)
        if was_evictable:
            del self.info[b]

    def forget(self, b):
        del self.info[b]
        self.owner.pop(b, None)

    def choose(self):
        waiting = [b for b in self.rel if self.info[b][0] is not None and self.info[b][0] > self.now]
        aged = [b for b in self.rel if b not in waiting]
        if aged:
            oldest = min(aged, key=lambda b: (self.info[b][2], self.rel[b]))
        if waiting:
            latest = max(waiting, key=lambda b: (self.info[b][0], self.info[b][1], -self.rel[b]))
        if aged and (not waiting or self.now + self.kappa * (self.now - self.info[oldest][2])
                     >= self.info[latest][0]):
            return oldest
        return latest

    def clear(self):
        super().clear()
        self.info.clear()
        self.owner.clear()


# -- the driver ----------------------------------------------------------------------------------------------
KINDS = ["cache"] * 4 + ["release"] * 4 + ["hit"] * 3 + ["evict"] * 3 + ["clear", "next", "pin", "unpin", "hint",
                                                                        "unhint"]
ENDS = ("tool_use", "end_turn", None, "tool_use")
steps = st.tuples(st.sampled_from(KINDS), st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_HASHES - 1),
                  st.integers(0, 3))
scripts = st.lists(steps, min_size=60, max_size=200)


def drive(policy, script, ref=None, pool=None, pick=False):
    """Replay ``script`` (tuples kind, block, hash, n) as legal pool events; illegal steps are skipped.

    With ``pick`` (random scripts), ``block`` and ``hash`` index into the blocks
    and hashes for which the step is legal, so nearly every step happens.
    Checks after each step: candidate bookkeeping (len / in) and that a victim
    is a candidate, equal to the reference's when one is given. Returns victims.
    """
    pool = pool or FakePool()
    policy.bind(pool)
    if ref is not None:
        ref.pool = pool
    state = {}   # block -> "active" | "evictable"
    victims = []
    clock = 0.0
    for kind, block, h, n in script:
        if pick:
            if kind == "cache":
                free = [b for b in range(pool.num_blocks) if b not in state]
                hashes = [x for x in range(NUM_HASHES) if x not in pool._cached]
                if not free or not hashes:
                    continue
                block, h = free[block % len(free)], hashes[h % len(hashes)]
            elif kind in ("release", "hit"):
                eligible = sorted(b for b, s in state.items() if kind == "hit" or s == "active")
                if not eligible:
                    continue
                block = eligible[block % len(eligible)]
        if kind == "cache":
            if block in state or h in pool._cached:
                continue
            pool.cache(block, h)
            state[block] = "active"
            policy.on_cached(block)
            ref and ref.cached(block)
        elif kind == "release":
            if state.get(block) != "active":
                continue
            pool.priority[block] = n
            state[block] = "evictable"
            policy.on_released(block)
            ref and ref.released(block)
        elif kind == "hit":
            if block not in state:
                continue
            was = state[block] == "evictable"
            state[block] = "active"
            policy.on_hit(block, was)
            ref and ref.hit(block, was)
        elif kind == "evict":
            if not len(policy):
                continue
            expected = ref.evict() if ref else None
            victim = policy.evict()
            assert state.get(victim) == "evictable", f"evicted {victim}, which is {state.get(victim)}"
            if ref:
                assert victim == expected
            pool.drop(victim)
            del state[victim]
            victims.append(victim)
        elif kind == "clear":
            if "active" in state.values():
                continue
            policy.clear()
            ref and ref.clear()
            for b in state:
                pool.drop(b)
            state.clear()
        elif kind == "next" and isinstance(policy, BeladyPolicy):
            t = inf if n == 0 else float(n)
            policy.set_next_use(h, t)
            if ref:
                if t == inf:
                    ref.next.pop(h, None)
                else:
                    ref.next[h] = t
        elif kind == "hint":
            # A hinted release begins: session h % 3, an end reason, the clock moves by 0..3 s. Releases
            # until "unhint" belong to it, as the pool's release() does with pool.hint.
            clock += n
            pool.hint = SessionHint(h % 3, end=ENDS[(h + n) % 4], time=clock, turn=n)
            pool.release_size = n + 1
            on_hint = getattr(policy, "on_hint", None)
            if on_hint is not None:
                on_hint(pool.hint)
            ref and hasattr(ref, "on_hint") and ref.on_hint(pool.hint)
        elif kind == "unhint":
            pool.hint = None
        elif kind in ("pin", "unpin") and isinstance(policy, PriorityPolicy):
            if kind == "pin":
                until = None if n == 0 else policy.now() + 2 * n
                policy.pin(h, until=until)
                ref and ref.pin(h, inf if until is None else until)
            else:
                policy.unpin(h)
                ref and ref.unpin(h)
        assert len(policy) == sum(v == "evictable" for v in state.values())
        for b in range(pool.num_blocks):
            assert (b in policy) == (state.get(b) == "evictable")
    return victims


def factories():
    """name -> (policy factory, reference factory) for the hypothesis tests."""
    return {
        "lru": (LRUPolicy, RefLRU),
        "lfu": (lambda: LFUPolicy(half_life=3), lambda p: RefLFU(p, 3)),
        "lfu-default": (LFUPolicy, lambda p: RefLFU(p, max(16, NUM_BLOCKS))),
        "slru": (lambda: SLRUPolicy(protected_size=2), lambda p: RefSLRU(p, 2)),
        "slru-default": (SLRUPolicy, lambda p: RefSLRU(p, int(0.5 * NUM_BLOCKS))),
        "s3fifo": (S3FIFOPolicy, lambda p: RefS3FIFO(p, 1, NUM_BLOCKS - 1)),
        "s3fifo-wide": (lambda: S3FIFOPolicy(small_fraction=0.4, move_threshold=2),
                        lambda p: RefS3FIFO(p, 3, NUM_BLOCKS - 3, threshold=2)),
        "arc": (ARCPolicy, lambda p: RefARC(p, NUM_BLOCKS)),
        "leaf-lru": (LeafLRUPolicy, RefLeafLRU),
        "gdsf": (GDSFPolicy, RefGDSF),
        "gdsf-soft-orphans": (lambda: GDSFPolicy(depth_cost=0.5, orphan_factor=0.25),
                              lambda p: RefGDSF(p, 0.5, 0.25)),
        "gdsf-no-inherit": (lambda: GDSFPolicy(depth_cost=0.5, inherit=False),
                            lambda p: RefGDSF(p, 0.5, inherit=False)),
        "workload": (WorkloadPolicy, RefWorkload),
        "workload-by-depth": (lambda: WorkloadPolicy(rate=0.3, horizon=0.5, window=0.5, by_depth=True),
                              lambda p: RefWorkload(p, rate=0.3, horizon=0.5, window=0.5, by_depth=True)),
        "lrfu": (LRFUPolicy, RefLRFU),
        "lrfu-fast": (lambda: LRFUPolicy(half_life=0.5, ghost=1.0, step=0.1, memory=2.0, window=0.5, rate=0.3),
                      lambda p: RefLRFU(p, half_life=0.5, ghost=1.0, step=0.1, memory=2.0, window=0.5, rate=0.3)),
        "lrfu-fixed-scale": (lambda: LRFUPolicy(step=0, reuse_distance=3, leaf_penalty=False),
                             lambda p: RefLRFU(p, step=0, reuse_distance=3, leaf_penalty=False)),
        "lrfu-no-ghosts": (lambda: LRFUPolicy(ghost=0, step=0.05, window=0.25, rate=0.5),
                           lambda p: RefLRFU(p, ghost=0, step=0.05, window=0.25, rate=0.5)),
        "session": (SessionPolicy, RefSession),
        "session-eager": (lambda: SessionPolicy(rate=0.5, timeout=1.0, kappa=3.0, fallback_weight=1.0),
                          lambda p: RefSession(p, rate=0.5, timeout=1.0, kappa=3.0, weight=1.0)),
        "belady": (BeladyPolicy, RefBelady),
        "priority+lru": (lambda: PriorityPolicy(LRUPolicy()), lambda p: RefPriorityLRU(p, None)),
        "priority+lru-min2": (lambda: PriorityPolicy(LRUPolicy(), min_priority=2),
                              lambda p: RefPriorityLRU(p, 2)),
    }


@pytest.mark.parametrize("variant", list(factories()))
@settings(max_examples=80, deadline=None)
@given(script=scripts)
def test_policy_matches_its_reference(variant, script):
    make, make_ref = factories()[variant]
    pool = FakePool()
    drive(make(), script, make_ref(pool), pool, pick=True)


@pytest.mark.parametrize("inner", NAMES)
@settings(max_examples=40, deadline=None)
@given(script=scripts)
def test_priority_wrapper_keeps_any_inner_policy_consistent(inner, script):
    """Bookkeeping only (no reference): pinned / high-priority candidates are evicted only when
    nothing else waits, and the inner policy agrees on every block."""
    policy = PriorityPolicy(make_policy(inner), min_priority=3)
    original = policy.evict

    def checked_evict():
        unprotected = len(policy.inner)
        victim = original()
        if unprotected:
            assert victim not in policy._aside_key
        return victim

    policy.evict = checked_evict
    drive(policy, script, pick=True)


# -- each policy differs from LRU where it should ------------------------------------------------------------
def test_lfu_keeps_the_frequent_block_and_ages_it_out():
    # Block 0 was hit twice, block 1 never: LRU evicts 0 (released first), LFU evicts 1.
    script = [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
              ("cache", 1, 1, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    assert drive(LFUPolicy(half_life=100), script) == [1]
    # Aging: 5 early accesses to block 0, then 2 accesses to block 1 after 4 half-lives (x16): 2*16 > 5.
    policy = LFUPolicy(half_life=2)
    early = [("cache", 0, 0, 0)] + [("hit", 0, 0, 0)] * 4 + [("release", 0, 0, 0)]
    late = [("cache", 1, 1, 0), ("cache", 2, 2, 0)] + [("hit", 2, 2, 0)] * 6 + [("hit", 1, 1, 0),
                                                                                ("release", 1, 1, 0)]
    assert drive(policy, early + late + [("evict", 0, 0, 0)]) == [0]
    assert drive(LFUPolicy(half_life=10_000), early + late + [("evict", 0, 0, 0)]) == [1]  # no aging


def test_slru_protects_blocks_that_were_hit():
    script = [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
              ("cache", 1, 1, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    assert drive(SLRUPolicy(), script) == [1]
    # With no room in the protected segment the hit block is demoted to probation and goes first.
    assert drive(SLRUPolicy(protected_size=0), script) == [0]


def test_s3fifo_evicts_in_insertion_order_and_promotes_ghosts():
    # Cached 0 then 1, released 1 then 0: LRU takes 1 (released first), S3-FIFO takes 0 (entered first).
    script = [("cache", 0, 0, 0), ("cache", 1, 1, 0), ("release", 1, 1, 0), ("release", 0, 0, 0),
              ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [1]
    assert drive(S3FIFOPolicy(), script) == [0]
    # A hash evicted from S that comes back is admitted to M; later one-hit blocks go before it.
    script += [("cache", 2, 0, 0), ("release", 2, 0, 0),          # hash 0 again: a ghost hit
               ("cache", 3, 3, 0), ("release", 3, 3, 0), ("evict", 0, 0, 0), ("evict", 0, 0, 0)]
    policy = S3FIFOPolicy()
    assert drive(policy, script) == [0, 1, 3]   # 2 (in M) outlives the older 1 and 3 (in S)
    assert list(policy._cands[1].values()) == [2]


def test_arc_prefers_blocks_seen_twice_and_adapts():
    script = [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
              ("cache", 1, 1, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    policy = ARCPolicy()
    assert drive(policy, script) == [1]
    # Hash 1 returns from ghost list B1: T1 was too small, so its target p grows.
    assert policy.p == 0.0
    policy.pool.cache(2, 1)
    policy.on_cached(2)
    assert policy.p == 1.0 and policy._list[2] == 2


def test_leaf_lru_never_evicts_a_parent_before_its_children():
    # Chain 0 -> 2 -> 6; released head first, so LRU evicts the head and orphans the rest.
    script = [("cache", 0, 0, 0), ("cache", 1, 2, 0), ("cache", 2, 6, 0),
              ("release", 0, 0, 0), ("release", 1, 2, 0), ("release", 2, 6, 0)] + [("evict", 0, 0, 0)] * 3
    assert drive(LRUPolicy(), script) == [0, 1, 2]
    assert drive(LeafLRUPolicy(), script) == [2, 1, 0]
    # A parent whose only cached child is in use is evicted only when nothing else waits.
    script = [("cache", 0, 0, 0), ("cache", 1, 2, 0), ("cache", 2, 1, 0),
              ("release", 0, 0, 0), ("release", 2, 1, 0), ("evict", 0, 0, 0), ("evict", 0, 0, 0)]
    assert drive(LeafLRUPolicy(), script) == [2, 0]
    assert drive(LRUPolicy(), script) == [0, 2]


def test_gdsf_weighs_frequency_depth_and_orphans():
    # Frequency: block 0 hit twice outweighs recency.
    script = [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
              ("cache", 1, 1, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    assert drive(GDSFPolicy(), script) == [1]
    # Depth: a deeper block (chain 0 -> 2 -> 6, depth 2) costs more to recompute than a root.
    script = [("cache", 0, 0, 0), ("cache", 1, 2, 0), ("cache", 2, 6, 0), ("release", 2, 6, 0),
              ("cache", 3, 1, 0), ("release", 3, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [2]
    assert drive(GDSFPolicy(), script) == [3]
    # A parent is worth its best child: the chain 0 -> 2 (child hit twice) goes tail first, after 1.
    script = [("cache", 0, 0, 0), ("cache", 1, 2, 0), ("hit", 1, 2, 0), ("hit", 1, 2, 0),
              ("release", 1, 2, 0), ("release", 0, 0, 0), ("cache", 3, 1, 0), ("hit", 3, 1, 0),
              ("release", 3, 1, 0)] + [("evict", 0, 0, 0)] * 3
    assert drive(GDSFPolicy(), script) == [3, 1, 0]
    assert drive(LRUPolicy(), script) == [1, 0, 3]
    # Without that, root 0 (freq 1) goes first; its child, frequent but now an orphan, goes next.
    assert drive(GDSFPolicy(inherit=False), script) == [0, 1, 3]


def test_workload_learns_which_roots_are_reused():
    pool = FakePool()
    policy = WorkloadPolicy(rate=0.3, window=0.25)    # a block counts as reused within 2 releases

    def cache(block, h, parent=None, depth=0):
        pool.cache(block, h, parent, depth)
        policy.on_cached(block)

    def evict():
        victim = policy.evict()
        pool.drop(victim)
        return victim

    policy.bind(pool)
    cache(0, "a")                                     # root a: released and hit again, 4 times
    for _ in range(4):
        policy.on_released(0)
        policy.on_hit(0, True)
    cache(1, "b")                                     # root b: children used once, never again
    for k in range(6):
        cache(2, ("b", k), "b", 1)
        policy.on_released(2)
        assert evict() == 2
    assert policy.estimates["a"] > 0.8 > 0.5 > policy.estimates["b"]
    policy.on_released(0)                             # a's block waits longer than b's ...
    cache(2, ("b", 99), "b", 1)
    policy.on_released(2)
    assert policy.predicted_reuse(0) > policy.predicted_reuse(2)
    assert evict() == 2                               # ... yet b's goes first; LRU would take a's
    # A hash that comes back while its ghost is remembered counts as reused.
    before = policy.estimates["b"]
    cache(2, ("b", 99), "b", 1)
    assert policy.estimates["b"] > before


def test_lrfu_weighs_frequency_remembers_ghosts_and_ages():
    # Block 0 was hit, block 1 never: LRU evicts 0 (released first), LRFU evicts 1.
    script = [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
              ("cache", 1, 1, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    assert drive(LRFUPolicy(), script) == [1]
    # Aging: with a half-life of one release (1/8 of the initial median, the capacity), two old
    # accesses weigh less than one recent access.
    aged = script[:4] + [("cache", 2, 2, 0), ("release", 2, 2, 0)] * 1 + [("cache", 3, 3, 0), ("release", 3, 3, 0),
                                                                            ("cache", 1, 1, 0), ("release", 1, 1, 0)]
    assert drive(LRFUPolicy(half_life=1 / NUM_BLOCKS, leaf_penalty=False), aged + [("evict", 0, 0, 0)]) == [0]
    assert drive(LRFUPolicy(half_life=100, leaf_penalty=False), aged + [("evict", 0, 0, 0)]) == [2]
    # Ghost memory: an evicted hash cached again resumes warm (CRF > 1), unless ghosts are off.
    for ghost, warm in ((1.0, True), (0.0, False)):
        policy = LRFUPolicy(half_life=100, ghost=ghost)
        pool = FakePool()
        drive(policy, [("cache", 0, 0, 0), ("release", 0, 0, 0), ("hit", 0, 0, 0), ("release", 0, 0, 0),
                       ("evict", 0, 0, 0), ("cache", 5, 0, 0)], pool=pool)
        assert (policy.crf(5) > 1.5) == warm


def test_lrfu_time_scale_follows_the_workload_not_the_cache_size():
    """A loop over 40 hashes (reuse distance 40 releases): the median converges near 40 and the
    half-life to half_life * 40, for an 8-block and a 64-block pool alike."""
    for capacity in (8, 64):
        policy = LRFUPolicy(step=0.02)
        pool = FakePool(capacity)
        policy.bind(pool)
        where = {}                                    # hash -> block
        free = list(range(capacity))
        for i in range(4000):
            h = i % 40
            if h in where:
                policy.on_hit(where[h], True)
            else:
                if not free:
                    victim = policy.evict()
                    del where[pool.block_hash[victim]]
                    pool.drop(victim)
                    free.append(victim)
                block = free.pop()
                pool.cache(block, h, parent=None, depth=0)
                where[h] = block
                policy.on_cached(block)
            policy.on_released(where[h])
        assert 36 < policy.median_reuse_distance < 44
        assert policy.half_life_releases == pytest.approx(2.0 * policy.median_reuse_distance, rel=0.011)

def test_lrfu_learns_that_request_tails_are_dead_and_demotes_only_leaves():
    def run(policy):
        pool = FakePool()
        policy.bind(pool)

        def cache(block, h, parent=None, depth=0):
            pool.cache(block, h, parent, depth)
            policy.on_cached(block)

        def evict():
            victim = policy.evict()
            pool.drop(victim)
            return victim

        cache(0, "r")                                 # a shared root, hit by every request ...
        for k in range(8):
            cache(1, ("t", k), "r", 1)                # ... each of which ends in its own tail
            policy.on_released(1)
            policy.on_released(0)
            policy.on_hit(0, True)
            assert evict() == 1
        policy.on_released(0)
        assert evict() == 0
        cache(2, "s")                                 # inner block s (its child u is cached) ...
        cache(3, "u", "s", 1)
        policy.on_released(3)
        policy.on_released(2)
        cache(4, "v")                                 # ... released before the leaf v
        policy.on_released(4)
        return [evict() for _ in range(3)]

    tiny_window = 4 / (100 * NUM_BLOCKS)        # experiments stay open for 4 releases (H = 100 * 8)
    policy = LRFUPolicy(half_life=100, step=0, window=tiny_window, rate=0.5)
    victims = run(policy)
    assert sorted(victims[:2]) == [3, 4] and victims[2] == 2  # leaves u and v go before the older inner s
    assert policy.p_leaf < 0.1 < 0.9 < policy.p_inner and policy.penalty() > 3
    assert run(LRUPolicy()) == [3, 2, 4]
    assert run(LRFUPolicy(half_life=100, step=0, window=tiny_window, rate=0.5, leaf_penalty=False)) == [3, 2, 4]
    # Tails reused more often than inner blocks earn no bonus: a leaf is never ranked above its parent.
    policy = LRFUPolicy()
    policy.p_leaf, policy.p_inner = 0.9, 0.2
    assert policy.penalty() == 0.0
    policy.p_leaf, policy.p_inner = 0.1, 0.4
    assert policy.penalty() == 2.0


def test_lrfu_never_orphans_a_cached_block_in_a_cache_only_replay():
    """Through the real manager (admit then free at once): a victim never has a cached block under it."""
    rng = random.Random(3)
    stems = [[rng.randrange(8) for _ in range(rng.randrange(4, 20))] for _ in range(10)]
    policy = LRFUPolicy(step=0.05, window=0.5, rate=0.2)
    mgr = KVCacheManager(12, BLOCK, policy=policy, hash_seed=0)
    pool = mgr.pool
    original = policy.evict

    def checked_evict():
        victim = original()
        h = pool.block_hash[victim]
        assert not any(pool.block_hash[b] is not None and pool.parent_hash[b] == h and b != victim
                       for b in range(pool.num_blocks))
        return victim

    policy.evict = checked_evict
    for i in range(400):
        tokens = rng.choice(stems)[:rng.randrange(4, 20)] + [rng.randrange(40, 60) for _ in range(rng.randrange(4))]
        mgr.admit(i, tokens[:12 * BLOCK - 1], compute_last_token=False)
        mgr.free(i)
    assert pool.evictions > 200 and mgr.stats().hit_tokens > 0

def test_belady_evicts_the_furthest_next_use():
    script = [("cache", 0, 0, 0), ("cache", 1, 1, 0), ("next", 0, 0, 9), ("next", 0, 1, 2),
              ("release", 0, 0, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]
    assert drive(LRUPolicy(), script) == [0]
    assert drive(BeladyPolicy(), script) == [0]
    # The oracle changes its mind while both wait: block 1 is needed later now.
    assert drive(BeladyPolicy(), script[:-1] + [("next", 0, 1, 3), ("next", 0, 0, 1), ("evict", 0, 0, 0)]) == [1]
    # Unknown next use counts as never.
    assert drive(BeladyPolicy(), [("cache", 0, 0, 0), ("cache", 1, 1, 0), ("next", 0, 0, 5),
                                  ("release", 0, 0, 0), ("release", 1, 1, 0), ("evict", 0, 0, 0)]) == [1]


def test_belady_next_uses():
    assert BeladyPolicy.next_uses([["a", "b"], ["b"], ["a", "c"]]) == [[2.0, 1.0], [inf], [inf, inf]]


def test_priority_wrapper_pins_prioritises_and_expires():
    base = [("cache", 0, 0, 0), ("cache", 1, 1, 0), ("release", 0, 0, 0), ("release", 1, 1, 0)]
    assert drive(LRUPolicy(), base + [("evict", 0, 0, 0)]) == [0]
    assert drive(PriorityPolicy(LRUPolicy()), [("pin", 0, 0, 0)] + base + [("evict", 0, 0, 0)] * 2) == [1, 0]
    # Pinning a block that already waits takes it out of the inner order.
    assert drive(PriorityPolicy(LRUPolicy()), base + [("pin", 0, 0, 0), ("evict", 0, 0, 0)]) == [1]
    # A TTL pin (the default clock counts events): kept aside while it lasts, back in the inner
    # order (as if released at expiry) once it has passed.
    policy = PriorityPolicy(LRUPolicy())
    drive(policy, [("pin", 0, 0, 4)] + base + [("cache", 2, 2, 0), ("release", 2, 2, 0)])  # until 8
    assert policy.is_pinned(0) and policy.evict() == 1          # event 6
    policy.on_hit(2, True)
    policy.on_released(2)                                       # event 8: the pin is over
    assert not policy.is_pinned(0)
    assert [policy.evict(), policy.evict()] == [2, 0]
    # Release priority: blocks released by important sequences (priority >= 2) wait aside.
    script = [("cache", 0, 0, 0), ("cache", 1, 1, 0), ("release", 0, 0, 2), ("release", 1, 1, 0),
              ("evict", 0, 0, 0)]
    assert drive(PriorityPolicy(LRUPolicy(), min_priority=2), script) == [1]
    assert drive(PriorityPolicy(LRUPolicy(), min_priority=3), script) == [0]


def test_priority_wrapper_with_a_wall_clock():
    now = [0.0]
    policy = PriorityPolicy(LRUPolicy(), clock=lambda: now[0])
    pool = FakePool()
    drive(policy, [("cache", 0, 0, 0), ("cache", 1, 1, 0)], pool=pool)
    policy.pin(0, ttl=10.0)
    with pytest.raises(ValueError):
        policy.pin(0, until=1.0, ttl=1.0)
    policy.on_released(0)
    policy.on_released(1)
    assert policy.evict() == 1
    policy.on_hit(0, True)
    policy.on_released(0)
    now[0] = 10.0
    assert not policy.is_pinned(0)
    assert len(policy) == 1 and policy.evict() == 0


# -- the registry ----------------------------------------------------------------------------------------------
def test_registry_has_every_policy_and_options():
    assert set(NAMES) <= set(available_policies())
    for name in NAMES:
        policy = make_policy(name)
        assert isinstance(policy, EvictionPolicy) and policy.name == name
        assert len(policy) == 0 and 0 not in policy and policy.snapshot() == make_policy(name).snapshot()
    assert make_policy("lfu", half_life=5).half_life == 5
    assert isinstance(PriorityPolicy(make_policy("arc")), EvictionPolicy)
    with pytest.raises(TypeError):
        make_policy("arc", nope=1)


class _FakeEntryPoint:
    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"thirdparty:{name}", target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_entry_points_add_policies_without_overriding_builtins(monkeypatch):
    class Mine(LRUPolicy):
        name = "mine"

    points = [_FakeEntryPoint("mine", Mine), _FakeEntryPoint("lru", Mine),
              _FakeEntryPoint("broken", ImportError("no module named thirdparty"))]
    monkeypatch.setattr(policies_module.registry, "entry_points",
                        lambda group: points if group == policies_module.ENTRY_POINT_GROUP else [])
    registry = PolicyRegistry({"lru": LRUPolicy})
    with pytest.warns(RuntimeWarning, match="broken"):
        assert registry.names() == ["lru", "mine"]
    assert isinstance(registry.make("mine"), Mine)
    assert type(registry.make("lru")) is LRUPolicy
    with pytest.raises(ValueError, match="unknown eviction policy 'broken'"):
        registry.make("broken")


# -- through the real manager ------------------------------------------------------------------------------------
BLOCK = 4
CAPACITY = 16


def plan_workload(seed, steps=160):
    """A fixed op list: shared system prompts, multi-turn continuations, exact repeats, decodes."""
    rng = random.Random(seed)
    systems = [[], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 13, 14, 15, 16]]
    history: list[list[int]] = []
    ops, live, next_id = [], [], 0
    for _ in range(steps):
        r = rng.random()
        if live and (len(live) >= 4 or r < 0.35):
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        elif live and r < 0.45:
            ops.append(("append", rng.choice(live), rng.randrange(1, 4)))
        elif not live and r < 0.5:
            ops.append(("reset",))
        else:
            if history and rng.random() < 0.5:
                prompt = list(rng.choice(history))
                if rng.random() < 0.6:
                    prompt += [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
            else:
                prompt = rng.choice(systems) + [rng.randrange(20, 40) for _ in range(rng.randrange(1, 8))]
            prompt = prompt[:CAPACITY // 4 * BLOCK - 1]
            history.append(prompt)
            ops.append(("admit", next_id, prompt, rng.randrange(3)))
            live.append(next_id)
            next_id += 1
    return ops


def plan_duplicate_workload(seed, steps=200):
    """Block-aligned repeats of a few prompts and identical decodes: many duplicate blocks, and
    primaries evicted while a duplicate is in use (the duplicate takes over the hash)."""
    rng = random.Random(seed)
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 17, 18, 19, 20]]
    ops, live, next_id = [], [], 0
    for _ in range(steps):
        r = rng.random()
        if live and (len(live) >= 5 or r < 0.3):
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        elif live and r < 0.55:
            ops.append(("append", rng.choice(live), rng.randrange(1, 5)))
        else:
            prompt = list(rng.choice(prompts))
            if rng.random() < 0.3:
                prompt += [rng.randrange(30, 40) for _ in range(rng.randrange(1, 6))]
            ops.append(("admit", next_id, prompt, rng.randrange(3)))
            live.append(next_id)
            next_id += 1
    return ops


def run_workload(policy, ops):
    """Run ``ops`` on a real manager, checking invariants after each step; returns it."""
    mgr = KVCacheManager(CAPACITY, BLOCK, policy=policy, hash_seed=0, record_events=True)
    admits = [op for op in ops if op[0] == "admit"]
    future = BeladyPolicy.next_uses(mgr.prompt(op[2]).block_hashes() for op in admits)
    futures = dict(zip((op[1] for op in admits), future))
    admitted = set()
    for op in ops:
        if op[0] == "admit":
            _, sid, prompt, priority = op
            p = mgr.prompt(prompt)
            if isinstance(policy, BeladyPolicy):
                for h, t in zip(p.block_hashes(), futures[sid]):
                    policy.set_next_use(h, t)
            if mgr.match(p).fits:
                mgr.admit(sid, p, priority=priority)
                admitted.add(sid)
        elif op[0] == "free":
            if op[1] in admitted:
                mgr.free(op[1])
        elif op[0] == "append":
            sid = op[1]
            if sid in mgr and mgr.blocks_needed_to_append(sid, op[2]) <= mgr.num_free_blocks:
                mgr.append(sid, [(mgr.num_tokens(sid) + i) % 3 for i in range(op[2])])
        else:
            mgr.reset_prefix_cache()
        mgr.check_invariants()
    return mgr


def removed(mgr):
    return [e.block_hash for e in mgr.drain_events() if isinstance(e, BlockRemoved)]


@pytest.mark.parametrize("name", NAMES + ["priority+lru", "priority+leaf-lru"])
def test_policy_runs_the_real_manager(name):
    lru_removals, removals, evictions, hits = [], [], 0, 0
    for seed in range(4):
        ops = plan_workload(seed)
        if name.startswith("priority+"):
            policy = PriorityPolicy(make_policy(name.split("+")[1]), min_priority=2)
        else:
            policy = make_policy(name)
        mgr = run_workload(policy, ops)
        removals += removed(mgr)
        evictions += mgr.pool.evictions
        hits += mgr.stats().hit_tokens
        lru_removals += removed(run_workload(make_policy("lru"), ops))
    assert evictions > 50 and hits > 0
    # The manager releases tail first and a hit needs the whole prefix, so a child is always released
    # before its parent and LRU already evicts leaves first: leaf-lru differs from it only around
    # duplicates (test_leaf_lru_differs_from_lru_through_a_duplicate_parent).
    # session is LRU without hints, and these frees give none (tests/policies/test_session.py covers
    # hinted frees).
    if name not in ("lru", "leaf-lru", "priority+leaf-lru", "session"):
        assert removals != lru_removals, f"{name} evicted exactly like LRU"


@pytest.mark.parametrize("name", NAMES + ["priority+slru"])
def test_policy_handles_duplicates_taking_over(name, monkeypatch):
    promotions = []
    original = BlockPool._promote

    def promote(pool, duplicate, block_hash, evicted):
        promotions.append(duplicate)
        original(pool, duplicate, block_hash, evicted)

    monkeypatch.setattr(BlockPool, "_promote", promote)
    for seed in range(4):
        if name.startswith("priority+"):
            policy = PriorityPolicy(make_policy(name.split("+")[1]), min_priority=1)
        else:
            policy = make_policy(name)
        ops = plan_duplicate_workload(seed)
        mgr = run_workload(policy, ops)
        for op in ops:
            if op[0] == "admit" and op[1] in mgr:
                mgr.free(op[1])
        mgr.check_invariants()
        assert mgr.pool.num_active == 0
    assert promotions


@pytest.mark.parametrize("name", ["lru", "leaf-lru"])
def test_leaf_lru_differs_from_lru_through_a_duplicate_parent(name):
    mgr = KVCacheManager(5, BLOCK, policy=name, hash_seed=0)
    mgr.admit("a", [1, 2, 3, 4])
    mgr.free("a")                                 # P = [1 2 3 4] waits
    mgr.admit("x", [1, 2, 3, 4])                  # fully cached, so recomputed: a duplicate of P
    mgr.append("x", [5, 6, 7, 8, 9])              # publishes child C = [5 6 7 8] under P's hash
    mgr.admit("y", [20, 21, 22, 23])              # Q waits, released after P; pool now full
    mgr.free("y")
    mgr.admit("z", [30])                          # needs one block: P or Q goes
    mgr.check_invariants()
    q_cached = mgr.match([20, 21, 22, 23, 0]).hit_blocks == 1
    # LRU evicts P (its duplicate takes over the hash); leaf-lru keeps P, whose child is cached, and
    # evicts Q.
    assert q_cached == (name == "lru")


def test_belady_beats_every_online_policy_on_a_cache_only_replay():
    """Cache-only replay (admit then free at once) of a reuse-heavy trace: MIN has the best hit rate."""
    rng = random.Random(7)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(4, 12))] for _ in range(12)]
    trace = [prompts[min(int(rng.paretovariate(1.0)) - 1, 11)] + [rng.randrange(50, 60)] for _ in range(300)]

    def hit_rate(name):
        policy = make_policy(name)
        mgr = KVCacheManager(8, BLOCK, policy=policy, hash_seed=0)
        future = BeladyPolicy.next_uses(mgr.prompt(t).block_hashes() for t in trace)
        for i, tokens in enumerate(trace):
            p = mgr.prompt(tokens)
            if name == "belady":
                for h, t in zip(p.block_hashes(), future[i]):
                    policy.set_next_use(h, t)
            mgr.admit(i, p)
            mgr.free(i)
        return mgr.stats().hit_tokens

    rates = {name: hit_rate(name) for name in NAMES}
    assert rates["belady"] == max(rates.values()) > rates["lru"]


