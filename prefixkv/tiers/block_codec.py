"""One self-describing, checksummed value per block: what a remote tier stores.

A value is a header followed by the block's payload (all layers' K and V, the
layout the fingerprint names). One value per block, written by one ``SET``,
so there is no second key (metadata) that could disagree with the data.

Header, little-endian::

    magic "PKVB" | format version u16 | flags u16 | hash length u8 | dtype bytes u8 | 2 pad
    fingerprint digest 16 | layers u32 | block size u32 | KV heads u32 | head dim u32
    payload length u64 | xxh3-128 of the payload 16 | content length u32
    block hash | parent hash | content (token ids + extra keys, only when verify is on)
    xxh3-64 of every header byte before it

Contract of ``decode``: it returns the payload (a memoryview into ``value``,
no copy) only when every check passes; otherwise a ``Reject`` naming the first
failed check. Checks, in order: the value is long enough for its header; magic
and format version; the header checksum; the fingerprint; the block hash
against the key's; the parent hash against the chain's; the dims and payload
length against the fingerprint's; the value's length against the header's;
the content (when the caller verifies: a value written without content is
refused too); the payload checksum. A value that passes all of them holds the
bytes its writer checksummed, for this block, in this chain, for this model.
"""

from __future__ import annotations

import enum
import struct

import xxhash

from ..errors import InvalidArgument
from .fingerprint import Fingerprint

__all__ = ["MAGIC", "FORMAT_VERSION", "Reject", "encode", "decode", "header_size"]

MAGIC = b"PKVB"
FORMAT_VERSION = 1
_FLAG_CONTENT = 1

_FIXED = struct.Struct("<4sHHBB2x16sIIIIQ16sI")
_CHECK = struct.Struct("<Q")
_xxh3_128 = xxhash.xxh3_128_digest
_xxh3_64 = xxhash.xxh3_64_intdigest


class Reject(str, enum.Enum):
    """Why a stored value was refused (the value is a stable name for stats)."""

    TRUNCATED = "truncated"               # shorter than its own header
    BAD_MAGIC = "bad_magic"               # not a prefixkv block at all
    VERSION = "version"                   # another format version
    HEADER_CHECKSUM = "header_checksum"   # header bytes damaged
    FINGERPRINT = "fingerprint"           # written for another model / layout / seed
    HASH = "hash"                         # header names another block than the key
    PARENT = "parent"                     # block of another chain
    DIMS = "dims"                         # shapes or payload length differ from the fingerprint's
    LENGTH = "length"                     # value length disagrees with the header (cut or padded)
    CONTENT_MISSING = "content_missing"   # verifying, but the writer stored no token ids
    CONTENT = "content"                   # other token ids under the same hash (a collision)
    PAYLOAD_CHECKSUM = "payload_checksum"  # KV bytes damaged


def header_size(fp: Fingerprint, content_len: int = 0) -> int:
    """Bytes before the payload for a block under ``fp`` carrying ``content_len`` content bytes."""
    return _FIXED.size + 2 * fp.hash_size + content_len + _CHECK.size


def value_size(block_bytes: int, block_size: int, hash_size: int = 16) -> int:
    """Bytes a stored block of a token prompt takes (header, its token ids, payload, checksum): what
    a disk or Redis tier's capacity is spent on, per block."""
    return _FIXED.size + 2 * hash_size + 4 * block_size + _CHECK.size + block_bytes


_BYTES = (bytes, bytearray, memoryview)


def _bytes_argument(name: str, value: object, optional: bool = False):
    # Only byte strings: bytes(5) is five zero bytes and bytes([1, 2]) packs ints, so content
    # given as a count or a token list would be stored as other bytes; in decode, a str or an int
    # never equals the stored bytes, so every value would be refused (and the store deletes them).
    if optional and value is None:
        return value
    if not isinstance(value, _BYTES):
        raise InvalidArgument(name, f"expected bytes{' or None' if optional else ''}, got {type(value).__name__}")
    return value


