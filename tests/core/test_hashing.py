"""Block hashing (``hashing.py``, ``prompt.py``): the chain of digests and what goes into it.

The hash input is pinned (golden digests, per algorithm and per kind of extra key): no change may
alter the hash of an input that was accepted and well formed; a multimodal item's length is part of
the hash. Extra keys and multimodal items are checked when they are made (types, overlaps, order),
block sizes are ints, only full blocks are hashed, and distinct extra-key sets never serialize alike.
"""

import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from prefixkv import BlockHasher, ExtraKeys, InvalidTokens, KVCacheManager, MultiModalItem
from prefixkv.errors import InvalidArgument
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


# -- digest pins --------------------------------------------------------------------------------

_PIN_CASES = {
    "plain": ExtraKeys(),
    "salt_str": ExtraKeys(salt="tenant-a"),
    "salt_int_adapter": ExtraKeys(salt=-5, adapter=b"lora"),
    "mm": ExtraKeys(salt="t", multimodal=(MultiModalItem("img", 3, 6), MultiModalItem(7, 10, 2))),
}
_PINS = {
    ("xxh3_128", "plain"): "e0cf167f79e020b0",
    ("xxh3_128", "salt_str"): "968de2fe5cba3140",
    ("xxh3_128", "salt_int_adapter"): "f09c605868a03b19",
    ("xxh3_128", "mm"): "25fd8972e31d78ef",   # (length hashed since: was ba958ce92d83fc24)
    ("xxh3_64", "plain"): "4a9d0ceaadda228c",
    ("xxh3_64", "salt_str"): "ca0fe24b8e0da536",
    ("xxh3_64", "salt_int_adapter"): "cd0970ed8bb48fe9",
    ("xxh3_64", "mm"): "2f7c3db9774b4be7",    # (was 11940344957c3457)
}


@pytest.mark.parametrize("algorithm,case", sorted(_PINS))
def test_digests_are_pinned(algorithm, case):
    hasher = BlockHasher(4, seed=11, algorithm=algorithm)
    digests = hasher.hash_blocks(encode_tokens(range(16)), 0, 4, None, _PIN_CASES[case])
    assert len(digests) == 4 and all(len(d) == hasher.digest_size for d in digests)
    assert xxhash.xxh3_64_hexdigest(b"".join(digests)) == _PINS[algorithm, case]


def test_prompt_hashes_do_not_follow_a_mutated_input_list():
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="dict")
    ids = list(range(8))
    prompt = mgr.prompt(ids)
    ids[0] = 99                                   # before the lazy hashing
    assert prompt.block_hashes() == mgr.prompt(list(range(8))).block_hashes()


# -- extra keys of a type the hasher cannot encode are refused when made, not later ---------------

@pytest.mark.parametrize("kwargs,argument", [
    (dict(salt=1.5), "salt"),
    (dict(salt=True), "salt"),
    (dict(salt=["a"]), "salt"),
    (dict(adapter=2.0), "adapter"),
    (dict(adapter=False), "adapter"),
    (dict(multimodal=(("img", 0, 4),)), "multimodal"),          # a tuple, not a MultiModalItem
    (dict(multimodal=MultiModalItem("img", 0, 4)), "multimodal"),  # one item, not a sequence
])
def test_extra_keys_of_wrong_type_are_refused_when_made(kwargs, argument):
    with pytest.raises(InvalidArgument) as info:
        ExtraKeys(**kwargs)
    assert info.value.argument == argument


def test_extra_keys_of_wrong_type_are_refused_by_prompt_not_by_match():
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="dict")
    with pytest.raises(InvalidArgument, match="salt"):
        mgr.prompt(list(range(8)), salt=1.5)


@pytest.mark.parametrize("args,argument", [
    (("img", 0.5, 4), "start"),
    (("img", True, 4), "start"),
    (("img", 0, 4.0), "length"),
    (("img", 0, True), "length"),
    (("img", 2**63, 4), "start"),                 # the offset is hashed as a signed 64-bit int
    ((1.5, 0, 4), "identifier"),
    ((None, 0, 4), "identifier"),
    ((False, 0, 4), "identifier"),
])
def test_multimodal_item_fields_are_checked_when_made(args, argument):
    with pytest.raises(InvalidArgument) as info:
        MultiModalItem(*args)
    assert info.value.argument == argument


def test_multimodal_list_is_kept_as_a_tuple():
    items = [MultiModalItem("img", 0, 4)]
    extra = ExtraKeys(multimodal=items)
    items.append(MultiModalItem("other", 4, 4))   # the caller's list changes after hashing
    assert extra.multimodal == (MultiModalItem("img", 0, 4),)
    hash(extra)


# -- overlapping multimodal items are refused -----------------------------------------------------

@pytest.mark.parametrize("items", [
    (MultiModalItem("a", 0, 4), MultiModalItem("b", 2, 4)),
    (MultiModalItem("b", 2, 4), MultiModalItem("a", 0, 4)),
    (MultiModalItem("a", 0, 4), MultiModalItem("a", 0, 4)),          # one item listed twice
    (MultiModalItem("a", 0, 10), MultiModalItem("b", 9, 1), MultiModalItem("c", 20, 1)),
])
def test_overlapping_multimodal_items_are_refused(items):
    # Two inputs cannot occupy one token position: such a list is a caller's bug (an item listed
    # twice, a wrong offset), and it used to be hashed as it came.
    with pytest.raises(InvalidArgument, match="overlap"):
        ExtraKeys(multimodal=items)


