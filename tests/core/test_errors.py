"""Typed errors keep their message and fields across pickling (process pools send them back)."""

import pickle

import pytest

from prefixkv import (DuplicateSequence, InvalidArgument, KVCacheManager, OutOfBlocks, SequencePreempted,
                      SequenceTooLong, UnknownSequence)
from prefixkv.console import OFF_TERMINAL_WIDTH, make_console
from prefixkv.sim.traces import TraceFormatError


@pytest.mark.parametrize("error,fields", [
    (OutOfBlocks(5, 2, "admission"), ("needed", "available")),
    (SequenceTooLong(90, 64, "request 'r'"), ("needed", "capacity")),
    (UnknownSequence("s", "never admitted or already freed"), ("seq_id",)),
    (SequencePreempted("s"), ("seq_id",)),
    (DuplicateSequence("s"), ("seq_id",)),
    (TraceFormatError("trace.jsonl", 7, "missing field 'hash_ids'"), ("path", "line", "problem")),
])
def test_errors_survive_pickling(error, fields):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    for name in fields:
        assert getattr(copy, name) == getattr(error, name)


def test_a_preempted_sequence_is_not_reported_unknown():
    mgr = KVCacheManager(8, 4, hash_seed=0)
    mgr.admit("a", list(range(6)))
    mgr.preempt("a")
    with pytest.raises(SequencePreempted, match="'a' is preempted; resume it first") as exc:
        mgr.append("a", [1])
    assert not isinstance(exc.value, KeyError)


@pytest.mark.parametrize("args,argument,message", [
    ((2.5, 16), "num_blocks", r"num_blocks: must be an integer, got float 2\.5"),
    ((8, "16"), "block_size", "block_size: must be an integer, got str '16'")])
def test_manager_refuses_non_integer_sizes(args, argument, message):
    # an InvalidArgument naming the size, still a TypeError as before
    with pytest.raises(TypeError, match=message) as info:
        KVCacheManager(*args)
    assert isinstance(info.value, InvalidArgument) and info.value.argument == argument


def test_manager_refuses_belady_by_name():
    with pytest.raises(ValueError, match="only a trace replay knows"):
        KVCacheManager(8, 4, policy="belady")


def test_prompts_move_between_managers_with_the_same_hashing_only():
    a, b = KVCacheManager(8, 4, hash_seed=1), KVCacheManager(8, 4, hash_seed=1)
    prompt = a.prompt(list(range(9)))
    assert b.admit("x", prompt) == 0 and b.admit("y", prompt) == 8
    other = KVCacheManager(8, 4, hash_seed=2)
    with pytest.raises(ValueError, match="4 / xxh3_128 / 1 here 4 / xxh3_128 / 2"):
        other.admit("x", prompt)


def test_off_terminal_console_is_wide():
    console = make_console()
    assert not console.is_terminal and console.width >= OFF_TERMINAL_WIDTH


class Boom(Exception):
    pass


def _broken_lru(evict):
    from prefixkv.policies import LRUPolicy

    class Broken(LRUPolicy):
        name = "broken"

    Broken.evict = evict
    return Broken()


def test_an_evict_that_raises_leaves_the_manager_consistent():
    from prefixkv import PolicyError

    def evict(self):
        raise Boom("policy bug")

    mgr = KVCacheManager(4, 4, policy=_broken_lru(evict), hash_seed=0)
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    with pytest.raises(PolicyError, match=r"'broken' raised in evict\(\): Boom: policy bug"):
        mgr.admit("b", list(range(100, 116)))
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.sequences == 0 and stats.active_blocks == 0
    assert stats.free_uncached_blocks + stats.evictable_blocks == 4


def test_an_evict_that_returns_a_non_candidate_is_refused():
    from prefixkv import PolicyError

    def evict(self):
        self.evict_many(1)      # the LRU victim is taken, then a block id that is no candidate returned
        return 10_000

    mgr = KVCacheManager(2, 4, policy=_broken_lru(evict), hash_seed=0)
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    with pytest.raises(PolicyError, match="returned 10000 from evict"):
        mgr.admit("b", list(range(100, 108)))


