"""Bad arguments to the core (pool, KV store, sizing, hashing, manager, engine requests) raise
``InvalidArgument`` naming the argument, catchable as the ValueError / TypeError they raised before;
numpy integers are accepted where ints are, consistently; a failed call changes nothing."""

import pickle

import numpy as np
import pytest

from prefixkv import InvalidArgument, KVCacheManager
from prefixkv.copies import BlockCopies
from prefixkv.hashing import BlockHasher, ExtraKeys, MultiModalItem, _typed, as_hash_list
from prefixkv.pool import BlockPool
from prefixkv.policies import make_policy
from prefixkv.sizing import KVSpec, parse_size, plan, tail_waste


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


# -- engine requests ---------------------------------------------------------------------------------

def test_prompt_tensors_must_be_one_dimensional_naming_the_shape():
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    # an [N, 1] tensor (a batch of one column) was read as N tokens
    for prompt in (torch.tensor([[1], [2], [3]]), np.array([[1], [2], [3]]), torch.tensor([[1, 2]]),
                   torch.tensor(5)):
        with pytest.raises(InvalidRequestTokens, match=r"one-dimensional.*shape \(") as info:
            check_prompt_tokens(prompt, 100, request_id="r")
        assert "request 'r'" in str(info.value)
        copy = pickle.loads(pickle.dumps(info.value))
        assert str(copy) == str(info.value)
    with pytest.raises(InvalidRequestTokens, match="prompt 2 of the batch.*shape"):
        check_prompt_tokens(np.zeros((2, 2), np.int64), None, prompt_index=2)
    assert check_prompt_tokens(torch.tensor([4, 5]), 100, request_id="r") == (4, 5)
    assert check_prompt_tokens(np.array([4, 5]), 100, request_id="r") == (4, 5)


def test_a_boolean_tensor_token_is_named_by_its_dtype():
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    with pytest.raises(InvalidRequestTokens, match=r"position 0 is not an integer \(.*torch\.bool") as info:
        check_prompt_tokens(torch.tensor([True, False]), 100, request_id="r")
    assert "(Tensor)" not in str(info.value)
    with pytest.raises(InvalidRequestTokens, match=r"position 1 is not an integer \(.*float32"):
        check_prompt_tokens([1, np.float32(2.0)], 100, request_id="r")
    with pytest.raises(InvalidRequestTokens, match=r"not an integer \(str\)"):
        check_prompt_tokens([1, "2"], 100, request_id="r")


def test_a_prompt_that_is_not_a_sequence_is_refused_naming_the_request():
    from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens

    with pytest.raises(InvalidRequestTokens, match="request 'r'.*int"):
        check_prompt_tokens(5, 100, request_id="r")


# -- BlockCopies -------------------------------------------------------------------------------------

def test_joining_one_part_does_not_alias_it():
    part = BlockCopies([1, 2], [3, 4])
    joined = BlockCopies.join([part])
    assert joined == [(1, 3), (2, 4)] and joined is not part
    joined.src[0] = 9
    assert part == [(1, 3), (2, 4)]


def test_a_slice_does_not_alias_the_copies():
    copies = BlockCopies([1, 2, 3], [4, 5, 6])
    head = copies[:2]
    head.dst[0] = 9
    assert copies == [(1, 4), (2, 5), (3, 6)]


def test_taken_demotions_are_not_shared_with_the_manager():
    """take_demotions of a single batch hands over that batch itself (the manager drops it), so
    writing into the result cannot reach the manager's state (its snapshot stays what it was)."""
    mgr = KVCacheManager(3, 2, hash_seed=0, num_host_blocks=4, host_cache=True, index="dict")
    mgr.admit("a", [1, 2, 3, 4, 5])
    mgr.free("a")
    mgr.admit("b", [7, 8, 9, 10, 11])       # evicts a's blocks to the host tier
    before = mgr.snapshot()
    demotions = mgr.take_demotions()
    assert len(demotions) and mgr.take_demotions() == []
    demotions.src[:] = 0
    after = mgr.snapshot()
    assert after[:5] == before[:5]


# -- KVStore -----------------------------------------------------------------------------------------

def _store(num_blocks=4, block_size=2, host_blocks=4):
    torch = pytest.importorskip("torch")
    from prefixkv.kv.storage import KVStore

    store = KVStore(KVSpec(layers=2, kv_heads=1, head_dim=2, dtype="float32"), num_blocks, block_size)
    store.allocate_host(host_blocks)
    store.data.copy_(torch.arange(store.data.numel(), dtype=torch.float32).view_as(store.data))
    return store


