"""Block capacity of one scheduling round, computed before anything changes.

A ``Round`` is what a step will do to the manager: preempt some running
requests, swap some back in, grow running requests by a prompt chunk or a
decode token, admit new (or recompute-preempted) requests with a prefix of
their tokens. ``round_capacity`` adds up, read-only, the free blocks all of it
takes and what preemptions give back, so the scheduler can refuse (or shrink)
a round *before* publishing a single block table: the kernel never sees an
address that was not allocated.

The counts are exact or over-estimates, never under:

* growth: ``blocks_needed_to_append`` (fresh tail blocks + copy-on-write);
* admission of ``k`` tokens after the prefix hit: the evictable cache hits it
  pins plus ``ceil(k / block_size)`` fresh blocks, from the hit it has now.
  At commit the request is admitted with ``tokens[:min(hit now, planned hit) + k]``:
  within that head every extra hit (a block an earlier admission of the
  round has just published, or a cached block it reconnected to its prefix)
  replaces a fresh block, and a hit lost to an eviction only ends the hit
  earlier (the k computed tokens still take ``ceil(k / block_size)`` fresh
  blocks);
* a preempted request gives back only the blocks it holds alone
  (refcount 1): blocks other requests still reference stay theirs.

A round with preemptions admits nothing and swaps nothing in (a preempted
request's blocks turn evictable, and pinning them again costs a block the
pre-round estimate did not charge); ``round_capacity`` refuses such a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping

from ..manager import KVCacheManager
from ..costs import PreemptMode
from .request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Round:
    preempt: tuple[tuple[Hashable, PreemptMode], ...] = ()
    swap_in: tuple[tuple[Hashable, int], ...] = ()   # (request, tokens computed once swapped in)
    grow: tuple[tuple[Hashable, int], ...] = ()      # (running request, tokens computed)
    admit: tuple[tuple[Hashable, int], ...] = ()     # (request, tokens computed after its prefix hit)

    @property
    def is_empty(self) -> bool:
        return not (self.preempt or self.swap_in or self.grow or self.admit)


@dataclass(frozen=True, slots=True)
class RoundCapacity:
    needed: int           # free blocks the round takes
    available: int        # free blocks now + blocks its preemptions give back
    host_needed: int      # host blocks its swap-outs take
    host_available: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.available and self.host_needed <= self.host_available


def exclusive_blocks(mgr: KVCacheManager, seq_id: Hashable) -> int:
    """Blocks a preemption of ``seq_id`` would give back: those it alone references."""
    ref = mgr.pool.ref_count
    return sum(1 for block in mgr.block_ids(seq_id) if ref[block] == 1)


def hashed_tokens(mgr: KVCacheManager, request: Request):
    """The manager's ``Prompt`` of ``request.tokens``, hashed once per length (tokens only grow)."""
    prompt = request.hashed
    if prompt is None or prompt.num_tokens != len(request.tokens) or prompt.hasher is not mgr.hasher:
        prompt = request.hashed = mgr.prompt(request.tokens, salt=request.salt)
    return prompt


def admission_cost(mgr: KVCacheManager, prompt) -> tuple[int, int]:
    """(hit tokens, blocks pinned) for admitting a prefix of ``prompt``: the cost of
    admitting ``tokens[:hit + k]`` is ``pinned + ceil(k / block_size)`` blocks."""
    m = mgr.match(prompt)
    return m.hit_tokens, m.blocks_needed - (m.total_blocks - m.hit_blocks)


def swap_in_cost(mgr: KVCacheManager, request: Request) -> int:
    """Free blocks ``swap_in`` takes for a swapped request (cached full blocks are reused)."""
    return mgr.match(mgr.prompt(request.tokens[:request.num_computed], salt=request.salt),
                     compute_last_token=False).blocks_needed


def swapped_growth(num_computed: int, k: int, block_size: int) -> int:
    """Fresh blocks for ``k`` more tokens after a swap-in (its tail is never shared)."""
    return _cdiv(num_computed + k, block_size) - _cdiv(num_computed, block_size)


def fit_append(mgr: KVCacheManager, seq_id: Hashable, n: int, free: int) -> int:
    """The most tokens (<= n) a running sequence can append with ``free`` blocks."""
    if mgr.blocks_needed_to_append(seq_id, n) <= free:
        return n
    size = mgr.block_size
    have = mgr.num_tokens(seq_id)
    k = min(n, _cdiv(have, size) * size - have + max(free, 0) * size)
    while k > 0 and mgr.blocks_needed_to_append(seq_id, k) > free:
        k -= 1     # a copy-on-write tail takes one block more: at most block_size steps
    return k


def round_capacity(mgr: KVCacheManager, rnd: Round, requests: Mapping[Hashable, Request]) -> RoundCapacity:
    """Add up a round's block needs against what is free. Read-only."""
    if rnd.preempt and (rnd.admit or rnd.swap_in):
        raise ValueError("a round with preemptions admits nothing and swaps nothing in")
    ids = [i for i, _ in rnd.preempt] + [i for i, _ in rnd.swap_in] + [i for i, _ in rnd.grow] + \
        [i for i, _ in rnd.admit]
    if len(set(ids)) != len(ids):
        raise ValueError("a request appears twice in one round")
    available = mgr.num_free_blocks
    host_needed = 0
    for seq_id, mode in rnd.preempt:
        available += exclusive_blocks(mgr, seq_id)
        if mode == "swap":
            host_needed += len(mgr.block_ids(seq_id))
    needed = 0
    for seq_id, k in rnd.grow:
        needed += mgr.blocks_needed_to_append(seq_id, k)
    for seq_id, k in rnd.swap_in:
        r = requests[seq_id]
        needed += swap_in_cost(mgr, r) + swapped_growth(r.num_computed, k, mgr.block_size)
    for seq_id, k in rnd.admit:
        if k < 1:
            raise ValueError(f"request {seq_id!r}: an admission computes at least one token, not {k}")
        pinned = admission_cost(mgr, hashed_tokens(mgr, requests[seq_id]))[1]
        needed += pinned + _cdiv(k, mgr.block_size)
    return RoundCapacity(needed, available, host_needed, mgr.num_free_host_blocks)
