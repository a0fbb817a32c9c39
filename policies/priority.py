"""A wrapper that pins or prioritises blocks (system prompts) over any policy.

``PriorityPolicy(inner, min_priority=None, clock=None)`` protects a candidate
when

* its hash is pinned: ``pin(block_hash, until=t)`` or ``pin(block_hash, ttl=d)``
  (until ``clock() + d``), or ``pin(block_hash)`` for good; ``unpin`` ends it;
* or ``min_priority`` is set and ``pool.priority[block] >= min_priority`` (the
  priority of the last sequence that released the block; larger = more
  important).

A protected candidate is kept aside, never shown to ``inner``; the inner
policy sees it as still in use. Victims come from ``inner`` while it has any
candidate; only when it has none is an aside block evicted -- unpinned
high-priority ones first, lowest priority first, then pinned ones, least
recently released first -- by releasing it to ``inner`` and letting ``inner``
evict its only candidate, so the inner policy's per-block state stays right.
A pin that expires while its block waits moves the block back to ``inner``
(checked at each eviction, in expiry order). Pinning a block that already
waits in ``inner`` takes it out with ``on_hit``, so ``inner`` counts a touch.
Pins are kept across ``clear()``: they name hashes, which a reset does not
change. Everything is O(log n) per event.

``clock`` is any callable returning the current time (e.g. a replay's
timestamp); by default it counts policy events.
"""

from __future__ import annotations

import math
import numbers
from itertools import count
from typing import Any, Callable, Hashable

from sortedcontainers import SortedDict

from prefixkv.errors import InvalidArgument

from .base import EvictionPolicy, PolicyBase

INF = float("inf")


