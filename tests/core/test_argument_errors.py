"""Bad arguments to the core (hasher, pool, sizing, hashing, manager) raise InvalidArgument naming
the argument, and stay catchable as the ValueError / TypeError they raised before; numpy integers are
accepted where ints are, consistently; a failed call changes nothing (a policy object refused with
its manager stays free to serve the corrected call)."""

import pickle

import numpy as np
import pytest

from prefixkv import InvalidArgument, KVCacheManager
from prefixkv.hashing import BlockHasher, MultiModalItem, _typed, as_hash_list
from prefixkv.policies import make_policy
from prefixkv.pool import BlockPool
from prefixkv.sizing import KVSpec, parse_size, plan, tail_waste


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


# -- the argument named, the message kept through pickling ------------------------------------------

def _named(error, argument, *fragments, was=ValueError):
    assert isinstance(error, InvalidArgument), type(error)
    assert isinstance(error, was)                   # what callers caught before
    assert error.argument == argument, error.argument
    for fragment in fragments:
        assert fragment in str(error), str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)


# -- BlockPool ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks,block_size,argument,fragment", [
    (0, 4, "num_blocks", "must be positive"),
    (-2, 4, "num_blocks", "must be positive"),
    (4, 0, "block_size", "must be positive"),
])
def test_pool_refuses_non_positive_sizes_naming_them(num_blocks, block_size, argument, fragment):
    policy = make_policy("lru")
    with pytest.raises(ValueError) as info:
        BlockPool(num_blocks, block_size, policy)
    _named(info.value, argument, fragment)
    assert getattr(policy, "pool", None) is None    # refused before the policy was bound


@pytest.mark.parametrize("num_blocks,block_size,argument", [
    ("8", 4, "num_blocks"), (2.5, 4, "num_blocks"), (True, 4, "num_blocks"), (None, 4, "num_blocks"),
    (8, "4", "block_size"), (8, 4.0, "block_size"), (8, False, "block_size"),
])
def test_pool_refuses_non_integer_sizes_naming_them(num_blocks, block_size, argument):
    # a string was compared with 0 (a bare TypeError), a float or True was taken as a size
    with pytest.raises(TypeError) as info:
        BlockPool(num_blocks, block_size, make_policy("lru"))
    _named(info.value, argument, "must be an int", was=TypeError)


def test_pool_takes_numpy_integer_sizes_as_ints():
    pool = BlockPool(np.int64(8), np.int32(4), make_policy("lru"))
    assert type(pool.num_blocks) is int and type(pool.block_size) is int
    assert (pool.num_blocks, pool.block_size) == (8, 4)


def test_pool_refuses_a_policy_serving_another_pool_naming_it():
    policy = make_policy("lru")
    BlockPool(4, 4, policy)
    with pytest.raises(ValueError) as info:
        BlockPool(4, 4, policy)
    _named(info.value, "policy", "already serves another pool")


# -- sizing ------------------------------------------------------------------------------------------

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float32")


@pytest.mark.parametrize("call,argument,fragment", [
    (lambda: plan(SPEC, 0, 1 << 20, 100), "block_size", "must be positive"),
    (lambda: plan(SPEC, -16, 1 << 20, 100), "block_size", "must be positive"),
    (lambda: plan(SPEC, 16, 1 << 20, 0), "prompt_tokens", "must be positive"),
    (lambda: plan(SPEC, 16, -1, 100), "pool_bytes", ">= 0"),
    (lambda: tail_waste([3, 5], 0), "block_size", "must be positive"),
    (lambda: tail_waste([3, -5], 4), "lengths", "-5"),
    (lambda: SPEC.bytes_per_block(0), "block_size", "must be positive"),
    (lambda: KVSpec(layers=0, kv_heads=2, head_dim=8), "layers", "must be positive"),
    (lambda: KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="int4"), "dtype", "unknown dtype"),
    (lambda: KVSpec(layers=2, kv_heads=3, head_dim=8, tensor_parallel=2), "tensor_parallel", "split evenly"),
    (lambda: parse_size("12GB"), "size", "decimal"),
    (lambda: parse_size("lots"), "size", "cannot read"),
    (lambda: parse_size(-1), "size", ">= 0"),
])
def test_sizing_refuses_bad_values_naming_them(call, argument, fragment):
    with pytest.raises(ValueError) as info:
        call()
    _named(info.value, argument, fragment)


