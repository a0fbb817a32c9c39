"""KVStore's block moves (copy, demote, load, swap out and in, transfer) and the BlockCopies they
take: every form of the pairs against a plain per-block loop; ids that are not integers or are out
of range, pairs that are not pairs, layers, sizes and lengths are refused before a block moves."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixkv.copies import BlockCopies  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.sizing import KVSpec  # noqa: E402

SPEC = KVSpec(layers=2, kv_heads=1, head_dim=2, dtype="float32")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def filled(num_blocks=8, host_blocks=6, seed=0, spec=SPEC):
    store = KVStore(spec, num_blocks, 2)
    store.allocate_host(host_blocks)
    gen = torch.Generator().manual_seed(seed)
    store.data.copy_(torch.randn(store.data.shape, generator=gen))
    store.host.copy_(torch.randn(store.host.shape, generator=gen))
    return store


def reference(store, kind, pairs):
    """(data, host) after running ``pairs`` one block at a time, in order."""
    data, host = store.data.clone(), store.host.clone()
    for s, d in pairs:
        if kind == "copy_blocks":
            data[:, :, d] = data[:, :, s].clone()
        elif kind in ("demote", "swap_out"):
            host[:, :, d] = data[:, :, s]
        else:
            data[:, :, d] = host[:, :, s]
    return data, host


def unchanged(store):
    data, host = store.data.clone(), store.host.clone()
    return lambda: torch.equal(store.data, data) and torch.equal(store.host, host)


# -- block ids that are not integers ----------------------------------------------------------
@pytest.mark.parametrize("method", ["copy_blocks", "demote", "load", "swap_out", "swap_in"])
@pytest.mark.parametrize("bad", [1.5, "1", True, None])
def test_non_integer_block_ids_are_refused_naming_the_value(method, bad):
    """A float id was truncated (1.5 -> block 1), a string parsed, True taken as block 1: bytes
    went to or came from a block nobody named. Now refused before anything moves."""
    store = filled()
    same = unchanged(store)
    with pytest.raises((TypeError, ValueError), match=repr(bad).replace("(", r"\(")):
        getattr(store, method)([(0, 0), (bad, 2)])
    assert same()


@pytest.mark.parametrize("method", ["copy_blocks", "demote"])
def test_pairs_that_are_not_pairs_are_refused_naming_the_argument(method):
    store = filled()
    same = unchanged(store)
    with pytest.raises(ValueError, match=r"\(1, 2, 3\)"):
        getattr(store, method)([(0, 0), (1, 2, 3)])
    assert same()


# -- BlockCopies inputs --------------------------------------------------------------------------
def test_block_copies_refuses_float_arrays_like_the_list_form():
    """``BlockCopies([1.7], [2])`` raised but ``BlockCopies(np.array([1.7]), ...)`` truncated to 1."""
    with pytest.raises(TypeError, match="src"):
        BlockCopies(np.array([1.7]), np.array([2]))
    with pytest.raises(TypeError, match="dst"):
        BlockCopies(np.array([1]), np.array([2.0]))
    with pytest.raises(TypeError, match=r"src.*1\.7"):
        BlockCopies([1.7], [2])
    with pytest.raises(TypeError, match="bool"):
        BlockCopies(np.array([True]), np.array([1]))


def test_block_copies_refuses_arrays_that_are_not_one_dimensional():
    """A 2-D array gave len() 1 for 2 pairs and pairs whose items are arrays; a 0-d array an
    IndexError naming nothing."""
    with pytest.raises(ValueError, match=r"src.*\(1, 2\)"):
        BlockCopies(np.array([[1, 2]]), np.array([[3, 4]]))
    with pytest.raises(ValueError, match=r"dst.*\(\)"):
        BlockCopies(np.array([1]), np.array(3))


def test_block_copies_refuses_ids_past_int64():
    with pytest.raises(ValueError, match=str(2**63)):
        BlockCopies(np.array([2**63], np.uint64), np.array([1]))


def test_block_copies_takes_torch_tensors_and_generators_as_their_values():
    """A tensor of several ids raised 'Boolean value of Tensor ... is ambiguous'."""
    assert BlockCopies(torch.tensor([1, 2]), torch.tensor([3, 4])) == [(1, 3), (2, 4)]
    assert BlockCopies(np.array([1, 2], np.int32), (i for i in (3, 4))) == [(1, 3), (2, 4)]
    assert BlockCopies(range(2), [np.int64(5), 6]) == [(0, 5), (1, 6)]


def test_block_copies_does_not_alias_the_callers_arrays():
    """A list is copied; an int64 array was kept as it was, so changing it later changed pairs
    already handed out."""
    src, dst = np.array([1, 2]), np.array([3, 4])
    copies = BlockCopies(src, dst)
    src[0], dst[1] = 7, 0
    assert copies == [(1, 3), (2, 4)]


def _forms(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    both = np.array(pairs, np.int64).reshape(-1, 2)
    yield "list", pairs
    yield "tuple", tuple(pairs)
    yield "block copies", BlockCopies(src, dst)
    yield "column views", BlockCopies(both[:, 0], both[:, 1])            # non-contiguous
    yield "reversed views", BlockCopies(np.array(src[::-1], np.int32)[::-1], np.array(dst[::-1])[::-1])
    yield "joined", BlockCopies.join([BlockCopies(src[:1], dst[:1]), BlockCopies(src[1:], dst[1:])])
    yield "array of pairs", both


@pytest.mark.parametrize("method", ["copy_blocks", "demote", "load", "swap_out", "swap_in"])
def test_every_form_of_the_pairs_gives_the_per_block_result(method):
    """Empty, one pair, unsorted, runs, repeated sources and destinations, chains: a list of
    pairs, a BlockCopies (views, int32, joined) and an array of pairs give the loop's bytes."""
    rng = random.Random(5)
    cases = [[], [(3, 1)], [(5, 0), (1, 4), (2, 5), (0, 1)], [(1, 2), (2, 3), (3, 4)],
             [(0, 3), (1, 3), (2, 3)], [(4, 0), (4, 1), (0, 2)], [(1, 0), (0, 1)], [(2, 2)]]
    cases += [[(rng.randrange(6), rng.randrange(6)) for _ in range(rng.randrange(1, 9))] for _ in range(20)]
    for seed, pairs in enumerate(cases):
        for form, arg in _forms(pairs):
            store = filled(seed=seed)
            data, host = reference(store, method, pairs)
            getattr(store, method)(arg)
            assert torch.equal(store.data, data) and torch.equal(store.host, host), (form, pairs)


