"""KV cache events for external routers (which worker holds which prefix).

Events are buffered in order and drained by the caller. ``BlockStored`` is
emitted when a hash enters the prefix cache, always after its parent's (the
parent is held by the same sequence at that moment); ``BlockRemoved`` only when
the last physical copy of a hash leaves; ``AllBlocksCleared`` on a reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Union

from .hashing import ExtraKeys


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: Hashable
    parent_hash: Hashable | None  # None: the block starts a chain
    token_count: int
    extra_keys: ExtraKeys | None
    block_id: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: Hashable
    block_id: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