@pytest.mark.parametrize("call,argument", [
    (lambda: plan(SPEC, 16.0, 1 << 20, 100), "block_size"),     # a float block size used to plan
    (lambda: plan(SPEC, True, 1 << 20, 100), "block_size"),
    (lambda: plan(SPEC, 16, 1 << 20, 100.5), "prompt_tokens"),
    (lambda: plan(SPEC, "16", 1 << 20, 100), "block_size"),       # a bare TypeError from '<='
    (lambda: tail_waste([3, 5], 2.5), "block_size"),
    (lambda: tail_waste([3, 2.5], 2), "lengths"),
    (lambda: tail_waste(5, 2), "lengths"),                         # not a list of lengths
])
def test_sizing_refuses_non_integers_naming_them(call, argument):
    with pytest.raises(InvalidArgument) as info:
        call()
    _named(info.value, argument)


def test_sizing_still_takes_numpy_integers():
    assert plan(SPEC, np.int64(16), 1 << 20, np.int32(100)).blocks_per_request == 7
    assert tail_waste([np.int64(3), 5], np.int64(4))["tail_waste"] == 4


# -- hashing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("start,length,argument", [(-1, 4, "start"), (0, 0, "length"), (3, -2, "length")])
def test_multimodal_item_refuses_bad_positions_naming_them(start, length, argument):
    with pytest.raises(ValueError) as info:
        MultiModalItem("img", start, length)
    _named(info.value, argument, str(start if argument == "start" else length))


@pytest.mark.parametrize("value", [True, 1.5, None, ("a",)])
def test_typed_refuses_values_it_cannot_encode_naming_the_extra_key(value):
    with pytest.raises(TypeError) as info:
        _typed(value)
    _named(info.value, "extra", type(value).__name__, was=TypeError)


@pytest.mark.parametrize("hashes,fragment", [([b"a", None], "block hash 1 is None"),
                                             ([b"a", [1, 2]], "block hash 1 (list) is not hashable")])
def test_precomputed_hashes_refuse_bad_entries_naming_them(hashes, fragment):
    with pytest.raises(ValueError) as info:
        as_hash_list(hashes)
    _named(info.value, "block_hashes", fragment)


def test_hash_blocks_refuses_blocks_past_the_tokens_naming_them():
    hasher = BlockHasher(4, seed=0)
    from prefixkv.hashing import encode_tokens
    with pytest.raises(ValueError) as info:
        hasher.hash_blocks(encode_tokens(list(range(6))), 0, 2, None)
    _named(info.value, "stop_block", "not full blocks")


def test_numpy_integer_sizes_and_seeds_agree_between_hasher_and_manager():
    """BlockHasher took np.int64 block sizes the manager refused, and both refused np.int64 seeds:
    numpy integers (what a config read with numpy or a tokenizer hands over) are ints everywhere,
    and hash exactly as the equal ints do."""
    plain = KVCacheManager(8, 4, hash_seed=7, index="dict")
    wide = KVCacheManager(np.int64(8), np.int64(4), hash_seed=np.uint64(7), num_host_blocks=np.int32(2),
                          index="dict")
    assert type(wide.block_size) is int and type(wide.num_host_blocks) is int
    assert wide.pool.num_blocks == 8 and type(wide.pool.num_blocks) is int
    assert wide.prompt(list(range(9))).block_hashes() == plain.prompt(list(range(9))).block_hashes()
    hasher = BlockHasher(np.int32(4), seed=np.int64(7))
    assert type(hasher.seed) is int and hasher.root == plain.hasher.root
    tokens = [np.int64(t) for t in range(9)]
    assert wide.admit("a", tokens) == 0 and plain.admit("a", tokens) == 0


@pytest.mark.parametrize("kwargs,argument", [
    (dict(num_blocks=np.bool_(True), block_size=4), "num_blocks"),
    (dict(num_blocks=8, block_size=np.bool_(True)), "block_size"),
    (dict(num_blocks=8, block_size=4, hash_seed=np.bool_(False)), "hash_seed"),
    (dict(num_blocks=8, block_size=4, hash_seed=np.float64(3.0)), "hash_seed"),
    (dict(num_blocks=8, block_size=np.float32(4.0)), "block_size"),
])
def test_numpy_booleans_and_floats_stay_refused(kwargs, argument):
    with pytest.raises(InvalidArgument) as info:
        KVCacheManager(**kwargs)
    assert info.value.argument == argument
    if argument != "num_blocks":
        with pytest.raises(InvalidArgument):
            BlockHasher(kwargs["block_size"], seed=kwargs.get("hash_seed"))


