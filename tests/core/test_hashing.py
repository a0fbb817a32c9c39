import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from prefixkv import BlockHasher, ExtraKeys, InvalidTokens, MultiModalItem
from prefixkv.hashing import encode_tokens


def test_golden_hash_is_platform_independent():
    """The hash input is parent digest + little-endian uint32 tokens, pinned here."""
    hasher = BlockHasher(4, seed=7)
    root = xxhash.xxh3_128_digest(b"prefixkv/root/v1" + (7).to_bytes(16, "little") + struct.pack("<I", 4))
    first = xxhash.xxh3_128_digest(root + struct.pack("<4I", 1, 2, 3, 70000))
    second = xxhash.xxh3_128_digest(first + struct.pack("<4I", 5, 6, 7, 8))
    assert hasher.hash_blocks(encode_tokens([1, 2, 3, 70000, 5, 6, 7, 8, 9]), 0, 2, None) == [first, second]


def test_incremental_hashing_equals_hashing_at_once():
    hasher = BlockHasher(16, seed=1)
    tokens = encode_tokens(range(100))
    whole = hasher.hash_blocks(tokens, 0, 6, None)
    head = hasher.hash_blocks(tokens, 0, 2, None)
    tail = hasher.hash_blocks(tokens, 2, 6, head[-1])
    assert head + tail == whole
    assert len(set(whole)) == 6


def test_chain_covers_the_parent():
    hasher = BlockHasher(2, seed=0)
    a = hasher.hash_blocks(encode_tokens([1, 2, 3, 4]), 0, 2, None)
    b = hasher.hash_blocks(encode_tokens([9, 9, 3, 4]), 0, 2, None)
    assert a[1] != b[1]  # same second block, different parents


def test_seed_changes_every_hash_and_pinned_seed_reproduces():
    tokens = encode_tokens(range(32))
    assert BlockHasher(16, seed=1).hash_blocks(tokens, 0, 2, None) == BlockHasher(16, seed=1).hash_blocks(tokens, 0, 2, None)
    assert BlockHasher(16, seed=1).hash_blocks(tokens, 0, 1, None) != BlockHasher(16, seed=2).hash_blocks(tokens, 0, 1, None)


def test_default_seed_is_random_per_process():
    code = "from prefixkv import BlockHasher; print(BlockHasher(16).root.hex())"
    roots = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
             for _ in range(2)}
    assert len(roots) == 2
    assert BlockHasher(16).root == BlockHasher(16).root  # one process agrees with itself


@pytest.mark.parametrize("a,b", [
    (ExtraKeys(salt="x"), ExtraKeys(adapter="x")),           # same value, different source
    (ExtraKeys(salt="x"), ExtraKeys(salt="y")),
    (ExtraKeys(), ExtraKeys(salt="x")),
    (ExtraKeys(adapter=1), ExtraKeys(adapter="1")),           # int and str ids differ
    (ExtraKeys(salt="ab", adapter="c"), ExtraKeys(salt="a", adapter="bc")),  # no concatenation ambiguity
    (ExtraKeys(salt=b"x"), ExtraKeys(salt="x")),
])
def test_extra_keys_are_tagged_by_source(a, b):
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens(range(8))
    assert hasher.hash_blocks(tokens, 0, 2, None, a) != hasher.hash_blocks(tokens, 0, 2, None, b)


def test_multimodal_items_hash_only_overlapping_blocks_with_their_offset():
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens([0] * 12)
    plain = hasher.hash_blocks(tokens, 0, 3, None)
    image = ExtraKeys(multimodal=(MultiModalItem("img-1", start=5, length=2),))
    with_image = hasher.hash_blocks(tokens, 0, 3, None, image)
    assert with_image[0] == plain[0]          # block 0 does not overlap positions 5..6
    assert with_image[1] != plain[1]
    other_image = ExtraKeys(multimodal=(MultiModalItem("img-2", start=5, length=2),))
    assert hasher.hash_blocks(tokens, 0, 2, None, other_image)[1] != with_image[1]
    shifted = ExtraKeys(multimodal=(MultiModalItem("img-1", start=6, length=2),))
    assert hasher.hash_blocks(tokens, 0, 2, None, shifted)[1] != with_image[1]


def test_xxh3_64_option():
    hasher = BlockHasher(4, seed=0, algorithm="xxh3_64")
    assert len(hasher.hash_blocks(encode_tokens(range(4)), 0, 1, None)[0]) == 8
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher(4, algorithm="md5")


@pytest.mark.parametrize("bad", [[1, -1], [2**32], [1.5], ["a"], np.zeros((2, 2), dtype=np.int64),
                                 np.array([1.0, 2.0]), np.array([-3])])
def test_invalid_tokens_are_rejected(bad):
    with pytest.raises(InvalidTokens):
        encode_tokens(bad)


def test_numpy_and_list_inputs_encode_alike():
    values = [0, 5, 2**32 - 1, 70000]
    assert encode_tokens(np.array(values, dtype=np.int64)) == encode_tokens(values)
    assert encode_tokens(np.array(values, dtype=np.uint32)) == encode_tokens(values)
