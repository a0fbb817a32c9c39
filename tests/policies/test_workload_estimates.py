"""The workload policy keeps one reuse estimate per class (prefix root). A trace whose requests
start new roots (Mooncake-style hash chains: 2,211 roots in the 3,993 requests of the synthetic
trace) grew that table by one entry per root for the whole run, whatever the pool held. It is now
bounded (the least recently used estimates go first, 64 per pool block: far more than the classes
with a cached block or a ghost, at most 5 per block), and a class whose estimate was dropped
starts again from the running mean."""

from __future__ import annotations

from prefixkv import BlockPool
from prefixkv.policies import WorkloadPolicy


def test_estimates_stay_bounded_with_ever_new_roots():
    policy = WorkloadPolicy()
    pool = BlockPool(4, 4, policy)
    for h in range(2000):
        (block,) = pool.allocate(1)
        pool.publish(block, ("root", h), None, 0)
        pool.release([block])
    assert len(policy.estimates) <= 64 * pool.num_blocks
    # every candidate's class still ranks (a dropped estimate reads as the running mean)
    for block in range(pool.num_blocks):
        assert 0.0 <= policy.predicted_reuse(block) <= 1.0
    for _ in range(4):
        pool.allocate(1)


def test_a_recent_class_keeps_its_estimate():
    policy = WorkloadPolicy(rate=0.5)
    pool = BlockPool(4, 4, policy)
    hot = ("root", "hot")
    for h in range(1000):
        (block,) = pool.allocate(1)
        pool.publish(block, hot if h % 3 == 0 else ("root", h), None, 0)
        pool.release([block])
    assert hot in policy.estimates
    assert len(policy.estimates) <= 64 * pool.num_blocks