# -- a failed call moves nothing -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    dict(demotions=[(0, 0), (1, 1)], loads=[(2, 3), (0, 99)]),
    dict(demotions=[(0, 0)], loads=[(1, 1)], copies=[(2, 3), (99, 0)]),
    dict(demotions=[(0, 0)], loads=BlockCopies([1], [1]), copies=[(2, 3), (0.5, 0)]),
])
def test_transfer_checks_all_three_batches_before_moving_a_block(bad):
    """transfer() ran the demotions, then found a bad load (or copy) and raised: the host
    blocks were overwritten by a call that failed."""
    store = filled()
    same = unchanged(store)
    with pytest.raises((TypeError, ValueError), match="99|0.5"):
        store.transfer(bad["demotions"], bad["loads"], bad.get("copies", ()))
    assert same()


# -- stores off the CPU: ids given on the host are range-checked ----------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda s: s.copy_blocks([(0, 9)]), r"copy destination block.*\[9, 9\]"),
    (lambda s: s.copy_blocks([(-1, 2)]), r"copy source block.*\[-1, -1\]"),
    (lambda s: s.write(0, [0, 16], torch.ones(2, 1, 2, device="meta"), torch.ones(2, 1, 2, device="meta")),
     r"slot_mapping.*16"),
    (lambda s: s.write(0, torch.tensor([16]), torch.ones(1, 1, 2, device="meta"),
                       torch.ones(1, 1, 2, device="meta")), r"slot_mapping.*16"),
    (lambda s: s.gather(0, [99], 2), r"block_table.*99"),
    (lambda s: s.swap_out([(9, 0)]), r"swap-out device block.*\[9, 9\]"),
    (lambda s: s.swap_in([(0, 9)]), r"swap-in device block.*\[9, 9\]"),
    (lambda s: s.load([(0, 9)]), r"load device block.*\[9, 9\]"),
])
def test_device_store_range_checks_ids_given_on_the_host(call, match):
    """Ids given as lists / CPU tensors were moved to the device unchecked: on CUDA an
    out-of-range id is a device-side assert (the context is lost), not a ValueError. A meta
    store stands in for the device here: it checks nothing itself."""
    store = KVStore(SPEC, 8, 2, device="meta")
    store.allocate_host(4)
    with pytest.raises(ValueError, match=match):
        call(store)