def test_adjacent_multimodal_items_are_fine():
    a, b = MultiModalItem("a", 0, 4), MultiModalItem("b", 4, 4)
    in_order = ExtraKeys(multimodal=(a, b))
    reversed_ = ExtraKeys(multimodal=(b, a))
    assert in_order.multimodal == reversed_.multimodal == (a, b)      # kept, in one order
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens(range(8))
    assert hasher.hash_blocks(tokens, 0, 2, None, in_order) == hasher.hash_blocks(tokens, 0, 2, None, reversed_)


# -- BlockHasher: an int block size; only the blocks the tokens fill are hashed --------------------

@pytest.mark.parametrize("size", [True, 4.0, "4"])
def test_block_size_must_be_an_int(size):
    # True was taken as a block size of 1; 4.0 failed later in struct.pack with "required argument
    # is not an integer".
    with pytest.raises(InvalidArgument) as info:
        BlockHasher(size, seed=0)
    assert info.value.argument == "block_size"


@pytest.mark.parametrize("extra", [ExtraKeys(), ExtraKeys(salt="s"),
                                   ExtraKeys(multimodal=(MultiModalItem("img", 0, 2),))])
def test_hash_blocks_refuses_blocks_the_tokens_do_not_fill(extra):
    # 6 tokens at block size 4 hold one full block; asking for two hashed the 2 leftover tokens
    # (or, with multimodal items, nothing at all) as if they were a full block.
    hasher = BlockHasher(4, seed=0)
    with pytest.raises(ValueError, match="full block"):
        hasher.hash_blocks(encode_tokens(range(6)), 0, 2, None, extra)
    with pytest.raises(ValueError):
        hasher.hash_blocks(encode_tokens(range(8)), 1, 0, None, extra)
    with pytest.raises(ValueError):
        hasher.hash_blocks(encode_tokens(range(8)), -1, 1, None, extra)
    assert len(hasher.hash_blocks(encode_tokens(range(6)), 0, 1, None, extra)) == 1


def test_a_prompt_claiming_more_tokens_than_it_holds_does_not_hash_a_partial_block():
    from prefixkv import Prompt

    hasher = BlockHasher(4, seed=0)
    prompt = Prompt(hasher, encode_tokens(range(6)), 8)
    with pytest.raises(ValueError):
        prompt.block_hashes()


# -- multimodal items: their order, and items past the prompt's tokens ----------------------------

def test_multimodal_item_order_does_not_change_the_hashes():
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens(range(8))
    x, y = MultiModalItem("x", 0, 2), MultiModalItem("y", 2, 2)
    in_order = hasher.hash_blocks(tokens, 0, 2, None, ExtraKeys(multimodal=(x, y)))
    reversed_ = hasher.hash_blocks(tokens, 0, 2, None, ExtraKeys(multimodal=(y, x)))
    assert in_order == reversed_


def test_prompt_refuses_multimodal_items_past_its_tokens():
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="dict")
    with pytest.raises(ValueError, match="multimodal"):
        mgr.prompt(list(range(8)), multimodal=[MultiModalItem("img", 8, 4)])


def test_multimodal_items_inside_the_prompt_are_taken():
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="dict")
    before = mgr.snapshot()
    with pytest.raises(ValueError, match="multimodal"):
        mgr.prompt(list(range(8)), multimodal=[MultiModalItem("img", 6, 4)])       # ends at 9
    assert mgr.snapshot() == before
    assert mgr.admit("a", mgr.prompt(list(range(8)), multimodal=[MultiModalItem("img", 4, 4)])) == 0


# -- framing: distinct extra-key sets never serialize alike ---------------------------------------

def test_distinct_extra_keys_give_distinct_digests():
    values = ["", "a", "ab", "c", "bc", "1", b"", b"a", b"1", 0, 1, -1, 255, 256, -256, 2**64, -(2**64), 2**64 - 1]
    keys = [ExtraKeys()]
    keys += [ExtraKeys(salt=v) for v in values]
    keys += [ExtraKeys(adapter=v) for v in values]
    keys += [ExtraKeys(salt=v, adapter=w) for v in values[:6] for w in values[:6]]
    keys += [ExtraKeys(multimodal=(MultiModalItem(v, s, n),)) for v in values for s, n in ((0, 1), (1, 1))]
    keys += [ExtraKeys(salt="a", multimodal=(MultiModalItem("b", 0, 1),)),
             ExtraKeys(salt="ab", multimodal=(MultiModalItem("", 0, 1),)),
             ExtraKeys(adapter="a", multimodal=(MultiModalItem("b", 0, 1),)),
             ExtraKeys(multimodal=(MultiModalItem("a", 0, 1), MultiModalItem("b", 1, 1))),
             ExtraKeys(multimodal=(MultiModalItem("ab", 2, 1),))]
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens(range(4))
    digests = {}
    for extra in keys:
        digest = hasher.hash_blocks(tokens, 0, 1, None, extra)[0]
        assert digests.setdefault(digest, extra) == extra, (extra, digests[digest])
    # and the bytes verification mode stores differ alike
    contents = {hasher.block_content(tokens, 0, extra) for extra in keys}
    assert len(contents) == len(set(keys))


@pytest.mark.parametrize("bad", [[True, 2], [2, False], [1] * 70 + [True], [2**32], [-1], [1.0]])
def test_token_ids_out_of_range_or_of_the_wrong_type_are_refused(bad):
    from prefixkv import InvalidTokens

    with pytest.raises(InvalidTokens):
        encode_tokens(bad)


def test_multimodal_item_length_is_part_of_the_hash():
    hasher = BlockHasher(4, seed=0)
    tokens = encode_tokens(range(4))
    short = hasher.hash_blocks(tokens, 0, 1, None, ExtraKeys(multimodal=(MultiModalItem("img", 0, 1),)))
    long = hasher.hash_blocks(tokens, 0, 1, None, ExtraKeys(multimodal=(MultiModalItem("img", 0, 4),)))
    assert short != long