def _buffer_argument(name: str, value: object) -> memoryview:
    try:
        return memoryview(value).cast("B")
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(name, f"expected a contiguous buffer: {exc}") from None


def encode(fp: Fingerprint, block_hash: bytes, parent_hash: bytes, payload, content: bytes | None = None) -> bytes:
    """Header + payload as one ``bytes`` (one copy of the payload). Refuses wrong sizes and types
    (``InvalidArgument`` naming the argument)."""
    size = fp.hash_size
    for name, value in (("block_hash", block_hash), ("parent_hash", parent_hash)):
        if len(_bytes_argument(name, value)) != size:
            raise InvalidArgument(name, f"block and parent hashes must be {size} bytes ({fp.hash_algorithm}), "
                                        f"got {len(value)}")
    payload = _buffer_argument("payload", payload)
    if payload.nbytes != fp.block_bytes:
        raise InvalidArgument("payload", f"payload is {payload.nbytes} bytes but a block under this fingerprint "
                                         f"is {fp.block_bytes}")
    content = b"" if _bytes_argument("content", content, optional=True) is None else bytes(content)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, _FLAG_CONTENT if content else 0, size, fp.dtype_bytes,
                        fp.digest, fp.layers, fp.block_size, fp.kv_heads, fp.head_dim, payload.nbytes,
                        _xxh3_128(payload), len(content))
    head = fixed + bytes(block_hash) + bytes(parent_hash) + content
    return b"".join((head, _CHECK.pack(_xxh3_64(head)), payload))


def decode(value, fp: Fingerprint, block_hash: bytes, parent_hash: bytes,
           content: bytes | None = None) -> memoryview | Reject:
    """The verified payload of ``value`` stored under ``block_hash``, or why it is refused.

    ``content`` is the block's token ids (+ extra keys) when the caller verifies;
    None skips that check (the hash chain alone identifies the block). Arguments of the wrong
    type raise ``InvalidArgument``: a caller's mistake is not a damaged value.
    """
    _bytes_argument("block_hash", block_hash)
    _bytes_argument("parent_hash", parent_hash)
    _bytes_argument("content", content, optional=True)
    view = _buffer_argument("value", value)
    total = view.nbytes
    if total < _FIXED.size:
        return Reject.TRUNCATED
    (magic, version, flags, hash_len, dtype_bytes, digest, layers, block_size, kv_heads, head_dim,
     payload_len, payload_sum, content_len) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        return Reject.BAD_MAGIC
    if version != FORMAT_VERSION:
        return Reject.VERSION
    check_at = _FIXED.size + 2 * hash_len + content_len
    if total < check_at + _CHECK.size:
        return Reject.TRUNCATED
    if _CHECK.unpack_from(view, check_at)[0] != _xxh3_64(view[:check_at]):
        return Reject.HEADER_CHECKSUM
    if digest != fp.digest:
        return Reject.FINGERPRINT
    at = _FIXED.size
    if hash_len != fp.hash_size or view[at:at + hash_len] != block_hash:
        return Reject.HASH
    at += hash_len
    if view[at:at + hash_len] != parent_hash:
        return Reject.PARENT
    at += hash_len
    if ((layers, block_size, kv_heads, head_dim, dtype_bytes) !=
            (fp.layers, fp.block_size, fp.kv_heads, fp.head_dim, fp.dtype_bytes) or payload_len != fp.block_bytes):
        return Reject.DIMS
    start = check_at + _CHECK.size
    if total != start + payload_len:
        return Reject.LENGTH
    if content is not None:
        if not flags & _FLAG_CONTENT:
            return Reject.CONTENT_MISSING
        if view[at:at + content_len] != content:
            return Reject.CONTENT
    payload = view[start:]
    if _xxh3_128(payload) != payload_sum:
        return Reject.PAYLOAD_CHECKSUM
    return payload
