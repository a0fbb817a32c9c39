"""A tiny stand-in for the KV pools: one integer per token slot.

It executes exactly what a real store does with the manager's output (writes
through a slot mapping, block copies from copy-on-write, reads through a block
table), so the lab and the tests can prove that sharing, copy-on-write and
prefix hits keep every sequence's history intact without torch.
"""

from __future__ import annotations

from numbers import Integral
from typing import Iterable

import numpy as np

from ..errors import InvalidArgument

UNWRITTEN = -1


class SlotStore:
    """Writes, copies and reads are checked as a real store's kernels would fault: a slot or
    block outside the pool (negative ones included: numpy would wrap them to the pool's end), a
    write with more or fewer values than slots (numpy would broadcast one value), a read past the
    blocks of its table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value, least in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
                raise InvalidArgument(name, f"must be an integer >= {least}, got {value!r}")
        self.block_size = block_size
        self.slots = np.full((num_blocks, block_size), UNWRITTEN, dtype=np.int64)

    def _in_range(self, index: np.ndarray, limit: int, what: str) -> np.ndarray:
        if index.size and (index.min() < 0 or index.max() >= limit):
            bad = index[(index < 0) | (index >= limit)][0]
            raise IndexError(f"{what} {int(bad)} is outside the store (0..{limit - 1})")
        return index

    def write(self, slot_mapping: np.ndarray, values: Iterable[int]) -> None:
        flat = self.slots.reshape(-1)
        mapping = self._in_range(np.asarray(slot_mapping, dtype=np.int64).reshape(-1), flat.size, "slot")
        data = np.fromiter(values, dtype=np.int64)
        if data.size != mapping.size:
            raise ValueError(f"a write to {mapping.size} slots got {data.size} value(s)")
        flat[mapping] = data

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        """Run the copies in order (a later one may read an earlier one's destination); a batch
        with any pair outside the store copies nothing."""
        pairs = [(src, dst) for src, dst in copies]
        self._in_range(np.asarray(pairs, dtype=np.int64).reshape(-1), self.slots.shape[0], "block")
        for src, dst in pairs:
            self.slots[dst] = self.slots[src]

    def gather(self, block_table: Iterable[int], length: int) -> np.ndarray:
        table = self._in_range(np.asarray(list(block_table), dtype=np.int64), self.slots.shape[0], "block")
        if not 0 <= length <= table.size * self.block_size:
            raise ValueError(f"a read of {length} tokens through {table.size} block(s) "
                             f"({table.size * self.block_size} slots)")
        return self.slots[table].reshape(-1)[:length]
