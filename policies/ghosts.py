"""A bounded FIFO of evicted hashes (a ghost list), shared by the policies that remember them.

Two paged-cache details live here so every policy gets them the same way:

* the *pushed-out* entry: a cache simulator looks a missed key up in its ghost list before it
  evicts to make room, while a pool evicts first and publishes the missed block after. The
  eviction can push the very hash that is coming back out of a full ghost list; ``take``
  still finds it when it is the one the latest ``add`` pushed out, so both orders give the
  same answer (and the same list afterwards);
* ``undo``: a duplicate that takes over the hash of a primary just evicted (the pool's
  promotion, ``policies/base.py``) is no return from the ghost list; the ghost that eviction
  added is taken back and the entry it pushed out restored, oldest.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable

_MISSING = object()


class GhostList:
    """At most ``limit`` hashes with a value each (``None`` when only membership matters), oldest first."""

    __slots__ = ("limit", "_entries", "_pushed_out")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict = OrderedDict()
        self._pushed_out: tuple | None = None   # (hash, value) the latest add pushed out, until the next take

    def add(self, block_hash: Hashable, value: Any = None) -> None:
        entries = self._entries
        entries[block_hash] = value
        entries.move_to_end(block_hash)
        self._pushed_out = entries.popitem(last=False) if len(entries) > self.limit else None

    def take(self, block_hash: Hashable, default: Any = _MISSING) -> Any:
        """Remove ``block_hash`` and return its value (``default`` when it is no ghost; with no
        default, a bool says whether it was one)."""
        pushed, self._pushed_out = self._pushed_out, None
        entries = self._entries
        value = entries.pop(block_hash, _MISSING)
        if pushed is not None:
            if value is _MISSING:
                if pushed[0] == block_hash:
                    value = pushed[1]
            else:   # looked up first, the list would have had room: the pushed-out entry stays
                entries[pushed[0]] = pushed[1]
                entries.move_to_end(pushed[0], last=False)
        if default is _MISSING:
            return value is not _MISSING
        return default if value is _MISSING else value

    def undo(self, block_hash: Hashable) -> None:
        """Take back the latest ``add`` of ``block_hash`` (a duplicate took the hash over)."""
        pushed, self._pushed_out = self._pushed_out, None
        self._entries.pop(block_hash, None)
        if pushed is not None:
            self._entries[pushed[0]] = pushed[1]
            self._entries.move_to_end(pushed[0], last=False)

    def trim(self, limit: int) -> None:
        """Drop the oldest entries until at most ``limit`` remain (a policy whose bound moves)."""
        entries = self._entries
        while len(entries) > limit:
            entries.popitem(last=False)

    def pop_oldest(self) -> None:
        self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
        self._pushed_out = None

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self) -> tuple:
        return tuple(self._entries.items())
