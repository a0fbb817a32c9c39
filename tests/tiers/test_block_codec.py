"""One self-describing value per block: every damaged or foreign value is refused with its reason;
arguments of the wrong type (content, hashes, payload, value) are InvalidArgument naming them,
before anything is encoded or any stored value is judged."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.hashing import BlockHasher, encode_tokens
from prefixkv.tiers.block_codec import FORMAT_VERSION, MAGIC, Reject, decode, encode, header_size
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

FP = Fingerprint(weights_digest([("w", np.arange(4, dtype=np.float32))]), "float16", 2, 2, 8, 4, hash_seed=7)
OTHER_FP = Fingerprint(weights_digest([("w", np.arange(4, dtype=np.float32) + 1)]), "float16", 2, 2, 8, 4,
                       hash_seed=7)
HASHER = BlockHasher(4, seed=7)
TOKENS = encode_tokens(range(100, 112))
CHAIN = HASHER.hash_blocks(TOKENS, 0, 3, None)
CONTENT = [HASHER.block_content(TOKENS, i) for i in range(3)]
PAYLOADS = [os.urandom(FP.block_bytes) for _ in range(3)]


def value(i, fp=FP, content=True, payload=None):
    parent = CHAIN[i - 1] if i else HASHER.root
    return encode(fp, CHAIN[i], parent, PAYLOADS[i] if payload is None else payload, CONTENT[i] if content else None)


def check(v, i, content=True):
    return decode(v, FP, CHAIN[i], CHAIN[i - 1] if i else HASHER.root, CONTENT[i] if content else None)


def test_round_trip_with_and_without_content():
    for i in range(3):
        for with_content in (True, False):
            v = value(i, content=with_content)
            assert v[:4] == MAGIC
            assert len(v) == header_size(FP, len(CONTENT[i]) if with_content else 0) + FP.block_bytes
            out = check(v, i, content=with_content)
            assert isinstance(out, memoryview) and out.tobytes() == PAYLOADS[i]
    # without verification the stored token ids are not needed
    assert check(value(1), 1, content=False).tobytes() == PAYLOADS[1]


def _flip(v: bytes, at: int) -> bytes:
    b = bytearray(v)
    b[at] ^= 0x01
    return bytes(b)


def test_every_single_bit_flip_is_refused():
    v = value(1)
    rng = np.random.default_rng(0)
    for at in list(range(len(v) - FP.block_bytes)) + list(rng.integers(len(v) - FP.block_bytes, len(v), 64)):
        assert isinstance(check(_flip(v, int(at)), 1), Reject), at


@pytest.mark.parametrize("case, reason", [
    ("flipped payload byte", Reject.PAYLOAD_CHECKSUM),
    ("flipped header byte", Reject.HEADER_CHECKSUM),
    ("truncated value", Reject.LENGTH),
    ("truncated into the header", Reject.TRUNCATED),
    ("trailing bytes", Reject.LENGTH),
    ("header of another block", Reject.HASH),
    ("payload of another block", Reject.PAYLOAD_CHECKSUM),
    ("another fingerprint", Reject.FINGERPRINT),
    ("same hash, other tokens", Reject.CONTENT),
    ("written without tokens", Reject.CONTENT_MISSING),
    ("another chain", Reject.PARENT),
    ("not a block", Reject.BAD_MAGIC),
    ("empty", Reject.TRUNCATED),
    ("future version", Reject.VERSION),
])
def test_each_corruption_has_its_reason(case, reason):
    good = value(1)
    head = len(good) - FP.block_bytes
    if case == "flipped payload byte":
        bad = _flip(good, len(good) - 7)
    elif case == "flipped header byte":
        bad = _flip(good, 40)
    elif case == "truncated value":
        bad = good[:-100]
    elif case == "truncated into the header":
        bad = good[:30]
    elif case == "trailing bytes":
        bad = good + b"\0"
    elif case == "header of another block":
        other = value(2)
        bad = other[:len(other) - FP.block_bytes] + good[head:]
    elif case == "payload of another block":
        bad = good[:head] + PAYLOADS[2]
    elif case == "another fingerprint":
        bad = value(1, fp=OTHER_FP)
    elif case == "same hash, other tokens":
        # the collision case: a writer whose different tokens hashed to the same chained hash
        bad = encode(FP, CHAIN[1], CHAIN[0], PAYLOADS[1], HASHER.block_content(encode_tokens(range(4)), 0))
    elif case == "written without tokens":
        bad = value(1, content=False)
    elif case == "another chain":
        bad = encode(FP, CHAIN[1], CHAIN[1], PAYLOADS[1], CONTENT[1])
    elif case == "not a block":
        bad = b"x" * len(good)
    elif case == "empty":
        bad = b""
    else:
        bad = good[:4] + (FORMAT_VERSION + 1).to_bytes(2, "little") + good[6:]
    assert check(bad, 1) is reason


def test_dims_disagreeing_with_the_fingerprint_are_refused():
    # same digest bytes, other dims: only possible by forging, but the header's dims are checked anyway
    v = bytearray(value(1))
    v[28:32] = (3).to_bytes(4, "little")     # layers field (after magic, version, flags, sizes, digest)
    import struct
    import xxhash
    check_at = len(v) - FP.block_bytes - 8
    v[check_at:check_at + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(v[:check_at])))
    assert check(bytes(v), 1) is Reject.DIMS


def test_encode_refuses_wrong_sizes():
    with pytest.raises(ValueError, match="payload"):
        encode(FP, CHAIN[0], HASHER.root, b"x" * 10)
    with pytest.raises(ValueError, match="16 bytes"):
        encode(FP, CHAIN[0][:8], HASHER.root, PAYLOADS[0])


def test_decode_returns_a_view_not_a_copy():
    v = value(0)
    out = check(v, 0)
    assert out.obj is v
    assert out.nbytes == FP.block_bytes


# -- arguments of the wrong type ---------------------------------------------------------------------

def _codec():
    import numpy as np

    from prefixkv.hashing import BlockHasher, encode_tokens
    from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

    fp = Fingerprint(weights_digest([("w", np.arange(4, dtype=np.float32))]), "float16", 1, 1, 4, 2, hash_seed=3)
    hasher = BlockHasher(2, seed=3)
    tokens = encode_tokens([5, 6, 7, 8])
    chain = hasher.hash_blocks(tokens, 0, 2, None)
    return fp, hasher, chain, hasher.block_content(tokens, 1), bytes(range(fp.block_bytes))


def test_codec_encode_refuses_content_that_is_not_bytes():
    """bytes(content) turned a count into zero bytes (content=5 stored b'\\0' * 5) and a list of
    small ints into other bytes; hashes given as str or int raised a bare TypeError. All are
    InvalidArgument naming the argument, and nothing is encoded."""
    from prefixkv.tiers.block_codec import encode

    fp, hasher, chain, content, payload = _codec()
    for kwargs, argument in ((dict(content=5), "content"), (dict(content=[1, 2, 3]), "content"),
                             (dict(block_hash=chain[1].hex()[:16]), "block_hash"),
                             (dict(parent_hash=12345), "parent_hash"), (dict(payload="x" * fp.block_bytes), "payload"),
                             (dict(block_hash=chain[1][:8]), "block_hash"), (dict(payload=b"x"), "payload")):
        args = dict(block_hash=chain[1], parent_hash=chain[0], payload=payload, content=content) | kwargs
        with pytest.raises(InvalidArgument) as info:
            encode(fp, args["block_hash"], args["parent_hash"], args["payload"], args["content"])
        assert info.value.argument == argument


def test_codec_decode_refuses_arguments_of_the_wrong_type_instead_of_rejecting_the_value():
    """decode compared the stored bytes with a str / list content or hash: never equal, so every
    value came back Reject.CONTENT / HASH, and RedisBlockStore.fetch deletes what decode rejects:
    a caller's type mistake emptied the shared store. Now InvalidArgument, before any check."""
    from prefixkv.tiers.block_codec import decode, encode

    fp, hasher, chain, content, payload = _codec()
    value = encode(fp, chain[1], chain[0], payload, content)
    assert bytes(decode(value, fp, chain[1], chain[0], content)) == payload
    for args, argument in (((value, fp, chain[1], chain[0], content.hex()), "content"),
                           ((value, fp, chain[1], chain[0], list(content)), "content"),
                           ((value, fp, chain[1].hex(), chain[0], content), "block_hash"),
                           ((value, fp, chain[1], None, content), "parent_hash"),
                           ((None, fp, chain[1], chain[0], content), "value")):
        with pytest.raises(InvalidArgument) as info:
            decode(*args)
        assert info.value.argument == argument
