"""The free-uncached blocks of a flat pool: a LIFO stack in an int64 array.

``BlockPool`` keeps them in a list and uses it as one (append, extend, the top ``n`` by a reversed
slice, ``del stack[-n:]``, reset by slice assignment); ``FreeStack`` does all of that, and a flat
pool's compiled batches push and pop int64 arrays without making an int object per block (a host
tier hands thousands of blocks back and takes them again per long prompt).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from .index import as_block_array


class FreeStack:
    __slots__ = ("_buf", "_n")

    def __init__(self) -> None:
        self._buf = np.empty(1024, np.int64)
        self._n = 0

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need > self._buf.shape[0]:
            buf = np.empty(max(need, 2 * self._buf.shape[0]), np.int64)
            buf[:self._n] = self._buf[:self._n]
            self._buf = buf

    # -- arrays ----------------------------------------------------------------
    def push(self, blocks: np.ndarray) -> None:
        """Push ``blocks`` in order (the last one is on top)."""
        k = blocks.shape[0]
        self._reserve(k)
        self._buf[self._n:self._n + k] = blocks
        self._n += k

    def pop(self, k: int) -> np.ndarray:
        """The top ``k`` blocks, top first, taken off (the caller checks that there are ``k``)."""
        n = self._n
        out = self._buf[n - k:n][::-1].copy()
        self._n = n - k
        return out

    # -- what BlockPool does with its list ----------------------------------------
    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(self._buf[:self._n].tolist())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._buf[:self._n][i].tolist()
        if not -self._n <= i < self._n:
            raise IndexError("free stack index out of range")
        return int(self._buf[i % self._n])

    def append(self, block: int) -> None:
        self._reserve(1)
        self._buf[self._n] = block
        self._n += 1

    def extend(self, blocks: Iterable[int]) -> None:
        if not isinstance(blocks, (list, np.ndarray)):
            blocks = list(blocks)
        self.push(as_block_array(blocks))

    def __delitem__(self, i) -> None:
        start, stop, step = i.indices(self._n) if isinstance(i, slice) else (None, None, None)
        if step != 1 or stop != self._n:
            raise TypeError("a free stack deletes only from the top (del stack[-n:])")
        self._n = min(start, self._n)

    def __setitem__(self, i, blocks: Iterable[int]) -> None:
        if not (isinstance(i, slice) and i == slice(None)):
            raise TypeError("a free stack is replaced whole (stack[:] = blocks)")
        self._n = 0
        self.extend(blocks)

    def clear(self) -> None:
        self._n = 0

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, FreeStack)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"FreeStack({list(self)!r})"
