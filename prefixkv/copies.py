"""Block copies between tiers, as the manager hands them out (``take_demotions``, ``take_loads``).

A batch of ``(source block, destination block)`` pairs kept as two int64 arrays: an admission that
loads a long prompt from the host tier records thousands of pairs, and building a tuple per pair
cost as much as the rest of its bookkeeping. It reads as the list of pairs it stands for (length,
indexing, iteration, equality with a list of tuples); a KV store takes ``src`` / ``dst`` as they are.
"""

from __future__ import annotations

from array import array
from typing import Iterator, Sequence

import numpy as np

_EMPTY = np.empty(0, np.int64)


def _column(blocks, what: str) -> np.ndarray:
    """``blocks`` as a one-dimensional int64 array the caller does not hold (a copy of an array:
    changing the caller's array later must not change pairs already handed out). Refuses floats,
    bools and ids past int64, as the list form does, naming ``what`` and the value."""
    if not isinstance(blocks, np.ndarray):
        if hasattr(blocks, "__array__") and not isinstance(blocks, (list, tuple)):
            blocks = np.asarray(blocks)            # a torch tensor (CPU), an array-like
        else:
            if not isinstance(blocks, (list, tuple, range)):
                blocks = list(blocks)              # a generator, any iterable
            if not blocks:
                return _EMPTY
            try:
                return np.frombuffer(array("q", blocks), np.int64)
            except (TypeError, OverflowError):
                pass
            for block in blocks:
                try:
                    array("q", [block])
                except (TypeError, OverflowError):
                    raise TypeError(f"BlockCopies {what} must hold int64 block ids, got {block!r}") from None
            raise TypeError(f"BlockCopies {what} must hold int64 block ids")   # pragma: no cover
    if blocks.ndim != 1:
        raise ValueError(f"BlockCopies {what} must be one-dimensional, got an array of shape {blocks.shape}")
    if not blocks.shape[0]:
        return _EMPTY                              # np.array([]) is float64: no ids, nothing to refuse
    if blocks.dtype.kind not in "iu":
        raise TypeError(f"BlockCopies {what} must hold integer block ids, got {blocks.dtype}")
    if blocks.dtype.kind == "u" and int(blocks.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"BlockCopies {what} holds {int(blocks.max())}, past int64")
    return np.array(blocks, dtype=np.int64)


class BlockCopies(Sequence):
    """``(src[i], dst[i])`` pairs, in the order they must run."""

    __slots__ = ("src", "dst")

    def __init__(self, src=(), dst=()) -> None:
        self.src = _column(src, "src")
        self.dst = _column(dst, "dst")
        if self.src.shape[0] != self.dst.shape[0]:
            raise ValueError(f"{self.src.shape[0]} sources for {self.dst.shape[0]} destinations")

    @classmethod
    def join(cls, parts: Sequence[BlockCopies]) -> BlockCopies:
        """The pairs of ``parts``, one after another: a new ``BlockCopies`` with arrays of its own
        (one part too: changing the result must not change a part, as with lists)."""
        if not parts:
            return cls()
        out = cls.__new__(cls)
        out.src = np.concatenate([p.src for p in parts])
        out.dst = np.concatenate([p.dst for p in parts])
        return out

    def __len__(self) -> int:
        return self.src.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            # copies, not numpy views: a slice of a list does not share its items' storage either
            out = BlockCopies.__new__(BlockCopies)
            out.src, out.dst = self.src[i].copy(), self.dst[i].copy()
            return out
        return int(self.src[i]), int(self.dst[i])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.src.tolist(), self.dst.tolist())

    def tolist(self) -> list[tuple[int, int]]:
        """The pairs as a list of tuples (what ``json.dumps`` takes: ``BlockCopies`` is a sequence,
        not a list)."""
        return list(self)

    def __add__(self, other):
        """``copies + pairs``: a list of the pairs, one after the other (as lists concatenate);
        ``BlockCopies + BlockCopies`` stays a ``BlockCopies``."""
        if isinstance(other, BlockCopies):
            return BlockCopies.join([self, other])
        if isinstance(other, (list, tuple)):
            return list(self) + list(other)
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, (list, tuple)):
            return list(other) + list(self)
        return NotImplemented

    def __eq__(self, other) -> bool:
        """Equal to a list or tuple of the same pairs (the list it stands for), or to equal copies."""
        if isinstance(other, BlockCopies):
            return bool(np.array_equal(self.src, other.src) and np.array_equal(self.dst, other.dst))
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None       # stands for a list: not hashable

    def __repr__(self) -> str:
        return f"BlockCopies({list(self)!r})"
