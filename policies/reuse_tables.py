"""Reuse tables: how likely a cached block of each class is to be accessed again, by its age.

The session policy's chat fallback (releases without an end reason, ``policies/session.py``)
ranks blocks with what this module learns online, from the past only:

* Every released block opens a reuse *experiment* on its hash, in its class (``chat_class``).
  An access of the hash (a hit, or the hash cached again) closes it as a reuse at its age;
  a release of the same hash while it is open, or an age past the last bucket, closes it
  without one.
* Per class and age bucket (0, 1, 2, 4 .. 4096 s) it counts reuses and *exposure* (block-seconds
  survived in the bucket). Open experiments count the exposure they have had so far, so the
  estimate is censoring-aware: hazard = reuses / exposure.
* ``compute`` turns the counts into each class's *index* per age bucket: the most reuses per
  block-second its block can still give if kept up to some later age (LHD-like), from the
  hazard shrunk to the class's parent (its key without the last field).

An experiment weighs ``w``: a release's private blocks return together or not at all, so the
caller gives each 1 / the release's blocks and the release counts as one experiment.
"""

from __future__ import annotations

from collections import deque
from math import exp

EDGES = (0.0,) + tuple(float(2 ** k) for k in range(13))  # age buckets, seconds: 0, 1, 2, 4, ..., 4096
BUCKETS = len(EDGES) - 1
WIDTH = tuple(EDGES[b + 1] - EDGES[b] for b in range(BUCKETS))
MID = tuple(0.5 * (EDGES[b] + EDGES[b + 1]) for b in range(BUCKETS))
EVIDENCE = 64            # block experiments opened before the tables rank chat releases
PRIOR = 5.0              # a class's hazard is shrunk to its parent's, worth this many blocks through each bucket
CAP = 20000.0            # experiments a class remembers (its counts halve beyond)
MAX_OPEN = 1 << 19       # experiments open at once, at most (later blocks open none until some close)


def chat_class(leaf: bool, shared: bool, count: int, gap: float, tokens: int) -> tuple:
    """A chat block's class: the release's tail; a block shared by sessions; else a private block by how
    often its hash was accessed (1, 2, 3+), the time since its session's previous request (none, < 30 s,
    < 10 min, longer) and the request's length (< 16k, < 32k, < 128k, longer tokens). Coarse to fine:
    the tables shrink a class to its prefix.

    The 128k cut separates the very long requests (document-sized contexts, re-read often on Mooncake
    synthetic: most of what a depth-weighted GDSF gains there over the tables lies at depth >= 128
    blocks of 512); a 64k cut as well split conversation's long requests, whose reuse does not differ
    from 32-64k ones, into classes too small to learn (RESULTS, seventh session)."""
    if leaf:
        return ("leaf",)
    if shared:
        return ("shared",)
    return ("private", count if count < 3 else 3, 0 if gap < 0 else (1 if gap < 30 else (2 if gap < 600 else 3)),
            (tokens >= 16384) + (tokens >= 32768) + (tokens >= 131072))


class ClassStats:
    """What one class's experiments taught: per age bucket, reuses and exposure, and the index."""

    __slots__ = ("klass", "hits", "expo", "inside", "tsum", "total", "table")

    def __init__(self, klass: tuple) -> None:
        self.klass = klass
        self.hits = [0.0] * BUCKETS
        self.expo = [0.0] * BUCKETS
        self.inside = [0] * BUCKETS     # open experiments now in each bucket ...
        self.tsum = [0.0] * BUCKETS     # ... and the sum of their start times (their exposure so far)
        self.total = 0.0                # experiments counted (halved with the counts beyond CAP)
        self.table = [0.0] * BUCKETS    # the index by age bucket