# -- issue 12, item 9: library misuse gets typed errors naming the argument -------------------------------
def test_a_string_hash_seed_names_the_argument():
    from prefixkv.errors import InvalidArgument
    from prefixkv.hashing import BlockHasher

    with pytest.raises(InvalidArgument, match="hash_seed") as info:
        KVCacheManager(8, 4, hash_seed="x")
    assert info.value.argument == "hash_seed" and isinstance(info.value, TypeError)
    with pytest.raises(InvalidArgument, match="seed"):
        BlockHasher(4, seed="x")
    with pytest.raises(InvalidArgument, match="hash_seed"):
        KVCacheManager(8, 4, hash_seed=True)


@pytest.mark.parametrize("prompt,argument", [
    ({1: 2, 3: 4, 5: 6}, "prompt"),
    ({1, 2, 3}, "prompt"),
    ("abcd", "prompt"),
    (b"\x01\x02\x03\x04", "prompt"),
    ([True, 1, 2, 3], "prompt"),
    (lambda: (t for t in [1, False, 3]), "prompt"),
    (5, "prompt"),
])
def test_a_prompt_that_is_not_token_ids_is_refused(prompt, argument):
    from prefixkv.errors import InvalidTokens

    fresh = prompt if callable(prompt) else (lambda: prompt)   # a generator is spent by one call
    mgr = KVCacheManager(8, 4, hash_seed=0)
    before = mgr.snapshot()
    with pytest.raises(InvalidTokens, match=f"^{argument}: "):
        mgr.admit("a", fresh())
    with pytest.raises(InvalidTokens, match=f"^{argument}: "):
        mgr.match(fresh())
    assert mgr.snapshot() == before and "a" not in mgr


def test_a_bool_token_is_refused_in_every_token_path():
    from prefixkv.errors import InvalidTokens

    mgr = KVCacheManager(8, 4, hash_seed=0)
    with pytest.raises(InvalidTokens, match="^tokens: token 1 is a bool"):
        mgr.prompt([1, True])
    mgr.admit("a", [1, 2, 3])
    before = mgr.snapshot()
    with pytest.raises(InvalidTokens, match="bool"):
        mgr.append("a", [False])
    with pytest.raises(InvalidTokens, match="bool"):
        mgr.append_token("a", True)
    with pytest.raises(InvalidTokens, match="bool"):
        mgr.decode_step(["a"], [True])
    assert mgr.snapshot() == before


def test_none_is_not_a_sequence_id():
    from prefixkv.errors import InvalidArgument

    mgr = KVCacheManager(8, 4, hash_seed=0)
    with pytest.raises(InvalidArgument, match="^seq_id: None") as info:
        mgr.admit(None, [1, 2, 3])
    assert info.value.argument == "seq_id" and None not in mgr
    with pytest.raises(InvalidArgument, match="^seq_id: .*hashable"):
        mgr.admit([1], [1, 2, 3])
    mgr.admit("a", [1, 2, 3])
    before = mgr.snapshot()
    with pytest.raises(InvalidArgument, match="^child_id: None"):
        mgr.fork("a", None)
    assert mgr.snapshot() == before


def test_swap_out_without_host_blocks_says_so():
    from prefixkv.errors import NoHostBlocks

    mgr = KVCacheManager(8, 4, hash_seed=0)
    mgr.admit("a", [1, 2, 3, 4, 5])
    before = mgr.snapshot()
    with pytest.raises(NoHostBlocks, match="num_host_blocks") as info:
        mgr.swap_out("a")
    assert not isinstance(info.value, SequenceTooLong)
    assert mgr.snapshot() == before
    small = KVCacheManager(8, 4, hash_seed=0, num_host_blocks=1)
    small.admit("a", [1, 2, 3, 4, 5])
    with pytest.raises(SequenceTooLong, match="host"):   # too long for the host space there is
        small.swap_out("a")


def test_new_errors_survive_pickling():
    from prefixkv.errors import InvalidArgument, NoHostBlocks

    for error in (InvalidArgument("seq_id", "None is not a sequence id"), NoHostBlocks("none")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(InvalidArgument("a", "b"))).argument == "a"
