"""KV cache events for external routers (which worker holds which prefix).

Events are buffered in order and drained by the caller. ``BlockStored`` is
emitted when a hash enters the prefix cache, always after its parent's (the
parent is held by the same sequence at that moment); ``BlockRemoved`` only when
the last physical copy of a hash leaves; ``AllBlocksCleared`` on a reset.

Every event names its tier (``medium``, as vLLM's events do): ``None`` for the
device pool, ``"CPU"`` for the host tier. A demotion is a ``BlockRemoved`` from
the device and a ``BlockStored`` on the host; a hash has left the cache when it
has been removed from every tier that stored it.
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
    medium: str | None = None     # the tier: None for the device pool, "CPU" for the host tier
    token_ids: tuple[int, ...] | None = None   # the block's tokens (None: hashed traces, demotions)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: Hashable
    block_id: int
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
