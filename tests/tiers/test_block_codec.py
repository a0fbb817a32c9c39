"""One self-describing value per block: every damaged or foreign value is refused with its reason."""

from __future__ import annotations

import os

import numpy as np
import pytest

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
