"""Bad constructor arguments raise InvalidArgument naming the argument, and stay catchable as the
ValueError / TypeError they raised before."""

import pickle

import pytest

from prefixkv import InvalidArgument, KVCacheManager
from prefixkv.hashing import BlockHasher


def _check(exc_info, argument, *fragments):
    error = exc_info.value
    assert isinstance(error, InvalidArgument)
    assert error.argument == argument
    assert str(error).startswith(f"{argument}: ")
    for fragment in fragments:
        assert fragment in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.argument == argument


# -- BlockHasher ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_block_hasher_refuses_non_positive_block_size(block_size):
    with pytest.raises(ValueError) as info:          # what callers caught before
        BlockHasher(block_size, seed=0)
    _check(info, "block_size", "must be positive", str(block_size))


@pytest.mark.parametrize("algorithm", ["md5", "sha256", "", "XXH3_128"])
def test_block_hasher_refuses_unknown_algorithm(algorithm):
    with pytest.raises(ValueError) as info:
        BlockHasher(4, seed=0, algorithm=algorithm)
    _check(info, "algorithm", "unknown hash algorithm", repr(algorithm), "xxh3_128", "xxh3_64")


@pytest.mark.parametrize("algorithm", [None, 128, ["xxh3_128"]])
def test_block_hasher_refuses_non_string_algorithm(algorithm):
    with pytest.raises(InvalidArgument) as info:
        BlockHasher(4, seed=0, algorithm=algorithm)
    _check(info, "algorithm", "unknown hash algorithm")


def test_block_hasher_still_accepts_good_arguments():
    for algorithm in ("xxh3_128", "xxh3_64"):
        assert BlockHasher(1, seed=0, algorithm=algorithm).block_size == 1


# -- KVCacheManager ------------------------------------------------------------------------------

@pytest.mark.parametrize("index", ["dict", "auto"])
@pytest.mark.parametrize("kwargs,argument,fragments", [
    (dict(num_blocks=2.5, block_size=16), "num_blocks", ("must be an int", "float", "2.5")),
    (dict(num_blocks="8", block_size=16), "num_blocks", ("must be an int", "str", "'8'")),
    (dict(num_blocks=True, block_size=16), "num_blocks", ("must be an int", "bool")),
    (dict(num_blocks=None, block_size=16), "num_blocks", ("must be an int", "NoneType")),
    (dict(num_blocks=8, block_size="16"), "block_size", ("must be an int", "str", "'16'")),
    (dict(num_blocks=8, block_size=4.0), "block_size", ("must be an int", "float")),
    (dict(num_blocks=8, block_size=False), "block_size", ("must be an int", "bool")),
    (dict(num_blocks=8, block_size=4, num_host_blocks=None), "num_host_blocks", ("must be an int", "NoneType")),
    (dict(num_blocks=8, block_size=4, num_host_blocks=1.5), "num_host_blocks", ("must be an int", "float", "1.5")),
    (dict(num_blocks=8, block_size=4, num_host_blocks=True), "num_host_blocks", ("must be an int", "bool")),
])
def test_manager_refuses_non_integer_sizes(kwargs, argument, fragments, index):
    with pytest.raises(TypeError) as info:           # what callers caught before
        KVCacheManager(**kwargs, index=index)
    _check(info, argument, *fragments)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("index", ["dict", "auto"])
@pytest.mark.parametrize("kwargs,argument,fragments", [
    (dict(num_blocks=0, block_size=4), "num_blocks", ("must be positive", "0")),
    (dict(num_blocks=-3, block_size=4), "num_blocks", ("must be positive", "-3")),
    (dict(num_blocks=8, block_size=0), "block_size", ("must be positive", "0")),
    (dict(num_blocks=8, block_size=-4), "block_size", ("must be positive", "-4")),
    (dict(num_blocks=8, block_size=4, num_host_blocks=-1), "num_host_blocks", ("must be >= 0", "-1")),
    (dict(num_blocks=8, block_size=4, hash_algorithm="md5"), "hash_algorithm", ("unknown hash algorithm",)),
])
def test_manager_refuses_out_of_range_sizes(kwargs, argument, fragments, index):
    with pytest.raises(ValueError) as info:          # what callers caught before
        KVCacheManager(**kwargs, index=index)
    _check(info, argument, *fragments)


def test_manager_checks_sizes_in_argument_order():
    # both bad: the first one is named
    with pytest.raises(InvalidArgument) as info:
        KVCacheManager(0, 0)
    assert info.value.argument == "num_blocks"
    with pytest.raises(InvalidArgument) as info:
        KVCacheManager(2.5, "x")
    assert info.value.argument == "num_blocks"


def test_manager_still_accepts_good_sizes():
    mgr = KVCacheManager(1, 1, hash_seed=0)
    assert mgr.block_size == 1 and mgr.num_host_blocks == 0
    mgr = KVCacheManager(4, 2, hash_seed=0, num_host_blocks=3)
    assert mgr.num_host_blocks == 3