# -- KVCacheManager ----------------------------------------------------------------------------------

def test_host_cache_without_host_blocks_is_refused_before_anything_is_built():
    """The check ran after the pool was built: the policy object passed was already bound to that
    pool, so it could not be used again once the caller fixed the arguments."""
    policy = make_policy("lru")
    with pytest.raises(ValueError) as info:
        KVCacheManager(8, 4, policy=policy, host_cache=True, index="dict")
    _named(info.value, "host_cache", "num_host_blocks > 0")
    assert getattr(policy, "pool", None) is None
    KVCacheManager(8, 4, policy=policy, index="dict")     # the same policy object still serves


def test_belady_by_name_is_refused_naming_the_policy():
    with pytest.raises(ValueError) as info:
        KVCacheManager(8, 4, policy="belady")
    _named(info.value, "policy", "belady")


def test_manager_call_arguments_are_named():
    mgr = KVCacheManager(8, 4, hash_seed=0, index="dict")
    other = KVCacheManager(8, 4, hash_seed=1, index="dict")
    with pytest.raises(ValueError) as info:
        mgr.admit("a", other.prompt([1, 2, 3, 4, 5]))
    _named(info.value, "prompt", "another manager")
    mgr.admit("h", mgr.prompt_from_hashes([b"x" * 16], 4))
    mgr.admit("a", [1, 2, 3])
    before = mgr.snapshot()
    with pytest.raises(ValueError) as info:
        mgr.append_slots("h", -1)
    _named(info.value, "num_tokens", "-1")
    for bad in (1.5, "2", True):
        with pytest.raises(InvalidArgument) as info:
            mgr.append_slots("h", bad)
        assert info.value.argument == "num_tokens"
    with pytest.raises(ValueError) as info:
        mgr.decode_step(["a"], [1, 2])
    _named(info.value, "tokens", "1 sequences but 2 tokens")
    with pytest.raises(ValueError) as info:
        mgr.decode_step(["a", "a"], [1, 2])
    _named(info.value, "seq_ids", "twice")
    with pytest.raises(ValueError) as info:
        mgr.block_tables(["a"], width=0)
    _named(info.value, "width", "shorter")
    assert mgr.snapshot() == before


def test_an_unknown_host_policy_is_refused_before_the_device_policy_object_is_bound():
    """The host policy's name was checked only when the host tier was built, after the device pool had
    bound the policy object passed in: the caller could not reuse it once the name was fixed."""
    from prefixkv import KVCacheManager
    from prefixkv.policies import LRUPolicy

    policy = LRUPolicy()
    with pytest.raises(ValueError, match="no-such-policy"):
        KVCacheManager(8, 4, policy=policy, num_host_blocks=4, host_cache=True, host_policy="no-such-policy")
    assert policy.pool is None
    KVCacheManager(8, 4, policy=policy, num_host_blocks=4, host_cache=True)


# -- a host policy object is refused before the device pool binds its policy ----------------------

def test_the_same_policy_object_for_both_tiers_is_refused_before_anything_binds():
    """Host policy objects are checked before the device pool is built, as names are: the same
    object as device and host policy (or one serving another pool) is refused before the device
    pool binds the device policy, which can then still serve the corrected call."""
    policy = make_policy("lru")
    with pytest.raises(InvalidArgument, match="host_policy"):
        KVCacheManager(8, 4, policy=policy, host_policy=policy, num_host_blocks=4)
    assert policy.pool is None
    KVCacheManager(8, 4, policy=policy, host_policy="lru", num_host_blocks=4)     # still usable


def test_a_host_policy_serving_another_pool_is_refused_before_the_device_binds():
    host = make_policy("lru")
    KVCacheManager(8, 4, host_policy=host, num_host_blocks=4)
    device = make_policy("arc")
    with pytest.raises(InvalidArgument, match="host_policy"):
        KVCacheManager(8, 4, policy=device, host_policy=host, num_host_blocks=4)
    assert device.pool is None
    KVCacheManager(8, 4, policy=device, host_policy=make_policy("lru"), num_host_blocks=4)
