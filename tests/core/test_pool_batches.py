"""The pool's batch operations for tiers (issue 13) end in exactly the state of the block-by-block
calls they stand for: ``cache_many`` = allocate + publish + release, ``take_cached`` =
acquire_hits + forget of the evictable ones, ``publish_many`` = publish each, a release of
uncached blocks = the free list in order, and ``on_evict_many`` sees every victim before it is
reused. Every policy that can run without an oracle, from random histories (duplicate and
already-cached hashes included)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.policies import BUILTIN_POLICIES, make_policy
from prefixkv.pool import BlockPool

POLICIES = [name for name in BUILTIN_POLICIES if name != "belady"]
N = 24


def history(seed: int, policy: str, *, keep_chain: bool = False):
    """Two pools with one random history: cached evictable blocks, held blocks, free ones."""
    pools = []
    for _ in range(2):
        pool = BlockPool(N, 4, make_policy(policy))
        pool.keep_chain = pool.keep_chain or keep_chain
        pools.append(pool)
    rng = random.Random(seed)
    held: list[int] = []
    for step in range(rng.randrange(1, 8)):
        for pool in pools:
            rng_step = random.Random(seed * 1000 + step)
            k = rng_step.randrange(1, 5)
            if pool.num_free < k:
                continue
            blocks = pool.allocate(k, 4)
            hashes = [f"h{seed}-{step}-{i}".encode() for i in range(k)]
            pool.publish_run(blocks, hashes, None, 0)
            if rng_step.random() < 0.3:
                if pool is pools[0]:
                    held.extend(blocks)
            else:
                pool.release(blocks[::-1])
    return pools, held


def same_state(a: BlockPool, b: BlockPool) -> bool:
    """Snapshots equal; parent hashes and depths only where the pool keeps them (a pool whose
    policy never reads them skips storing them in its batch paths, documented in BlockPool)."""
    sa, sb = a.snapshot(), b.snapshot()
    if not a.keep_chain:
        sa, sb = sa[:3] + sa[5:], sb[:3] + sb[5:]
    return sa == sb


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(POLICIES), st.booleans(), st.integers(1, 8))
def test_cache_many_is_allocate_publish_release(seed, policy, keep_chain, n):
    (a, b), held = history(seed, policy, keep_chain=keep_chain)
    if a.num_free < n:
        return
    rng = random.Random(seed)
    known = [h for h in a.cached_map if rng.random() < 0.2][:min(2, n)]  # already cached: duplicates
    hashes = known + [f"new-{seed}-{i}".encode() for i in range(n - len(known))]
    if n > 2:
        hashes[-1] = hashes[-2]                                          # twice in one batch
    parents = [None] + hashes[:-1]
    depths = list(range(n))
    got_a = a.cache_many(hashes, parents, depths)
    got_b = b.allocate(n)
    for block in got_b:
        b.num_tokens[block] = b.block_size
    for block, h, parent, depth in zip(got_b, hashes, parents, depths):
        b.publish(block, h, parent, depth)
    b.release(got_b)
    assert got_a == got_b
    assert same_state(a, b)
    a.check([held])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(POLICIES))
def test_take_cached_is_acquire_then_forget(seed, policy):
    (a, b), _ = history(seed, policy)
    evictable = [blk for blk in a.cached_map.values() if not a.ref_count[blk]]
    if not evictable:
        return
    rng = random.Random(seed)
    blocks = rng.sample(evictable, rng.randrange(1, len(evictable) + 1))
    a.take_cached(blocks)
    b.acquire_hits(blocks)
    for block in blocks:
        b.forget(block)
    assert same_state(a, b)
    assert a.forgotten == b.forgotten == len(blocks)
    # released again: uncached, so back to the free list in release order
    a.release(blocks)
    for block in blocks:
        b._release((block,), 0)
    assert same_state(a, b)


@pytest.mark.parametrize("policy", POLICIES)
def test_publish_many_matches_one_by_one(policy):
    for seed in range(20):
        (a, b), held = history(seed, policy, keep_chain=True)
        if not held:
            continue
        for pool in (a, b):          # held blocks without a hash, to publish again
            for block in held:
                pool.forget(block)
        assert a.snapshot() == b.snapshot()
        hashes = [f"again-{seed}-{i}".encode() for i in range(len(held))]
        a.publish_many(held, hashes, [None] * len(held), list(range(len(held))))
        for i, (block, h) in enumerate(zip(held, hashes)):
            b.publish(block, h, None, i)
        assert a.snapshot() == b.snapshot()


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "lrfu"])
def test_on_evict_many_sees_every_victim_before_reuse(policy):
    pool = BlockPool(8, 4, make_policy(policy))
    seen = []

    def hook(blocks, hashes):
        for block, h in zip(blocks, hashes):
            assert pool.ref_count[block] == 0 and h in hashes_published   # not reused yet
            seen.append((block, h))

    pool.on_evict_many = hook
    first = pool.allocate(8, 4)
    hashes_published = [b"a%d" % i for i in range(8)]
    pool.publish_run(first, hashes_published, None, 0)
    pool.release(first[::-1])
    again = pool.allocate(5, 4)
    assert sorted(b for b, _ in seen) == sorted(again) and pool.evictions == 5
    assert all(hashes_published[b] == h for b, h in seen)
    assert all(pool.block_hash[b] is None for b in again)
