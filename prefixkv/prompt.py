"""A prompt prepared for the prefix cache: encoded tokens and their block hashes.

Preparing once lets ``match`` (the question) and ``admit`` (the action) share
the hashing work. A prompt is tied to the hasher (block size, seed, algorithm)
that made it.
"""

from __future__ import annotations

from array import array
from typing import Hashable

from .hashing import NO_EXTRA_KEYS, BlockHasher, ExtraKeys


class Prompt:
    __slots__ = ("tokens", "num_tokens", "extra", "hasher", "_hashes", "keys")

    def __init__(self, hasher: BlockHasher, tokens: array | None, num_tokens: int,
                 extra: ExtraKeys = NO_EXTRA_KEYS, hashes: list[Hashable] | None = None) -> None:
        self.hasher = hasher
        self.tokens = tokens
        self.num_tokens = num_tokens
        self.extra = extra
        self._hashes = hashes
        # The block hashes as a pool with a flat index probes them (their digests joined into rows,
        # ``prefixkv.flat.HashRows``), made by the first manager that looks the prompt up and kept:
        # ``match`` and ``admit`` and each tier below share one join.
        self.keys = None

    @property
    def has_tokens(self) -> bool:
        return self.tokens is not None

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.hasher.block_size

    def block_hashes(self) -> list[Hashable]:
        """Hashes of the prompt's full blocks (computed once, then kept)."""
        hashes = self._hashes
        if hashes is None:
            hashes = self.hasher.hash_blocks(self.tokens, 0, self.num_full_blocks, None, self.extra)
            self._hashes = hashes
        return hashes

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        kind = "tokens" if self.tokens is not None else "precomputed hashes"
        return f"Prompt({self.num_tokens} tokens, {kind}, {self.num_full_blocks} full blocks)"
