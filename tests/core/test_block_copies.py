"""BlockCopies (the batches of block moves the manager hands to a KV store): joining, slicing and
taking them never aliases the parts or the manager's own state."""

from prefixkv import KVCacheManager
from prefixkv.copies import BlockCopies


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
