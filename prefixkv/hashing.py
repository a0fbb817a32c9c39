"""Chained content hashes for full blocks.

A full block's hash covers its parent's hash, its token ids encoded as
little-endian uint32 (the same bytes on every platform) and the request's extra
keys. Extra keys are tagged by their source, so a LoRA adapter named like a
tenant salt can never produce the same bytes as that salt.

The chain's root comes from a seed: random per process unless pinned, so hashes
cannot be predicted across processes by default, and agree when a deployment
pins the seed (reproducible runs, several workers behind one router).
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import xxhash

from .errors import HashMismatch, InvalidArgument, InvalidTokens

# 4-byte unsigned integer array typecode on this platform ("I" almost everywhere).
TOKEN_TYPECODE = next(code for code in "ILH" if array(code).itemsize == 4)
TOKEN_BYTES = 4
_BIG_ENDIAN = sys.byteorder == "big"

# Drawn once at import and never reassigned: the default root for this process.
_PROCESS_SEED = int.from_bytes(os.urandom(8), "little")

HASH_ALGORITHMS = {
    "xxh3_128": (xxhash.xxh3_128_digest, 16),
    "xxh3_64": (xxhash.xxh3_64_digest, 8),
}

# Source tags for extra keys. Never renumber: they are part of every hash.
_TAG_SALT = 1
_TAG_ADAPTER = 2
_TAG_MULTIMODAL = 3


def encode_tokens(tokens: Iterable[int] | array, argument: str = "tokens") -> array:
    """Token ids as a uint32 array (copied), rejecting values that do not fit.

    Accepts a list/tuple of ints, an ``array``, a numpy array or anything
    iterable of ints. numpy arrays of any integer dtype are range-checked.
    Refused with ``InvalidTokens`` naming ``argument``: a mapping, set, string or
    bytes (not a token sequence), booleans (``True`` is not token 1), non-integers
    and ids outside ``[0, 2**32)``.
    """
    if type(tokens) is list:         # the common case: straight to the conversion below
        pass
    elif isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:
        return array(TOKEN_TYPECODE, tokens)
    elif hasattr(tokens, "dtype") and hasattr(tokens, "tobytes"):
        return _encode_ndarray(tokens, argument)
    elif isinstance(tokens, (str, bytes, bytearray, memoryview, dict, set, frozenset)) or hasattr(tokens, "keys"):
        raise InvalidTokens(f"{argument}: a {type(tokens).__name__} is not a sequence of token ids; "
                            "pass a list of ints (or a Prompt)")
    elif not isinstance(tokens, (list, tuple)):
        try:
            tokens = list(tokens)    # iterated twice below (a generator would be spent)
        except TypeError:
            raise InvalidTokens(f"{argument}: expected a sequence of token ids, got "
                                f"{type(tokens).__name__}") from None
    try:
        out = array(TOKEN_TYPECODE, tokens)
    except OverflowError as exc:
        bad = next((t for t in tokens if not 0 <= t < 2**32), None)
        raise InvalidTokens(f"{argument}: token id {bad!r} is outside [0, 2**32)") from exc
    except TypeError as exc:
        bad = next((t for t in tokens if not isinstance(t, int)), None)
        raise InvalidTokens(f"{argument}: token ids must be integers, got {type(bad).__name__} {bad!r}") from exc
    # array() takes True as 1. A bool can only sit where the encoded id is 0 or 1, so only
    # those positions are looked at: numpy finds them at C speed (a type check of every
    # element, ``bool in set(map(type, tokens))``, cost 18 ns per token, 590 us per 32k).
    if len(out) < _SCAN_WITH_NUMPY:
        suspects = (i for i, t in enumerate(out) if t < 2)
    else:
        suspects = np.flatnonzero(np.frombuffer(out, dtype=np.uint32) < 2).tolist()
    for i in suspects:
        if type(tokens[i]) is bool:
            raise InvalidTokens(f"{argument}: token {i} is a bool ({tokens[i]!r}), not a token id")
    return out


# Below this many tokens a Python scan of the encoded ids beats numpy's fixed cost.
_SCAN_WITH_NUMPY = 64


def _encode_ndarray(values, argument: str = "tokens") -> array:
    values = np.asarray(values)
    if values.ndim != 1:
        raise InvalidTokens(f"{argument}: token ids must be one-dimensional, got shape {values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise InvalidTokens(f"{argument}: token ids must be integers, got dtype {values.dtype}")
    if values.size and (int(values.min()) < 0 or int(values.max()) >= 2**32):
        bad = int(values.min()) if int(values.min()) < 0 else int(values.max())
        raise InvalidTokens(f"{argument}: token id {bad} is outside [0, 2**32)")
    out = array(TOKEN_TYPECODE)
    out.frombytes(values.astype(np.uint32).tobytes())
    return out


def token_bytes(tokens: array, start: int, stop: int) -> bytes:
    """Little-endian bytes of ``tokens[start:stop]``."""
    if not _BIG_ENDIAN and start == 0 and stop >= len(tokens):
        return tokens.tobytes()          # one copy instead of two
    chunk = tokens[start:stop]
    if _BIG_ENDIAN:
        chunk.byteswap()
    return chunk.tobytes()


def _tagged(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BI", tag, len(payload)) + payload


# A multimodal item's offset in a block is hashed as "<q".
_MAX_POSITION = 2**63 - 1
# The block size is hashed into the chain's root as "<I".
_MAX_BLOCK_SIZE = 2**32 - 1


def _check_key(argument: str, value: object) -> None:
    """Refuse an extra-key value ``_typed`` cannot encode (``InvalidArgument`` naming ``argument``)."""
    if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
        raise InvalidArgument(argument, f"extra key values must be str, bytes or int, got "
                                        f"{type(value).__name__} {value!r:.60}")


def _typed(value: str | bytes | int) -> bytes:
    # ExtraKeys and MultiModalItem refuse such values when made; this guards the encoding itself.
    # InvalidArgument is the TypeError these raised before they named the argument.
    if isinstance(value, bool):
        raise InvalidArgument("extra", "extra key values must be str, bytes or int, not bool")
    if isinstance(value, str):
        return b"s" + value.encode("utf-8")
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, int):
        return b"i" + value.to_bytes((value.bit_length() + 8) // 8 + 1, "little", signed=True)
    raise InvalidArgument("extra", f"extra key values must be str, bytes or int, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input (image, audio clip) occupying token positions
    ``[start, start + length)`` of a sequence. Blocks that overlap it hash the
    item's identifier and its offset relative to the block start."""

    identifier: str | bytes | int
    start: int
    length: int

    def __post_init__(self) -> None:
        # Checked here, not when a block is first hashed: a float start, a bool or a float
        # identifier used to pass and then fail in match/admit (or, for a bool, hash as an int).
        _check_key("identifier", self.identifier)
        for name in ("start", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidArgument(name, f"a multimodal item's {name} must be an int, got "
                                            f"{type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))
        # InvalidArgument is the ValueError these raised before they named the field
        if self.start < 0:
            raise InvalidArgument("start", f"a multimodal item needs start >= 0, got {self}")
        if self.length <= 0:
            raise InvalidArgument("length", f"a multimodal item needs length > 0, got {self}")
        if self.start + self.length > _MAX_POSITION:
            raise InvalidArgument("start", f"a multimodal item must end by position 2**63 - 1 (its offset in a "
                                           f"block is hashed as a signed 64-bit int), got {self}")


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides token ids that decides whether two blocks hold the same KV.

    ``salt`` isolates tenants (a salted request never shares with another salt
    or with unsalted requests); ``adapter`` is the LoRA/adapter id the KV was
    computed under; ``multimodal`` lists items whose content is not in the ids.
    """

    salt: str | bytes | int | None = None
    adapter: str | bytes | int | None = None
    multimodal: tuple[MultiModalItem, ...] = ()

    def __post_init__(self) -> None:
        # Checked when made (a salt of 1.5 was taken by ``mgr.prompt`` and failed in ``match``); the
        # items are kept as a tuple, so a caller's list changed afterwards changes nothing here.
        for name in ("salt", "adapter"):
            value = getattr(self, name)
            if value is not None:
                _check_key(name, value)
        items = self.multimodal
        if type(items) is not tuple:
            if isinstance(items, (MultiModalItem, str, bytes)) or not hasattr(items, "__iter__"):
                raise InvalidArgument("multimodal", f"expected a sequence of MultiModalItem, got "
                                                    f"{type(items).__name__}")
            items = tuple(items)
            object.__setattr__(self, "multimodal", items)
        for i, item in enumerate(items):
            if not isinstance(item, MultiModalItem):
                raise InvalidArgument("multimodal", f"item {i} is a {type(item).__name__}, not a MultiModalItem")
        if len(items) > 1:
            # Two inputs cannot occupy one token position (an item listed twice, a wrong offset).
            ordered = sorted(items, key=lambda item: item.start)
            for before, after in zip(ordered, ordered[1:]):
                if after.start < before.start + before.length:
                    raise InvalidArgument("multimodal", f"items overlap: {before} and {after}")
            # one canonical order (by position), so the same items listed otherwise hash alike
            object.__setattr__(self, "multimodal", tuple(ordered))

    def is_empty(self) -> bool:
        return self.salt is None and self.adapter is None and not self.multimodal

    def static_suffix(self) -> bytes:
        """Bytes appended to every block's hash input (salt and adapter)."""
        out = b""
        if self.salt is not None:
            out += _tagged(_TAG_SALT, _typed(self.salt))
        if self.adapter is not None:
            out += _tagged(_TAG_ADAPTER, _typed(self.adapter))
        return out

    def block_suffix(self, block_index: int, block_size: int) -> bytes:
        """Bytes for multimodal items overlapping block ``block_index``."""
        lo = block_index * block_size
        hi = lo + block_size
        out = b""
        for item in self.multimodal:
            if item.start < hi and item.start + item.length > lo:
                # the item's length too: one id at two lengths covers other positions with its
                # embedding, so the blocks' KV differ (a collision while only the start was hashed)
                payload = _typed(item.identifier) + struct.pack("<qQ", item.start - lo, item.length)
                out += _tagged(_TAG_MULTIMODAL, payload)
        return out


NO_EXTRA_KEYS = ExtraKeys()


class BlockHasher:
    """Computes chained block hashes for one block size, algorithm and seed."""

    __slots__ = ("block_size", "algorithm", "seed", "digest_size", "root", "_digest")

    def __init__(self, block_size: int, seed: int | None = None, algorithm: str = "xxh3_128") -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
            raise InvalidArgument("block_size", f"must be an int, got {type(block_size).__name__} {block_size!r}")
        block_size = int(block_size)
        if block_size <= 0:
            # InvalidArgument is a ValueError, as this error was before it named the argument
            raise InvalidArgument("block_size", f"must be positive, got {block_size}")
        if block_size > _MAX_BLOCK_SIZE:
            # the root hashes it as a little-endian uint32 ("<I"): past that, struct.error
            raise InvalidArgument("block_size", f"must be below 2**32 (the chain's root hashes it as a "
                                                f"uint32), got {block_size}")
        # numpy integers are ints here as for block_size (and in the manager): the same digests
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
            raise InvalidArgument("seed", f"the hash seed must be an int or None, got {type(seed).__name__} {seed!r}")
        if not isinstance(algorithm, str) or algorithm not in HASH_ALGORITHMS:   # a list is unhashable
            raise InvalidArgument("algorithm", f"unknown hash algorithm {algorithm!r}; choose from "
                                               f"{sorted(HASH_ALGORITHMS)}")
        self.block_size = block_size
        self.algorithm = algorithm
        self.seed = _PROCESS_SEED if seed is None else int(seed)
        self._digest, self.digest_size = HASH_ALGORITHMS[algorithm]
        seed_bytes = (self.seed % 2**128).to_bytes(16, "little")
        self.root = self._digest(b"prefixkv/root/v1" + seed_bytes + struct.pack("<I", block_size))

    def hash_blocks(
        self,
        tokens: array,
        first_block: int,
        stop_block: int,
        parent: bytes | None,
        extra: ExtraKeys = NO_EXTRA_KEYS,
    ) -> list[bytes]:
        """Hashes of full blocks ``first_block .. stop_block-1`` of ``tokens``.

        ``parent`` is the hash of block ``first_block - 1`` (None for the root).
        Only these blocks are hashed: callers keep earlier hashes, so appending
        tokens hashes just the blocks that became full.
        """
        size = self.block_size
        if not 0 <= first_block <= stop_block or stop_block * size > len(tokens):
            # Else the tokens past the last full block (or none) were hashed as a full block.
            raise InvalidArgument("first_block" if not 0 <= first_block <= stop_block else "stop_block",
                                  f"blocks {first_block}..{stop_block - 1} are not full blocks of "
                                  f"{len(tokens)} tokens at block size {size}")
        width = size * TOKEN_BYTES
        digest = self._digest
        prev = self.root if parent is None else parent
        start = first_block * size
        buf = token_bytes(tokens, start, stop_block * size)
        out: list[bytes] = []
        append = out.append
        if extra.multimodal:
            suffix = extra.static_suffix()
            for i in range(stop_block - first_block):
                data = buf[i * width:(i + 1) * width] + suffix + extra.block_suffix(first_block + i, size)
                prev = digest(prev + data)
                append(prev)
        elif extra.salt is not None or extra.adapter is not None:
            suffix = extra.static_suffix()
            for offset in range(0, len(buf), width):
                prev = digest(prev + buf[offset:offset + width] + suffix)
                append(prev)
        else:
            for offset in range(0, len(buf), width):
                prev = digest(prev + buf[offset:offset + width])
                append(prev)
        return out

    def block_content(self, tokens: array, block_index: int, extra: ExtraKeys = NO_EXTRA_KEYS) -> bytes:
        """What verification mode stores per cached block: tokens plus extra keys."""
        size = self.block_size
        data = token_bytes(tokens, block_index * size, (block_index + 1) * size)
        if not extra.is_empty():
            data += extra.static_suffix() + extra.block_suffix(block_index, size)
        return data


_PLAIN_HASH_TYPES = frozenset((int, bytes))


def repeated_hash(hashes: list) -> str | None:
    """What is wrong if ``hashes`` (hashable) holds one value twice, else None. A prefix chain never
    does (each hash covers its whole prefix), and the pool counts a prefix match's blocks as
    distinct: a repeat would hold one block twice on one reference."""
    if len(set(hashes)) == len(hashes):
        return None
    first: dict = {}
    for i, h in enumerate(hashes):
        j = first.setdefault(h, i)
        if j != i:
            return f"block hash {i} ({h!r}) repeats block hash {j}: a prefix chain never holds one hash twice"
    return None


def as_hash_list(block_hashes: Sequence[object]) -> list[object]:
    """Precomputed hashes as a list, rejecting unhashable or None entries and repeats
    (``HashMismatch``)."""
    out = list(block_hashes)
    # Fast accept at C speed: ints (trace hash ids) and bytes (digests) are hashable and not None,
    # and their types are told without touching their values. Anything else is checked as a set
    # (C speed), and only a bad entry is looked for one by one.
    if set(map(type, out)) <= _PLAIN_HASH_TYPES:
        return _no_repeats(out)
    try:
        if None not in set(out):
            return _no_repeats(out)
    except TypeError:
        pass
    for i, h in enumerate(out):
        # InvalidArgument is the ValueError these raised before they named the argument
        if h is None:
            raise InvalidArgument("block_hashes", f"block hash {i} is None")
        try:
            hash(h)
        except TypeError as exc:
            raise InvalidArgument("block_hashes", f"block hash {i} ({type(h).__name__}) is not hashable") from exc
    return _no_repeats(out)


def _no_repeats(hashes: list) -> list:
    problem = repeated_hash(hashes)
    if problem is not None:
        raise HashMismatch(problem)
    return hashes
