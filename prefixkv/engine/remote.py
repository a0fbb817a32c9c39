"""The engine's side of the tiers below the host tier (disk, remote): prefetch before a step's admissions,
write-back after it.

``RemoteStep`` wraps a manager's ``prefixkv.tier_stack.TierStack`` for the engine loop:

* ``before(scheduler, now)``: before ``schedule``, stage in the host tier the
  remote continuation of the prompts the scheduler may admit this step: the
  waiting requests that have arrived and are not swapped out, in the
  scheduler's order, at most one per free seat (``max_num_seqs`` minus the
  running ones). Each request is prefetched once per token count (a recompute
  preemption adds tokens and prefetches again), so a request that waits several
  steps costs one probe, not one per step. The scheduler then sees the staged
  blocks as host hits, and the round's loads bring them to the device before
  its writes.
* ``after()``: after a step whose executor ran, queue the blocks it published
  for the store's background writer.
* ``discard()``: a step failed: its published blocks hold KV that was never
  written; forget them (the scheduler also drops them from the cache).
"""

from __future__ import annotations

from .capacity import hashed_tokens
from .request import RequestStatus


class RemoteStep:
    def __init__(self, tier) -> None:
        self.tier = tier
        # request -> token count it was prefetched at. Keyed by the Request object, not its id: a new
        # request may reuse a finished one's id with another prompt of the same length.
        self._prefetched: dict = {}

    def before(self, scheduler, now: float) -> int:
        """Prefetch for the requests this step may admit; returns the blocks staged."""
        seats = scheduler.config.max_num_seqs - len(scheduler.running)
        staged = 0
        mgr = scheduler.mgr
        done = self._prefetched
        for r in scheduler.waiting:
            if seats <= 0:
                break
            if r.arrival_time > now:
                continue
            seats -= 1
            if r.status is RequestStatus.SWAPPED or done.get(r) == len(r.tokens):
                continue
            done[r] = len(r.tokens)
            staged += self.tier.prefetch(hashed_tokens(mgr, r))
        if len(done) > 2 * len(scheduler.requests) + 64:     # forget requests that are gone
            live = scheduler.requests
            self._prefetched = {r: n for r, n in done.items() if live.get(r.request_id) is r}
        return staged

    def after(self) -> int:
        return self.tier.write_back()

    def discard(self) -> None:
        self.tier.manager.take_published()