def _kv_calls():
    import torch

    one = torch.ones(1, 1, 2)
    return [
        (lambda s: s.write(0, [8], one, one), "slot_mapping", ("out of range", "[8, 8]"), ValueError),
        (lambda s: s.write(0, [0.5], one, one), "slot_mapping", ("must hold integers",), ValueError),
        (lambda s: s.write(0, [0, 1], one, one), "slot_mapping", ("2 slots for 1 tokens",), ValueError),
        (lambda s: s.write(0, [0], [[[1.0, 2.0]]], one), "k", ("must be a torch tensor", "list"), TypeError),
        (lambda s: s.write(0, [0], one, torch.ones(1, 1, 3)), "v", ("must be [num_tokens, 1, 2]",), ValueError),
        (lambda s: s.write(0, [0], one.double(), one), "k", ("torch.float64",), ValueError),
        (lambda s: s.write(0, [0, 1], torch.ones(2, 1, 2), one), "v", ("k has 2 tokens but v has 1",), ValueError),
        (lambda s: s.write(0.5, [0], one, one), "layer", ("must be an integer",), TypeError),
        (lambda s: s.copy_blocks([(0, 9)]), "copies", ("copy destination block out of range",), ValueError),
        (lambda s: s.copy_blocks([(0, 1), (1.5, 2)]), "copies", ("copy pair 1", "1.5"), TypeError),
        (lambda s: s.copy_blocks([(0, 1, 2)]), "copies", ("item 0", "(0, 1, 2)"), ValueError),
        (lambda s: s.demote([(0, 9)]), "demotions", ("demotion host block out of range",), ValueError),
        (lambda s: s.demote(BlockCopies([0], [9])), "demotions", ("demotion host block out of range",), ValueError),
        (lambda s: s.load([(True, 1)]), "loads", ("load pair 0", "True"), TypeError),
        (lambda s: s.swap_out([(9, 0)]), "copies", ("swap-out device block out of range",), ValueError),
        (lambda s: s.swap_in([(0, 9)]), "copies", ("swap-in device block out of range",), ValueError),
        (lambda s: s.transfer([(0, 0)], [(0, 1)], [(7, 1)]), "copies", ("copy source block out of range",), ValueError),
        (lambda s: s.transfer([(0, 0)], [(9, 1)], []), "loads", ("load host block out of range",), ValueError),
        (lambda s: s.gather(0, [0], -1), "length", ("must be >= 0",), ValueError),
        (lambda s: s.gather(0, [0], 2.0), "length", ("must be an integer",), TypeError),
        (lambda s: s.gather(0, [0], 5), "block_table", ("1 entries but 3 are needed", "for length 5"), ValueError),
        (lambda s: s.gather(0, [9], 2), "block_table", ("out of range",), ValueError),
        (lambda s: s.allocate_host(-1), "num_host_blocks", ("must be >= 0",), ValueError),
        (lambda s: s.allocate_host("2"), "num_host_blocks", ("must be an integer",), TypeError),
    ]


@pytest.mark.parametrize("case", range(24))
def test_kv_store_calls_name_the_bad_argument_and_change_nothing(case):
    torch = pytest.importorskip("torch")
    store = _store()
    call, argument, fragments, was = _kv_calls()[case]
    data, host = store.data.clone(), store.host.clone()
    with pytest.raises(was) as info:
        call(store)
    _named(info.value, argument, *fragments, was=was)
    assert torch.equal(store.data, data) and torch.equal(store.host, host)


def test_kv_store_sizes_and_dtypes_are_named():
    pytest.importorskip("torch")
    from prefixkv.kv.storage import KVStore, torch_dtype

    spec = KVSpec(layers=1, kv_heads=1, head_dim=2, dtype="float32")
    for args, argument, was in [((spec, 0, 2), "num_blocks", ValueError), ((spec, 2, -1), "block_size", ValueError),
                                ((spec, 2.5, 2), "num_blocks", TypeError), ((spec, 2, "2"), "block_size", TypeError)]:
        with pytest.raises(was) as info:
            KVStore(*args)
        _named(info.value, argument, was=was)
    for dtype in ("fp8", "float64", ["bf16"]):
        with pytest.raises(ValueError) as info:
            torch_dtype(dtype)
        _named(info.value, "dtype", "float32, float16 and bfloat16")
    with pytest.raises(ValueError) as info:
        KVStore.from_budget(spec, 2, 8)
    _named(info.value, "pool_bytes", "hold no block")


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
