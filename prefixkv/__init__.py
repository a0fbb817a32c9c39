"""prefixkv: a prefix-caching, paged KV-cache store for LLM inference.

The core (manager, pool, policies, sizing) needs only numpy, xxhash and
sortedcontainers, and imports no other part: numba (the flat index, ``prefixkv.flat``), the
trace lab (``prefixkv.sim``), the tiers, torch and cupy load only where they are used.
"""

from .errors import (CacheBusy, DuplicateSequence, HashMismatch, InvalidArgument, InvalidTokens, InvariantViolation,
                     NoHostBlocks, OutOfBlocks, PolicyError, PrefixKVError, SequencePreempted, SequenceTooLong,
                     UnknownSequence)
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .hashing import BlockHasher, ExtraKeys, MultiModalItem
from .manager import KVCacheManager, PrefixMatch
from .policies.base import SessionHint
from .pool import BlockPool
from .prompt import Prompt
from .sizing import KVSpec, Plan, format_size, parse_size, plan, tail_waste
from .stats import CacheStats

__version__ = "0.1.0"

__all__ = [
    "KVCacheManager", "PrefixMatch", "Prompt", "BlockPool", "BlockHasher", "ExtraKeys", "MultiModalItem",
    "KVSpec", "Plan", "plan", "tail_waste", "parse_size", "format_size", "CacheStats",
    "KVEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    "PrefixKVError", "PolicyError", "OutOfBlocks", "SequenceTooLong", "UnknownSequence", "SequencePreempted", "DuplicateSequence",
    "InvalidTokens", "CacheBusy", "InvariantViolation", "HashMismatch", "InvalidArgument", "NoHostBlocks",
    "SessionHint",
]