class ReuseTables:
    """Open experiments and access counts of hashes; the counts live in each class's ``ClassStats``."""

    def __init__(self) -> None:
        self.open: dict = {}            # hash -> its open experiment [stats, start, bucket, open, hash, weight]
        self.ages = [deque() for _ in range(BUCKETS)]   # open experiments by age bucket, start order
        self.pending: list = []         # experiments whose hash was accessed since the clock last moved
        self.evidence = 0               # experiments opened
        self.counts: dict = {}          # hash -> accesses (two generations: bounded memory)
        self.counts_old: dict = {}
        self.count_limit = 1 << 18

    def accesses(self, h) -> int:
        """How often ``h`` was accessed (at least 1: the access that cached it)."""
        return self.counts.get(h) or self.counts_old.get(h) or 1

    def start(self, stats: ClassStats, now: float, h, w: float) -> None:
        """Open an experiment on ``h`` in ``stats``'s class, weighing ``w`` (none past MAX_OPEN)."""
        opened = self.open
        if len(opened) >= MAX_OPEN:
            return
        entry = [stats, now, 0, True, h, w]
        previous = opened.get(h)
        if previous is not None and previous[3]:   # released again, never accessed: it stops
            self._close(previous, now)
        opened[h] = entry
        self.ages[0].append(entry)
        stats.inside[0] += w
        stats.tsum[0] += w * now
        stats.total += 1.0
        self.evidence += 1

    @staticmethod
    def _close(entry, now: float) -> None:
        """Stop an experiment without an outcome (its exposure so far is kept)."""
        entry[3] = False
        q, t, b, w = entry[0], entry[1], entry[2], entry[5]
        q.inside[b] -= w
        q.tsum[b] -= w * t
        q.expo[b] += w * max(0.0, now - t - EDGES[b])

    def touch(self, h) -> None:
        """An access of hash ``h`` (a hit, or its block cached again): count it, end its experiment."""
        counts = self.counts
        counts[h] = (counts.get(h) or self.counts_old.get(h) or 0) + 1
        if len(counts) > self.count_limit:
            self.counts_old = counts
            self.counts = {}
        entry = self.open.pop(h, None)
        if entry is not None and entry[3]:
            self.pending.append(entry)     # its age is known when the clock next moves

    def resolve(self, now: float) -> None:
        """Record the reuses since the clock last moved, at ``now``."""
        for entry in self.pending:
            if entry[3]:
                entry[3] = False
                q, t, b, w = entry[0], entry[1], entry[2], entry[5]
                q.hits[b] += w
                q.inside[b] -= w
                q.tsum[b] -= w * t
                q.expo[b] += w * max(0.0, now - t - EDGES[b])
        self.pending = []

    def age_out(self, now: float) -> None:
        """Move open experiments whose age passed their bucket's end into the next bucket (or close them:
        not reused within the last edge)."""
        ages = self.ages
        opened = self.open
        for b in range(BUCKETS):
            d = ages[b]
            limit = now - EDGES[b + 1]
            while d and d[0][1] <= limit:
                entry = d.popleft()
                if not entry[3]:
                    continue
                q, t, w = entry[0], entry[1], entry[5]
                q.expo[b] += w * WIDTH[b]
                q.inside[b] -= w
                q.tsum[b] -= w * t
                if b + 1 < BUCKETS:
                    entry[2] = b + 1
                    ages[b + 1].append(entry)
                    q.inside[b + 1] += w
                    q.tsum[b + 1] += w * t
                else:
                    entry[3] = False
                    if opened.get(entry[4]) is entry:
                        del opened[entry[4]]

    @staticmethod
    def exposure(stats: ClassStats, now: float) -> list[float]:
        """Block-seconds the class's experiments spent in each age bucket up to ``now``: closed and
        passed buckets as counted, plus the open experiments' time in their current bucket."""
        return [stats.expo[b] + max(0.0, stats.inside[b] * (now - EDGES[b]) - stats.tsum[b]) for b in range(BUCKETS)]

    @staticmethod
    def compute(classes: list[ClassStats], now: float) -> None:
        """Each class's index by age bucket: the most reuses per block-second its blocks can give if kept
        up to some later age, from a hazard per bucket (reuses / exposure, censoring-aware) shrunk to the
        class's parent (its key without the last field), the root to almost nothing. A bucket's reuses
        are placed at its midpoint: exact enough while a bucket is short against the class's mean reuse
        time; past that (old buckets of a class reused within seconds) old blocks are undervalued.
        Counting the exact expected occupancy under the piecewise-constant hazard instead was measured
        no better (RESULTS, fourth session)."""
        hits: dict = {}
        expos: dict = {}
        for q in classes:
            if q.total > CAP:
                q.hits = [x * 0.5 for x in q.hits]
                q.expo = [x * 0.5 for x in q.expo]
                q.total *= 0.5
            e = ReuseTables.exposure(q, now)
            for level in range(1, len(q.klass) + 1):
                key = q.klass[:level]
                h = hits.setdefault(key, [0.0] * BUCKETS)
                x = expos.setdefault(key, [0.0] * BUCKETS)
                for b in range(BUCKETS):
                    h[b] += q.hits[b]
                    x[b] += e[b]
        rates: dict = {}

        def rate(key):
            r = rates.get(key)
            if r is None:
                h, x = hits[key], expos[key]
                if len(key) == 1:
                    r = [(h[b] + 0.01) / (x[b] + WIDTH[b]) for b in range(BUCKETS)]
                else:
                    parent = rate(key[:-1])
                    r = [(h[b] + PRIOR * WIDTH[b] * parent[b]) / (x[b] + PRIOR * WIDTH[b]) for b in range(BUCKETS)]
                rates[key] = r
            return r

        for q in classes:
            lam = rate(q.klass)
            reuse = [1.0 - exp(-WIDTH[b] * lam[b]) for b in range(BUCKETS)]
            alive = [1.0] * (BUCKETS + 1)
            for b in range(BUCKETS):
                alive[b + 1] = alive[b] * (1.0 - reuse[b])
            table = []
            for j in range(BUCKETS):
                a = EDGES[j]
                best = got = spent = 0.0
                if alive[j] > 1e-12:
                    for k in range(j, BUCKETS):
                        p = alive[k] * reuse[k]
                        got += p
                        spent += p * (MID[k] - a)
                        t = spent + alive[k + 1] * (EDGES[k + 1] - a)
                        if t > 0.0 and got / t > best:
                            best = got / t
                table.append(best)
            q.table = table