class PriorityPolicy(PolicyBase):
    def __init__(self, inner: EvictionPolicy, *, min_priority: int | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        if min_priority is not None:
            # compared with the pool's int priorities at every release: a str raised TypeError mid-release
            # (an integral float such as 1.0 is the int 1, as it was before this was checked)
            if isinstance(min_priority, bool) or not isinstance(min_priority, numbers.Real) or not (
                    isinstance(min_priority, numbers.Integral)
                    or (math.isfinite(min_priority) and min_priority == int(min_priority))):
                raise InvalidArgument("min_priority", f"must be an int or None, got {type(min_priority).__name__} "
                                                      f"{min_priority!r}")
            min_priority = int(min_priority)
        if clock is not None and not callable(clock):
            raise InvalidArgument("clock", f"must be a callable returning the time, got {clock!r}")
        self.inner = inner
        self.name = f"priority+{inner.name}"
        self.min_priority = min_priority
        self._events = 0
        self._clock = clock
        self._ticket = count()
        self._pins: dict[Hashable, float] = {}        # hash -> pinned until (inf: for good)
        self._pin_deadlines: SortedDict = SortedDict()  # (until, ticket) -> hash, pins with a deadline
        self._pin_key: dict[Hashable, tuple[float, int]] = {}  # hash -> its key in _pin_deadlines
        self._aside_key: dict[int, tuple] = {}        # protected candidate -> key in _aside
        self._aside: SortedDict = SortedDict()        # (pinned, priority, ticket) -> block
        self._expiry: SortedDict = SortedDict()       # (until, ticket) -> pinned aside block
        self._expiry_key: dict[int, tuple[float, int]] = {}  # aside block -> its key in _expiry

    def now(self) -> float:
        return self._events if self._clock is None else self._clock()

    def bind(self, pool) -> None:
        super().bind(pool)
        self.inner.bind(pool)

    # -- caller API ------------------------------------------------------------
    def pin(self, block_hash: Hashable, *, until: float | None = None, ttl: float | None = None) -> None:
        """Protect ``block_hash`` until ``until`` (or for ``ttl``; default: for good)."""
        if until is not None and ttl is not None:
            raise InvalidArgument("ttl", "give until or ttl, not both")
        for name, value in (("until", until), ("ttl", ttl)):
            # a NaN deadline compares false with everything: as a key it broke the deadline order,
            # and the pin never expired
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or math.isnan(value)):
                raise InvalidArgument(name, f"must be a number of seconds (inf: for good), got {value!r}")
        if self._pin_deadlines:
            self._prune_pins()
        until = INF if until is None and ttl is None else (until if until is not None else self.now() + ttl)
        self._drop_pin(block_hash)
        self._pins[block_hash] = until
        if until != INF:
            key = (until, next(self._ticket))
            self._pin_key[block_hash] = key
            self._pin_deadlines[key] = block_hash
        self._reconsider(block_hash)

    def unpin(self, block_hash: Hashable) -> None:
        if self._drop_pin(block_hash):
            self._reconsider(block_hash)

    def _drop_pin(self, block_hash: Hashable) -> bool:
        """Forget ``block_hash``'s pin, if any (whether it was pinned)."""
        key = self._pin_key.pop(block_hash, None)
        if key is not None:
            del self._pin_deadlines[key]
        return self._pins.pop(block_hash, None) is not None

    def _prune_pins(self) -> None:
        """Drop the pins whose deadline has passed (a pin on a hash that is not cached was
        otherwise kept for good)."""
        deadlines = self._pin_deadlines
        now = self.now()
        while deadlines and deadlines.peekitem(0)[0][0] <= now:
            _, block_hash = deadlines.popitem(0)
            del self._pin_key[block_hash]
            del self._pins[block_hash]

    def is_pinned(self, block_hash: Hashable) -> bool:
        until = self._pins.get(block_hash)
        return until is not None and until > self.now()

    def _reconsider(self, block_hash: Hashable) -> None:
        pool = self.pool
        block = pool.lookup(block_hash) if pool is not None else None
        if block is None:
            return
        if block in self._aside_key:
            self._take_aside(block)
            key = self._protection(block)
            if key is None:
                self.inner.on_released(block)
            else:
                self._put_aside(block, key)
        elif block in self.inner:
            key = self._protection(block)
            if key is not None:
                self.inner.on_hit(block, True)
                self._put_aside(block, key)

    # -- bookkeeping -------------------------------------------------------------
    def _protection(self, block: int) -> tuple[bool, int, float] | None:
        """(pinned, priority, pinned until) if the block is protected now, else None."""
        pool = self.pool
        block_hash = pool.block_hash[block]
        until = self._pins.get(block_hash)
        if until is not None and until <= self.now():
            self._drop_pin(block_hash)
            until = None
        priority = pool.priority[block]
        if until is None and (self.min_priority is None or priority < self.min_priority):
            return None
        return until is not None, priority, until

    def _put_aside(self, block: int, protection: tuple[bool, int, float]) -> None:
        pinned, priority, until = protection
        ticket = next(self._ticket)
        key = (pinned, priority, ticket)
        self._aside_key[block] = key
        self._aside[key] = block
        if pinned and until != INF:
            self._expiry_key[block] = (until, ticket)
            self._expiry[(until, ticket)] = block

    def _take_aside(self, block: int) -> None:
        del self._aside[self._aside_key.pop(block)]
        expiry_key = self._expiry_key.pop(block, None)
        if expiry_key is not None:
            del self._expiry[expiry_key]

    def _expire(self) -> None:
        expiry = self._expiry
        now = self.now()
        while expiry and expiry.peekitem(0)[0][0] <= now:
            block = expiry.peekitem(0)[1]
            self._take_aside(block)
            protection = self._protection(block)
            if protection is None:
                self.inner.on_released(block)
            else:
                self._put_aside(block, protection)

    # -- events ------------------------------------------------------------------
    def on_grow(self, num_blocks: int) -> None:
        grow = getattr(self.inner, "on_grow", None)
        if grow is not None:
            grow(num_blocks)

    def on_hint(self, hint) -> None:
        """Session hints go through to the inner policy (it reads ``pool.hint`` itself)."""
        on_hint = getattr(self.inner, "on_hint", None)
        if on_hint is not None:
            on_hint(hint)

    def predict(self, hint):
        predict = getattr(self.inner, "predict", None)
        return None if predict is None else predict(hint)

    def on_cached(self, block: int) -> None:
        self._events += 1
        self.inner.on_cached(block)

    def on_released(self, block: int) -> None:
        self._events += 1
        protection = self._protection(block)
        if protection is None:
            self.inner.on_released(block)
        else:
            self._put_aside(block, protection)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        self._events += 1
        if was_evictable and block in self._aside_key:
            self._take_aside(block)
            self.inner.on_hit(block, False)
        else:
            self.inner.on_hit(block, was_evictable)

    def evict(self) -> int:
        self._events += 1
        if self._pin_deadlines:
            self._prune_pins()
        if self._expiry:
            self._expire()
        inner = self.inner
        if len(inner):
            return inner.evict()
        key, block = self._aside.peekitem(0)
        self._take_aside(block)
        inner.on_released(block)
        victim = inner.evict()
        assert victim == block, f"{inner.name} evicted {victim}, not its only candidate {block}"
        return victim

    def clear(self) -> None:
        self.inner.clear()
        self._aside_key.clear()
        self._aside.clear()
        self._expiry.clear()
        self._expiry_key.clear()

    def __len__(self) -> int:
        return len(self.inner) + len(self._aside_key)

    def __contains__(self, block: int) -> bool:
        return block in self._aside_key or block in self.inner

    def snapshot(self) -> Any:
        return (self.inner.snapshot(), tuple(self._aside.items()), tuple(self._expiry.items()),
                tuple(sorted(self._pins.items(), key=repr)))
