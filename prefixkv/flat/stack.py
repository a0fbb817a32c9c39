"""The free-uncached blocks of a flat pool: a LIFO stack in an ``array('q')``.

``BlockPool`` keeps them in a list and uses it as one (append, extend, the top ``n`` by a reversed
slice, ``del stack[-n:]``, reset by slice assignment); ``FreeStack`` does all of that at list speed
(the array's own C methods), and a flat pool's compiled batches push and pop int64 arrays as
memory copies, without an int object per block (a host tier hands thousands of blocks back and
takes them again per long prompt).
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator

import numpy as np


class FreeStack:
    __slots__ = ("_a",)

    def __init__(self) -> None:
        self._a = array("q")

    # -- arrays ----------------------------------------------------------------
    def push(self, blocks: np.ndarray) -> None:
        """Push ``blocks`` (int64) in order: the last one ends on top."""
        self._a.frombytes(np.ascontiguousarray(blocks, np.int64).tobytes())

    def pop(self, k: int) -> np.ndarray:
        """The top ``k`` blocks, top first, taken off (the caller checks that there are ``k``)."""
        a = self._a
        n = len(a)
        out = np.frombuffer(a, np.int64)[n - k:n][::-1].copy()     # (the view goes before the resize)
        del a[n - k:]
        return out

    # -- what BlockPool does with its list ----------------------------------------
    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[int]:
        return iter(self._a)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._a[i].tolist()
        return self._a[i]

    def append(self, block: int) -> None:
        self._a.append(block)

    def extend(self, blocks: Iterable[int]) -> None:
        if isinstance(blocks, np.ndarray):
            self.push(blocks)
        else:
            self._a.extend(blocks)

    def __delitem__(self, i) -> None:
        start, stop, step = i.indices(len(self._a)) if isinstance(i, slice) else (None, None, None)
        if step != 1 or stop != len(self._a):
            raise TypeError("a free stack deletes only from the top (del stack[-n:])")
        del self._a[start:]

    def __setitem__(self, i, blocks: Iterable[int]) -> None:
        if not (isinstance(i, slice) and i == slice(None)):
            raise TypeError("a free stack is replaced whole (stack[:] = blocks)")
        self._a = array("q", blocks)

    def clear(self) -> None:
        del self._a[:]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, FreeStack)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"FreeStack({list(self)!r})"
