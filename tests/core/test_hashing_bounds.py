"""BlockHasher refuses a block size its root cannot encode.

The chain's root hashes the block size as a little-endian uint32 ("<I"), so a block size of
2**32 or more crashed in the constructor with ``struct.error`` ("'I' format requires
0 <= number <= 4294967295") instead of a typed error naming the argument.
"""

import numpy as np
import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import InvalidArgument
from prefixkv.hashing import BlockHasher, encode_tokens


@pytest.mark.parametrize("size", [2**32, 2**32 + 1, 2**40, 2**64, 10**30, np.uint64(2**32)])
def test_block_size_past_uint32_is_refused_naming_block_size(size):
    with pytest.raises(InvalidArgument) as info:
        BlockHasher(size, seed=0)
    assert info.value.argument == "block_size"
    assert "2**32" in str(info.value)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "xxh3_64"])
def test_largest_block_size_is_taken(algorithm):
    # 2**32 - 1 fits the uint32 the root hashes: built as before (no tokens are hashed at it).
    hasher = BlockHasher(2**32 - 1, seed=0, algorithm=algorithm)
    assert hasher.block_size == 2**32 - 1
    assert len(hasher.root) == hasher.digest_size


def test_the_manager_refuses_it_before_building_anything():
    with pytest.raises(InvalidArgument) as info:
        KVCacheManager(num_blocks=4, block_size=2**32, hash_seed=0)
    assert info.value.argument == "block_size"


def test_valid_digests_are_unchanged():
    # Pinned digests of valid inputs: the bound must not move any of them.
    hasher = BlockHasher(4, seed=0)
    assert hasher.root.hex() == "f65af7e182b5e9b63e45a179a2862f8e"
    hashes = hasher.hash_blocks(encode_tokens(range(8)), 0, 2, None)
    assert [h.hex() for h in hashes] == ["5ae03c44e2e7928884d0d3ec3645819e",
                                        "523dc0cb8087cb15c6d4dd3bfd4a44ef"]
    assert BlockHasher(2**32 - 1, seed=7).root.hex() == "594aeaec5060637d3739259b7856939e"
