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
                          then drops its hash, unless an active duplicate of it takes
                          the hash over: then ``on_cached(duplicate)`` follows at once,
                          with ``pool.promoting`` True (the hash never left the cache;
                          a policy with ghosts should not count it as a return);
* ``clear()``              the prefix cache was reset: forget every block.

A policy reads what it needs from ``self.pool`` after ``bind(pool)``: per-block
``depth`` (index in its prefix chain), ``parent_hash``, ``block_hash``,
``priority`` and ``lookup(hash) -> block | None`` for parent/child relations.
Every event must cost O(1) or O(log n); no rebuild of an order per eviction.

One policy object serves one pool (``bind`` does not reset state); it may size
itself from ``pool.num_blocks`` and ``pool.block_size`` at ``bind`` and keep
references to the pool's metadata lists (they are refilled in place on reset).
Those lists cover only the blocks handed out so far (``len(pool.block_hash)``)
and grow in place. ``pool.block_hash`` is read-only to a policy and may be a sequence
view rather than a list: a pool with a flat index (``prefixkv.flat``) reads each block's
digest back from its arrays, so the hash a policy gets is an equal ``bytes``, not the object
that was published (key dicts by it, never compare it by identity); a policy that keeps its own per-block list sizes it to that
length at ``bind`` and defines ``on_grow(num_blocks)``, called after each growth.
``pool.priority[block]`` is the priority of the sequence that released the
block last: larger means more important.

Session hints (optional; added for the ``session`` policy). ``KVCacheManager.free(seq,
hint=SessionHint(...))`` says which session the request belonged to, why it
ended and, when the caller knows it, when the session is expected back. The
pool hands the hint over in two ways, both free for policies that ignore it:

* ``on_hint(hint)``, if the policy defines it, is called once per hinted
  release, *before* that release's ``on_released`` events;
* ``pool.hint`` is that hint while the release's ``on_released`` calls run,
  and ``None`` at every other moment (unhinted frees, preemption, copy on
  write, swaps), so a policy can read it per block as it reads ``priority``;
  during a hinted release ``pool.release_size`` is the number of blocks handed to
  it (the freed request's whole block table: its length in blocks).

A hint describes the moment of ``free()`` and the past, never the future: a
trace replayer builds it from the request's own stop reason and time only.
A policy that can say what it expects may also define ``predict(hint) ->
(p_return, gap_s) | None`` (pure: no state change); replays score it against
the trace (``ReplayResult.return_auc`` / ``arrival_log_error``).
Policies without ``on_hint`` / ``predict`` work unchanged: nothing else in the
protocol changed.

Optional batch events, for speed (a pool uses each only when the class that
defines the single event defines the batch one too, so a subclass overriding
``evict`` alone is never bypassed):

* ``on_released_batch(blocks)`` means exactly ``on_released(b)`` for each ``b``
  in order; a pool calls it once per release instead (with ``pool.hint`` set as
  above);
* ``evict_many(k) -> list`` means exactly ``k`` successive ``evict()`` calls; a
  pool calls it when one allocation needs ``k`` victims (no KV events, no
  active duplicates: otherwise it calls ``evict`` per block). The pool checks
  the victims (k distinct evictable cached blocks) unless the policy's own class
  declares ``valid_victims = True``, a promise its reference tests must keep;
* ``on_hit_batch(blocks)`` means exactly ``on_hit(b, True)`` for each ``b`` in
  order; a pool calls it when every block of a hit was evictable, each listed once;
* ``reads_chain = False`` (a class attribute the policy's own class declares, not
  inherited) says the policy never reads ``pool.parent_hash`` / ``pool.depth``: a pool
  without a tier below then skips storing them on publish;
* ``on_cached_batch(blocks)`` means exactly ``on_cached(b)`` for each ``b`` in
  order, called after all of them are in the hash map. Without it, a policy
  that overrides ``on_cached`` is told block by block as each is published.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from prefixkv.pool import BlockPool


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What the caller knows about a request when it frees it (all optional but ``session``).

    * ``session``: the session (conversation, agent loop) the request belongs to: any
      hashable id; requests of one session extend one another's context.
    * ``end``: why the request ended, e.g. ``"tool_use"`` (a tool runs, the agent comes back
      soon), ``"end_turn"`` (the user's turn), ``"max_tokens"``; ``None`` when unknown.
    * ``time``: when the request finished, in seconds on any clock that never goes back
      (a replay uses the trace's timestamps); ``None``: the policy uses its own clock.
    * ``next_arrival``: the caller's own estimate of the seconds until the session's next
      request (an agent framework that knows its tool's timeout); ``None``: let the policy predict.
    * ``turn``: the request's index in its session (0 = first); ``parent``: the parent
      session of a sub-agent.
    """

    session: Hashable
    end: str | None = None
    time: float | None = None
    next_arrival: float | None = None
    turn: int | None = None
    parent: Hashable | None = None

    def __post_init__(self) -> None:
        from prefixkv.errors import InvalidArgument

        if self.session is None:
            raise InvalidArgument("SessionHint.session", "must be a hashable id, not None")
        try:
            hash(self.session)
        except TypeError:
            raise InvalidArgument("SessionHint.session",
                                  f"must be hashable, got {type(self.session).__name__}") from None
        if self.end is not None and not isinstance(self.end, str):
            raise InvalidArgument("SessionHint.end", f"must be a string or None, got {type(self.end).__name__}")
        for name in ("time", "next_arrival"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(f"SessionHint.{name}", f"must be a number of seconds, got {type(value).__name__}")
            if not math.isfinite(value) or (name == "next_arrival" and value < 0):
                raise InvalidArgument(f"SessionHint.{name}",
                                      f"must be finite{' and >= 0' if name == 'next_arrival' else ''}, got {value}")
        if self.turn is not None and (isinstance(self.turn, bool) or not isinstance(self.turn, int) or self.turn < 0):
            raise InvalidArgument("SessionHint.turn", f"must be an int >= 0, got {self.turn!r}")


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
