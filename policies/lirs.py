"""LIRS (Low Inter-reference Recency Set): keep the blocks whose reuse distance is short.

Jiang, Zhang, "LIRS: An Efficient Low Inter-reference Recency Set Replacement Policy to
Improve Buffer Cache Performance", ACM SIGMETRICS 2002.

Rules, as in the paper's section 3: blocks are LIR (short inter-reference recency; never
evicted while an HIR block can be) or HIR. Stack S orders recently accessed hashes (LIR
blocks, resident HIR blocks and non-resident HIR hashes), most recent on top, and is pruned
so its bottom is always LIR. List Q holds the resident HIR blocks; the victim is Q's front,
which stays in S as a non-resident hash if it was there. An access moves the hash to the top
of S; an HIR block (resident or not) accessed while in S becomes LIR and the bottom LIR block
becomes HIR at the end of Q; an HIR block accessed out of S stays HIR, to the end of Q.
While LIR blocks number fewer than ``capacity - hir`` (``hir = max(1, int(hir_fraction *
capacity))``, 1 % by default as in libCacheSim), a new block is LIR.

On the evictable set: Q's candidates are kept in the order they joined Q or were released
(a resident HIR block in use rejoins Q's end when released). When no HIR block can go, the
least recently released LIR candidate goes (the paper never needs this: its LIR set fits the
cache, while here blocks in use can hold every HIR slot). S keeps at most
``nonresident_ratio x capacity`` non-resident hashes, the oldest dropped first (the paper
leaves S unbounded; this bounds its memory). Every event is O(1) amortised (pruning removes
what earlier accesses pushed).

Measured against libCacheSim 0.3.5's ``LIRS`` on one-block requests this prefixkv variant
differs (``tests/policies/test_libcachesim_equality.py`` pins both counts; the README says by
how much).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's status: it was no miss.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixkv.checks import real

from .arc import takes_over
from .base import PolicyBase

_LIR, _HIR, _NONRESIDENT = 0, 1, 2


class LIRSPolicy(PolicyBase):
    name = "lirs"
    reads_chain = False

    def __init__(self, hir_fraction: float = 0.01, nonresident_ratio: float = 2.0) -> None:
        real("hir_fraction", hir_fraction, low=0.0, high=1.0, high_open=True)
        real("nonresident_ratio", nonresident_ratio, low=0.0)
        self.hir_fraction = hir_fraction
        self.nonresident_ratio = nonresident_ratio
        self.lir_limit = 1 << 62
        self._nonresident_limit = 1 << 62
        self._status: dict = {}                 # hash -> _LIR | _HIR | _NONRESIDENT
        self._stack: OrderedDict = OrderedDict()    # S: hashes, bottom (least recent) first
        self._nonresident: OrderedDict = OrderedDict()  # non-resident hashes in S, oldest first
        self._hash: dict[int, object] = {}      # cached block -> its hash
        self._block: dict = {}                  # resident hash -> its block
        self._hir_cands: OrderedDict[int, None] = OrderedDict()   # Q's candidates, front first
        self._lir_cands: OrderedDict[int, None] = OrderedDict()   # LIR candidates, release order
        self._num_lir = 0
        self._victim: tuple | None = None       # (hash, status, whether in S) of the latest victim

    def bind(self, pool) -> None:
        super().bind(pool)
        c = pool.num_blocks
        self.lir_limit = max(0, c - max(1, int(self.hir_fraction * c)))
        self._nonresident_limit = int(self.nonresident_ratio * c)

    # -- S -----------------------------------------------------------------------------------
    def _to_top(self, block_hash) -> None:
        stack = self._stack
        stack[block_hash] = None
        stack.move_to_end(block_hash)

    def _prune(self) -> None:
        """Pop S's bottom until it is LIR; non-resident hashes popped are forgotten."""
        stack, status = self._stack, self._status
        while stack:
            bottom = next(iter(stack))
            st = status[bottom]
            if st == _LIR:
                return
            del stack[bottom]
            if st == _NONRESIDENT:
                del status[bottom], self._nonresident[bottom]

    def _demote_bottom_lir(self) -> None:
        """S's bottom LIR block becomes HIR, to Q's end; then S is pruned."""
        # Pruned first: S's bottom is LIR whenever S holds a LIR block, except after a time with no
        # LIR block at all (at capacity 1 the LIR set is empty; elsewhere blocks in use can force
        # every LIR block out), when hashes pushed meanwhile lie below the next LIR one.
        self._prune()
        stack = self._stack
        bottom = next(iter(stack))
        del stack[bottom]
        self._status[bottom] = _HIR
        self._num_lir -= 1
        block = self._block[bottom]
        if block in self._lir_cands:
            del self._lir_cands[block]
            self._hir_cands[block] = None
        self._prune()

    def _make_lir(self, block_hash) -> None:
        self._status[block_hash] = _LIR
        self._num_lir += 1
        self._to_top(block_hash)
        while self._num_lir > self.lir_limit and self._stack:
            self._demote_bottom_lir()

    def _leave(self, block_hash) -> tuple:
        """A resident hash stops being resident (evicted, or its residency ended in use)."""
        status, stack = self._status, self._stack
        st = status[block_hash]
        in_stack = block_hash in stack
        del self._block[block_hash]
        if st == _LIR:
            self._num_lir -= 1
            del status[block_hash], stack[block_hash]
            self._prune()
        elif in_stack:
            status[block_hash] = _NONRESIDENT
            self._nonresident[block_hash] = None
            if len(self._nonresident) > self._nonresident_limit:
                oldest = self._nonresident.popitem(last=False)[0]
                del stack[oldest], status[oldest]
        else:
            del status[block_hash]
        return st, in_stack

    # -- events --------------------------------------------------------------------------------
    def on_cached(self, block: int) -> None:
        stale = self._hash.get(block)
        if stale is not None and self._block.get(stale) == block:   # residency ended in use, unannounced
            self._leave(stale)
        block_hash = self.pool.block_hash[block]
        self._hash[block] = block_hash
        self._block[block_hash] = block
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            _, st, in_stack = victim
            if st == _LIR:
                self._make_lir(block_hash)
            else:
                if in_stack:
                    del self._nonresident[block_hash]
                self._status[block_hash] = _HIR
            return
        st = self._status.get(block_hash)
        if st == _NONRESIDENT:                  # its reuse distance beats the bottom LIR's
            del self._nonresident[block_hash]
            self._make_lir(block_hash)
        elif self._num_lir < self.lir_limit:
            self._make_lir(block_hash)
        else:
            self._status[block_hash] = _HIR
            self._to_top(block_hash)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        block_hash = self._hash[block]
        st = self._status[block_hash]
        if st == _LIR:
            if was_evictable:
                del self._lir_cands[block]
            was_bottom = next(iter(self._stack)) == block_hash
            self._to_top(block_hash)
            if was_bottom:
                self._prune()
            return
        if was_evictable:
            del self._hir_cands[block]
        if block_hash in self._stack:
            self._num_lir += 1
            self._status[block_hash] = _LIR
            self._to_top(block_hash)
            self._demote_bottom_lir()
        else:
            self._to_top(block_hash)            # stays HIR; rejoins Q's end when released

    def on_released(self, block: int) -> None:
        if self._status[self._hash[block]] == _LIR:
            self._lir_cands[block] = None
        else:
            self._hir_cands[block] = None

    def evict(self) -> int:
        if self._hir_cands:
            block = self._hir_cands.popitem(last=False)[0]
        else:
            block = self._lir_cands.popitem(last=False)[0]
        block_hash = self._hash.pop(block)
        st, in_stack = self._leave(block_hash)
        self._victim = (block_hash, st, in_stack)
        return block

    def clear(self) -> None:
        self._victim = None
        self._status.clear()
        self._stack.clear()
        self._nonresident.clear()
        self._hash.clear()
        self._block.clear()
        self._hir_cands.clear()
        self._lir_cands.clear()
        self._num_lir = 0

    def __len__(self) -> int:
        return len(self._hir_cands) + len(self._lir_cands)

    def __contains__(self, block: int) -> bool:
        return block in self._hir_cands or block in self._lir_cands

    def snapshot(self) -> tuple:
        return (tuple(self._hir_cands), tuple(self._lir_cands), tuple(self._stack.items()),
                tuple(self._status.items()), self._num_lir)
