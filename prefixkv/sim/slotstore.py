"""A tiny stand-in for the KV pools: one integer per token slot.

It executes exactly what a real store does with the manager's output (writes
through a slot mapping, block copies from copy-on-write, reads through a block
table), so the lab and the tests can prove that sharing, copy-on-write and
prefix hits keep every sequence's history intact without torch.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

UNWRITTEN = -1


class SlotStore:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots = np.full((num_blocks, block_size), UNWRITTEN, dtype=np.int64)

    def write(self, slot_mapping: np.ndarray, values: Iterable[int]) -> None:
        flat = self.slots.reshape(-1)
        flat[np.asarray(slot_mapping, dtype=np.int64)] = np.fromiter(values, dtype=np.int64)

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.slots[dst] = self.slots[src]

    def gather(self, block_table: Iterable[int], length: int) -> np.ndarray:
        table = np.asarray(list(block_table), dtype=np.int64)
        return self.slots[table].reshape(-1)[:length]
