"""The protocol between the block pool and an eviction policy.

The pool owns the blocks and their metadata; a policy only orders the
*evictable* ones (refcount 0, hash kept) and picks a victim among them. The pool
tells the policy about every event that can matter to an ordering:

* ``on_cached(block)``   the block got a published hash and entered the prefix
                          cache (it is active at that moment, never evictable);
* ``on_released(block)``  its refcount fell to 0 with its hash kept: it is now
                          a candidate;
* ``on_hit(block, was_evictable)``  a prefix-cache hit took a reference. If the
                          block was a candidate it stops being one (the policy
                          must forget it in O(1)/O(log n));
* ``evict() -> block``     choose a candidate, forget it and return it; the pool
                          then drops its hash;
* ``clear()``              the prefix cache was reset: forget every block.

A policy reads what it needs from ``self.pool`` after ``bind(pool)``: per-block
``depth`` (index in its prefix chain), ``parent_hash``, ``block_hash``,
``priority`` and ``lookup(hash) -> block | None`` for parent/child relations.
Every event must cost O(1) or O(log n); no rebuild of an order per eviction.

One policy object serves one pool (``bind`` does not reset state); it may size
itself from ``pool.num_blocks`` and ``pool.block_size`` at ``bind`` and keep
references to the pool's metadata lists (they are refilled in place on reset).
``pool.priority[block]`` is the priority of the sequence that released the
block last: larger means more important.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from prefixkv.pool import BlockPool


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def bind(self, pool: "BlockPool") -> None: ...
    def on_cached(self, block: int) -> None: ...
    def on_released(self, block: int) -> None: ...
    def on_hit(self, block: int, was_evictable: bool) -> None: ...
    def evict(self) -> int: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, block: int) -> bool: ...
    def snapshot(self) -> Any:
        """A comparable picture of the policy's state (tests compare before/after)."""
        ...


class PolicyBase:
    """Defaults for the events a simple policy ignores."""

    name = "base"
    pool: "BlockPool | None" = None

    def bind(self, pool: "BlockPool") -> None:
        self.pool = pool

    def on_cached(self, block: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(candidates={len(self)})"  # type: ignore[arg-type]
