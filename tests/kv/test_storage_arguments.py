"""KVStore's calls name the bad argument (InvalidArgument, still the ValueError / TypeError raised
before, its message kept through pickling) and change neither pool; bad sizes and dtypes are named.
Each test skips without torch."""

import pickle

import pytest

from prefixkv import InvalidArgument
from prefixkv.copies import BlockCopies
from prefixkv.sizing import KVSpec


def _named(error, argument, *fragments, was=ValueError):
    assert isinstance(error, InvalidArgument), type(error)
    assert isinstance(error, was)                   # what callers caught before
    assert error.argument == argument, error.argument
    for fragment in fragments:
        assert fragment in str(error), str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)


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
