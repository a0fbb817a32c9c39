"""Defects found reviewing the pool's and the manager's fast paths: each test failed before its fix."""

import pytest

from prefixkv import HashMismatch, KVCacheManager


# -- append_slots let a sequence's hash chain repeat one hash -----------------------------------------
def test_append_slots_refuses_a_hash_the_sequence_already_holds():
    """resume / swap_in match a sequence by its own hashes, counting the blocks as distinct: a
    repeated hash held block 0 twice on one reference ('refcount 1 but held by 2 block tables')."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0)
    mgr.admit("a", mgr.prompt_from_hashes([1, 2], 8))
    before = mgr.snapshot()
    with pytest.raises(HashMismatch, match="repeats"):
        mgr.append_slots("a", 5, [1])
    assert mgr.snapshot() == before
    mgr.append_slots("a", 5, [3])
    mgr.preempt("a")
    assert mgr.resume("a") == 1
    mgr.check_invariants()
