"""Review of hashing.py, prompt.py and sim/workloads.py: each test pins one defect that was found
(or, as xfail strict, one whose fix lies outside those files or would change digests).

Digest pins first: no fix here may change a hash of an input that was accepted and well formed, except
the multimodal one: an item's length is hashed since (it was a collision; see the test below).

Fixed: extra keys of a type the hasher cannot encode accepted when made, failing in match/admit;
overlapping multimodal items accepted; BlockHasher taking True / 4.0 as a block size; hash_blocks
hashing leftover tokens as a full block; WorkloadConfig seed=None (a different trace per call);
session_rate=inf hanging the generator; int fields taking floats/bools, vocab_size past 2**32;
empty system prompts (zero-length requests); malformed mix entries.
Fixed by the lead: a multimodal item's length was not hashed (a collision).
Fixed by the lead: mgr.prompt accepting multimodal items past its tokens; multimodal item order
changing digests (items are kept sorted by start).
"""

import math

import pytest
import xxhash

from prefixkv import BlockHasher, ExtraKeys, KVCacheManager, MultiModalItem
from prefixkv.errors import InvalidArgument
from prefixkv.hashing import encode_tokens
from prefixkv.sim.workloads import WorkloadConfig, generate_requests

# -- digest pins (taken before any fix of this review) --------------------------------------------

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


# -- extra keys of a type the hasher cannot encode were accepted, failing later -------------------

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


# -- overlapping multimodal items were accepted ----------------------------------------------------

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


# -- BlockHasher: a bool or float block size; blocks past the tokens hashed as if full -------------

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


# -- workload generator ---------------------------------------------------------------------------

SMALL = WorkloadConfig(name="review", num_requests=12)


def _field_error(field, **kwargs):
    with pytest.raises(ValueError) as info:
        WorkloadConfig(**kwargs)
    assert field in str(info.value), str(info.value)


@pytest.mark.parametrize("seed", [None, True, -1, 1.5, "0"])
def test_workload_seed_must_be_a_non_negative_int(seed):
    # seed=None was accepted and seeded numpy from the OS: a different trace on every call, with
    # "seed": null in the header of a file that promises "same config, same bytes".
    _field_error("seed", seed=seed)


def test_workload_with_a_fixed_seed_is_deterministic():
    from dataclasses import replace

    a, b = generate_requests(SMALL), generate_requests(replace(SMALL))
    assert [(r.timestamp, r.tokens, r.output_tokens, r.session) for r in a] == \
        [(r.timestamp, r.tokens, r.output_tokens, r.session) for r in b]


@pytest.mark.parametrize("field", ["session_rate", "think_time", "tool_time", "agent_think_time",
                                   "chat_turns", "agent_steps", "agent_turns"])
def test_workload_rates_times_and_means_must_be_finite(field):
    # session_rate=inf drew every session gap as 0.0: the loop that waits for a session to start
    # after the n-th request never ended (generate_requests hung). chat_turns/agent_steps/agent_turns
    # = inf failed in numpy ("p <= 0, p > 1 or p contains NaNs") without naming the field; an
    # infinite time wrote Infinity (not JSON) into the header.
    _field_error(field, **{field: math.inf})


@pytest.mark.parametrize("field", ["session_rate", "think_time", "chat_turns", "tenant_zipf"])
def test_workload_float_fields_must_be_numbers(field):
    _field_error(field, **{field: "4"})


@pytest.mark.parametrize("field,value", [
    ("num_requests", 2.5),        # failed later: "list indices must be integers"
    ("num_requests", True),       # taken as 1
    ("vocab_size", 2.5),          # token ids drawn from [0, 2) while the header said 2.5
    ("block_size", 2.5),          # written into the header, refused by the loader
    ("num_tenants", 2.5),
    ("templates_per_tenant", 2.5),
    ("user_tokens", (1.5, 3)),    # a float bound was accepted
    ("user_tokens", (False, True)),
    ("vocab_size", 2**32 + 1),    # token ids the hasher and the trace loader refuse
])
def test_workload_counts_must_be_ints_in_range(field, value):
    _field_error(field, **{field: value})


def test_workload_vocab_of_2_pow_32_is_the_largest():
    assert WorkloadConfig(vocab_size=2**32).vocab_size == 2**32
    _field_error("vocab_size", vocab_size=2**32 + 1)


def test_workload_never_writes_an_empty_prompt():
    # The check "system prompts need at least one token" looked at the upper bound only: with
    # (0, 1) a tenant's system prompt could be empty, and with empty questions so was the request.
    _field_error("system_prompt_tokens", system_prompt_tokens=(0, 1), question_tokens=(0, 0),
                 mix=(("oneshot", 1.0),))
    requests = generate_requests(WorkloadConfig(num_requests=30, system_prompt_tokens=(1, 1),
                                                question_tokens=(0, 0), mix=(("oneshot", 1.0),)))
    assert min(r.input_length for r in requests) == 1


@pytest.mark.parametrize("mix", [
    (("chat",),),                 # ValueError "not enough values to unpack"
    (("chat", math.inf),),        # probabilities became NaN inside numpy
    (("chat", "1"),),
    (("chat", True),),
    "chat",
])
def test_workload_mix_entries_are_kind_weight_pairs(mix):
    _field_error("mix", mix=mix)


# -- found, not fixed here (xfail strict) ---------------------------------------------------------

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


# -- framing: distinct extra-key sets never serialize alike (regression; these all held) -----------

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
