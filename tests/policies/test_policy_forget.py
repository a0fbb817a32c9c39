"""Blocks taken up a tier (``BlockPool.take_cached`` / ``forget``: an exclusive host tier's hit)
lose their hash while active, and the policy hears no event for it: only, later, ``on_cached``
of the same block under another hash. A policy's per-block accounting (list sizes, child
counts) must not keep the forgotten residency: after any number of take-ups, the policy must
order the remaining blocks exactly as a policy that never saw the forgotten blocks."""

from __future__ import annotations

import random

import pytest

from prefixkv import BlockPool
from prefixkv.policies import make_policy

NAMES = ["arc", "s3fifo", "slru", "leaf-lru", "lrfu", "lfu", "fifo", "gdsf", "workload"]


def _cycle(pool, rng, next_hash, chains):
    """Cache one chain of 1-3 blocks (rooted at an old hash sometimes), release it; then take
    one random candidate up (hit + forget) and free it uncached."""
    n = rng.randrange(1, 4)
    blocks = pool.allocate(n)
    parent = None
    depth = 0
    if chains and rng.random() < 0.5:
        parent, depth = rng.choice(chains)
    for block in blocks:
        h = next_hash()
        pool.publish(block, h, parent, depth)
        chains.append((h, depth + 1))
        parent, depth = h, depth + 1
    pool.release(list(reversed(blocks)))


@pytest.mark.parametrize("name", NAMES)
def test_taken_up_blocks_leave_no_accounting_behind(name):
    rng = random.Random(0)
    pool = BlockPool(16, 4, make_policy(name))
    counter = iter(range(10**9))
    chains: list = []
    for step in range(3000):
        _cycle(pool, rng, lambda: next(counter), chains)
        if len(chains) > 40:
            del chains[:20]
        cached = [b for b, h in enumerate(pool.block_hash) if h is not None and not pool.ref_count[b]]
        if cached and rng.random() < 0.5:
            block = rng.choice(cached)
            pool.take_cached([block])
            pool.release([block])   # freed uncached
        check(name, pool)


def check(name, pool):
    """Per-block state may outlive a taken-up residency only until the block is cached again
    (no event announces the take-up): it stays within the pool, and every count agrees with it."""
    policy = pool.policy
    cached = {b for b, h in enumerate(pool.block_hash) if h is not None}
    n = pool.num_blocks
    if name == "arc":
        assert cached <= set(policy._list)
        assert policy._size[1] + policy._size[2] == len(policy._list) <= n
    elif name == "s3fifo":
        assert cached <= set(policy._queue)
        assert sum(policy._size) == len(policy._queue) <= n
    elif name == "slru":
        assert cached <= set(policy._protected)
        assert policy._num_protected == sum(policy._protected.values()) and len(policy._protected) <= n
    elif name == "leaf-lru":
        assert cached <= set(policy._hash) and len(policy._hash) <= n
        assert sum(policy._children.values()) == len(policy._parent)
    elif name == "lrfu":
        assert cached <= set(policy._score) and len(policy._score) <= n
        assert sum(policy._kids.values()) == len(policy._parent_of)
    elif name == "gdsf":
        assert cached <= set(policy._hash) and len(policy._hash) <= n
        assert len(policy._chain) <= n


@pytest.mark.parametrize("name", NAMES)
def test_an_exclusive_host_tier_runs_every_policy(name):
    """``host_policy="arc"`` raised KeyError ('dictionary is empty') within ~50 requests: each
    host hit leaked a block into |T1| + |T2| until the ghost trim ran out of ghosts."""
    from prefixkv import KVCacheManager

    rng = random.Random(1)
    mgr = KVCacheManager(num_blocks=8, block_size=4, policy="lru", hash_seed=0, num_host_blocks=16,
                         host_cache=True, host_policy=name)
    prompts = [[rng.randrange(50) for _ in range(12)] for _ in range(30)]
    for i in range(1500):
        try:
            mgr.admit(i, rng.choice(prompts))
        except Exception as exc:
            assert type(exc).__name__ == "OutOfBlocks"
            continue
        mgr.take_demotions()
        mgr.take_loads()
        mgr.free(i)
        mgr.check_invariants()
    assert mgr.stats().host_hit_tokens > 0
    check(name, mgr.host.pool)
