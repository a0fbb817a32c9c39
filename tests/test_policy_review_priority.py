"""PriorityPolicy's pins name hashes. A pin with a deadline (``ttl`` / ``until``) on a hash that is
not cached when it expires was never dropped: only the release of that hash's block looked at it.
A server pinning each conversation's prompt for a few minutes kept every pin it ever made. Expired
pins are now dropped as the clock passes them (at each event that reads the clock), so the table
holds the live pins only; pinning for good is unchanged."""

from __future__ import annotations

from prefixkv import BlockPool
from prefixkv.policies import LRUPolicy, PriorityPolicy


def cache_one(pool, block_hash):
    """Allocate a block, publish ``block_hash`` in it and release it (an event that reads the clock)."""
    (block,) = pool.allocate(1)
    pool.publish(block, block_hash, None, 0)
    pool.release([block])


def test_expired_pins_of_uncached_hashes_are_dropped():
    now = [0.0]
    policy = PriorityPolicy(LRUPolicy(), clock=lambda: now[0])
    pool = BlockPool(4, 4, policy)
    for i in range(1000):
        now[0] = float(i)
        policy.pin(("conv", i), ttl=5.0)          # never cached
        cache_one(pool, ("blk", i))
    assert len(policy._pins) <= 6
    assert policy.is_pinned(("conv", 999)) and not policy.is_pinned(("conv", 990))
    policy.pin("forever")
    for i in range(1000, 1100):
        now[0] = float(i)
        cache_one(pool, ("blk", i))
    assert policy.is_pinned("forever")


def test_a_repinned_hash_keeps_its_latest_deadline():
    now = [0.0]
    policy = PriorityPolicy(LRUPolicy(), clock=lambda: now[0])
    pool = BlockPool(2, 4, policy)
    policy.pin("h", ttl=1.0)
    policy.pin("h", ttl=10.0)
    for i in range(1, 6):
        now[0] = float(i)
        cache_one(pool, ("blk", i))
    assert policy.is_pinned("h")
    policy.unpin("h")
    assert not policy.is_pinned("h")
    now[0] = 20.0
    pool.allocate(1)
    assert policy._pins == {}