# -- layer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [True, 0.5, "0"])
def test_layer_must_be_an_integer(layer):
    """``layer=True`` read layer 1; ``layer=0.5`` raised 'list indices must be integers'."""
    store = filled()
    with pytest.raises(TypeError, match="layer"):
        store.gather(layer, [0], 2)
    with pytest.raises(TypeError, match="layer"):
        store.write(layer, [0], torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert store.gather(np.int64(1), [0], 2)[0].shape == (2, 1, 2)


# -- out-of-range ids that the resolution drops -----------------------------------------------------
@pytest.mark.parametrize("method, pairs, match", [
    ("copy_blocks", [(99, 99)], r"copy source block.*99"),                  # a self-copy, dropped
    ("copy_blocks", [(99, 3), (0, 3)], r"copy source block.*99"),           # overwritten by a later pair
    ("copy_blocks", [(1, 2), (2, 1), (-1, 5), (0, 5)], r"copy source block.*-1"),
    ("demote", [(99, 3), (0, 3)], r"demotion device block.*99"),
    ("load", [(99, 3), (0, 3)], r"load host block.*99"),
    ("swap_out", BlockCopies([99, 0], [3, 3]), r"swap-out device block.*99"),
    ("swap_in", BlockCopies([-4, 0], [3, 3]), r"swap-in host block.*-4"),
])
def test_out_of_range_ids_are_refused_even_when_the_pair_would_not_move_a_byte(method, pairs, match):
    """Pairs are resolved to the copies that matter before the range check: an out-of-range id
    in a self-copy or in a pair whose destination a later pair overwrites was never checked,
    so a bad batch from the manager ran (and returned) as if it were fine."""
    store = filled()
    same = unchanged(store)
    with pytest.raises(ValueError, match=match):
        getattr(store, method)(pairs)
    assert same()


def test_pairs_from_a_generator_and_empty_batches_without_host_space():
    store = filled()
    data, host = reference(store, "demote", [(1, 2), (3, 4)])
    assert store.demote((p for p in [(1, 2), (3, 4)])) == 2
    assert torch.equal(store.host, host) and torch.equal(store.data, data)
    assert store.copy_blocks(iter([(0, 1)])) == 1
    bare = KVStore(SPEC, 4, 2)
    assert bare.demote([]) == bare.load(BlockCopies()) == bare.swap_in(iter(())) == 0
    bare.transfer([], BlockCopies(), [])
    with pytest.raises(RuntimeError, match="allocate_host"):
        bare.transfer([(0, 0)], [])


# -- sizes and lengths ------------------------------------------------------------------------------
def test_sizes_and_lengths_must_be_integers_naming_the_argument():
    """``KVStore(spec, 2.5, 4)`` built 2 blocks; ``allocate_host(2.5)`` and ``gather(.., 2.0)``
    failed inside torch with errors that named neither the argument nor the value."""
    with pytest.raises(TypeError, match=r"num_blocks.*2\.5"):
        KVStore(SPEC, 2.5, 4)
    with pytest.raises(TypeError, match=r"block_size.*4\.0"):
        KVStore(SPEC, 4, 4.0)
    store = KVStore(SPEC, np.int64(4), 2)
    assert store.num_blocks == 4
    with pytest.raises(TypeError, match=r"num_host_blocks.*2\.5"):
        store.allocate_host(2.5)
    with pytest.raises(TypeError, match=r"length.*2\.0"):
        store.gather(0, [1], 2.0)
    store.allocate_host(np.int32(3))
    assert store.num_host_blocks == 3 and store.gather(0, [1], np.int64(2))[0].shape == (2, 1, 2)
