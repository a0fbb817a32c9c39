"""PriorityPolicy's pins name hashes. A pin with a deadline (``ttl`` / ``until``) is dropped as the
clock passes it (at each event that reads the clock), whether or not its hash is cached then, so
the table holds the live pins only: a server pinning each conversation's prompt for a few minutes
does not keep every pin it ever made. Pinning for good is unchanged. A deadline that is not a
number (NaN, a string, both ``ttl`` and ``until``) or a minimum priority that is not an int is
refused, and the policy is left as it was."""

from __future__ import annotations

import pytest

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


# -- bad deadlines and minimum priorities ------------------------------------------------------------

H = ("h",)


def test_priority_refuses_a_nan_deadline_and_a_non_int_min_priority():
    from prefixkv.errors import InvalidArgument
    from prefixkv.policies import LRUPolicy, PriorityPolicy

    with pytest.raises(InvalidArgument) as info:
        PriorityPolicy(LRUPolicy(), min_priority="2")
    assert info.value.argument == "min_priority"
    policy = PriorityPolicy(LRUPolicy())
    BlockPool(4, 4, policy)
    before = policy.snapshot()
    for kwargs in ({"ttl": float("nan")}, {"until": float("nan")}, {"until": "soon"}, {"ttl": 1.0, "until": 2.0}):
        with pytest.raises(InvalidArgument):
            policy.pin(H, **kwargs)
        assert policy.snapshot() == before and not policy.is_pinned(H)
    policy.pin(H, until=float("inf"))            # for good, as pin(H)
    assert policy.is_pinned(H)
