"""Belady's MIN: evict the candidate whose next use is furthest in the future.

The offline optimum for a single cache (for prefix caching, where a hit needs
every earlier block, it is the classic bound, not a proof of optimality). It
needs the future, so it exists only in trace replay.

Oracle interface -- the replayer's side of the contract:

* ``set_next_use(block_hash, next_time)`` whenever ``block_hash`` is accessed
  (every block reference of a request, before the request is admitted), with
  ``next_time`` the time of that hash's next access in the trace, or
  ``float('inf')`` if it is never used again. Times are any increasing
  numbers (request index, block-reference index, timestamps).
  ``BeladyPolicy.next_uses`` computes them for a whole trace in one pass.
* A hash the oracle never described counts as never used again.
* Calling it for a hash whose block is a candidate re-keys the block.

Candidates sit in a SortedDict keyed ``(-next_use, release ticket)``: O(log n)
per event; among equally distant blocks (e.g. all never used again) the least
recently released goes first.
"""

from __future__ import annotations

from itertools import count
from typing import Hashable, Iterable, Sequence

from sortedcontainers import SortedDict

from .base import PolicyBase

INF = float("inf")


class BeladyPolicy(PolicyBase):
    name = "belady"

    def __init__(self) -> None:
        self._ticket = count()
        self._next: dict[Hashable, float] = {}       # hash -> time of its next access
        self._key: dict[int, tuple[float, int]] = {}  # candidate -> its key in _candidates
        self._candidates: SortedDict = SortedDict()   # (-next use, ticket) -> block

    @staticmethod
    def next_uses(accesses: Iterable[Sequence[Hashable]]) -> list[list[float]]:
        """For accesses ``[hashes at time 0, hashes at time 1, ...]``, the next
        use time of each hash at each time (``inf`` for never), same shape."""
        accesses = [list(a) for a in accesses]
        out: list[list[float]] = [[] for _ in accesses]
        seen: dict[Hashable, float] = {}
        for t in range(len(accesses) - 1, -1, -1):
            out[t] = [seen.get(h, INF) for h in accesses[t]]
            for h in accesses[t]:
                seen[h] = float(t)
        return out

    def set_next_use(self, block_hash: Hashable, next_time: float) -> None:
        # Only finite times are stored (inf is the default), so the table holds
        # just the hashes with an access still ahead.
        if next_time == INF:
            self._next.pop(block_hash, None)
        else:
            self._next[block_hash] = next_time
        pool = self.pool
        block = pool.lookup(block_hash) if pool is not None else None
        old = self._key.get(block) if block is not None else None
        if old is not None:
            del self._candidates[old]
            key = (-next_time, old[1])
            self._key[block] = key
            self._candidates[key] = block

    def next_use(self, block_hash: Hashable) -> float:
        return self._next.get(block_hash, INF)

    def on_released(self, block: int) -> None:
        key = (-self._next.get(self.pool.block_hash[block], INF), next(self._ticket))
        self._key[block] = key
        self._candidates[key] = block

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._candidates[self._key.pop(block)]

    def evict(self) -> int:
        _, block = self._candidates.popitem(0)
        del self._key[block]
        # _next is kept: a duplicate may take over this hash, and its next use is the same.
        return block

    def clear(self) -> None:
        # The oracle's times describe hashes, not blocks: they stay valid after a reset.
        self._key.clear()
        self._candidates.clear()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def snapshot(self) -> tuple:
        return tuple(self._candidates.items()), tuple(sorted(self._next.items(), key=repr))
