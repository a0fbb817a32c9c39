"""A manager's tier stack: device pool -> host tier -> lower tiers (disk, remote), in that order.

The manager owns the first two: its device pool and its host tier (``prefixkv.host_tier``, swap
space and cache in one pool), which it drives itself on every admission, eviction and release.
Tiers below the host tier hold bytes (a disk directory, a Redis server), so they can only be
*bound* once the KV store whose bytes they move exists: ``stack.bind(kv, weights=...)``. After
that, each talks only to the tier above it, through the protocol ``prefixkv.tiers.base.Tier``
describes: before admissions a lower tier stages the continuation of a prompt's chain, verified,
into free host blocks (the manager then counts them as host hits); after a step it takes the
blocks published from KV this process computed; blocks a tier stages from below the others are
offered to the tiers above it, so a disk tier keeps what a remote one served.

This module knows only that protocol: the core imports no tier module. The faces (engine, HF
store, command line) build stacks with ``prefixkv.tiers.stack``.
"""

from __future__ import annotations

from typing import Sequence

from .errors import InvalidArgument


class TierStack:
    """The tiers below a manager's device pool: ``host`` (or None) and the ``lower`` tiers, top first."""

    def __init__(self, manager, host, lower: Sequence = ()) -> None:
        self.manager = manager
        self.host = host
        self.lower: tuple = tuple(lower)
        self.bound = False

    def __iter__(self):
        if self.host is not None:
            yield self.host
        yield from self.lower

    def __len__(self) -> int:
        return (self.host is not None) + len(self.lower)

    def __bool__(self) -> bool:
        return len(self) > 0

    def tier(self, name: str):
        """The tier of medium ``name`` (``"CPU"``, ``"DISK"``, ``"REMOTE"``), or None."""
        return next((t for t in self if t.name == name), None)

    # -- binding -------------------------------------------------------------------------
    def bind(self, kv, *, weights: bytes, tp_rank: int = 0, tp_size: int = 1) -> "TierStack":
        """Open the lower tiers for ``kv``'s blocks (``weights``: the model's weights digest, part of
        every stored block's fingerprint). All or nothing: a tier that cannot open closes the ones
        opened before it and the error propagates."""
        if self.bound:
            raise InvalidArgument("tiers", "this tier stack is bound already")
        opened = []
        try:
            for tier in self.lower:
                tier.bind(self.manager, kv, weights=weights, tp_rank=tp_rank, tp_size=tp_size)
                opened.append(tier)
        except BaseException:
            for tier in reversed(opened):
                tier.close(flush_timeout_s=0.0)
            raise
        self.bound = True
        return self

    def attach(self, tier) -> None:
        """Add an already bound lower tier at the bottom of the stack."""
        if tier.manager is not self.manager:
            raise InvalidArgument("tier", "this tier was built for another manager")
        self.lower = (*self.lower, tier)
        self.bound = True

    # -- the step ------------------------------------------------------------------------
    def prefetch(self, prompt, *, compute_last_token: bool = True) -> int:
        """Stage ``prompt``'s continuation from each lower tier in turn (each starts where the device,
        the host and the tiers above it stopped); returns the blocks staged. Never raises for a
        tier's trouble (a miss)."""
        staged = 0
        lower = self.lower
        for k, tier in enumerate(lower):
            got = tier.prefetch(prompt, compute_last_token=compute_last_token)
            if got and k:
                for above in lower[:k]:
                    above.keep(tier.last_staged)
            staged += got
        return staged

    def write_back(self) -> int:
        """Hand the blocks published from computed KV since the last call to every lower tier;
        returns the blocks queued (summed over the tiers). Never waits on a tier."""
        if not self.lower:
            return 0
        records = self.manager.take_published()
        return sum(tier.write_back(records) for tier in self.lower)

    def discard(self) -> None:
        """A step failed: the blocks it published hold KV that was never written."""
        if self.lower:
            self.manager.take_published()

    # -- lifetime ------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        return all([tier.flush(timeout_s) for tier in self.lower])

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Flush (bounded) and close every lower tier, bottom last; the host tier stays (it is the
        manager's)."""
        errors = []
        for tier in self.lower:
            try:
                tier.close(flush_timeout_s)
            except Exception as exc:      # the others still close
                errors.append(exc)
        self.lower = ()
        if errors:
            raise errors[0]

    def stats(self) -> dict:
        """Each tier's ``stats()`` by its medium name."""
        return {tier.name: tier.stats() for tier in self}
