"""A duplicate taking over a hash, in every policy (arc, s3fifo, lrfu, workload, lfu, gdsf, slru, fifo).

The pool keeps one cached block per hash; a second physical copy of a hash (two sequences filled
the same content, or a fully cached prompt recomputed its last block) is an untracked duplicate. When the primary is evicted while the duplicate is in use, the duplicate
takes the hash over and the policy hears ``on_cached(duplicate)`` right after ``evict()``. The hash
never left the cache and no request missed it, so a ghost list must not count it as a comeback
(ARC's ``p`` moving, S3-FIFO's admission to M, LRFU's resumed score plus an access, workload's
reuse outcome 1): the hash's residency simply goes on in another block. A hash that really was
evicted and is cached again, even at once, is still a ghost hit. The policies without ghosts keep
the hash's history through a takeover (its weight, count, protection or turn), as they would had
the primary stayed.
"""

from __future__ import annotations

import pytest

from prefixkv import BlockPool
from prefixkv.policies import ARCPolicy, LRFUPolicy, S3FIFOPolicy, WorkloadPolicy

H = ("h",)


def _waiting_primary(pool, hit_first):
    """A block publishing H, released (after one hit if asked): a candidate holding H."""
    (p,) = pool.allocate(1)
    pool.publish(p, H, None, 0)
    pool.release([p])
    if hit_first:
        pool.acquire_hits([p])
        pool.release([p])
    return p


def _takeover(policy, hit_first=False):
    """A 2-block pool: P holds hash H and waits (hit once first if asked), D is an active
    duplicate of H; one more block is needed, so P is evicted and D takes H over."""
    pool = BlockPool(2, 4, policy)
    p = _waiting_primary(pool, hit_first)
    (d,) = pool.allocate(1)
    pool.publish(d, H, None, 0)
    assert pool.lookup(H) == p                     # D is a duplicate, unknown to the policy
    return pool, p, d


def _evict_primary(pool, p, d):
    (x,) = pool.allocate(1)
    assert x == p and pool.lookup(H) == d          # P went, D holds the hash now
    return x


def _return_at_once(policy, hit_first=False):
    """A 1-block pool: P holds H and waits; it is evicted for a block that publishes H again
    (no duplicate: the hash left the cache and came back)."""
    pool = BlockPool(1, 4, policy)
    p = _waiting_primary(pool, hit_first)
    (x,) = pool.allocate(1)
    assert x == p and pool.lookup(H) is None
    pool.publish(x, H, None, 0)
    return pool, x


@pytest.mark.parametrize("hit_first", [False, True])
def test_arc_takeover_is_no_ghost_hit(hit_first):
    policy = ARCPolicy()
    pool, p, d = _takeover(policy, hit_first)
    _evict_primary(pool, p, d)
    assert policy.p == 0.0                         # T1 was not found too small
    assert H not in policy._b1 and H not in policy._b2
    which = 2 if hit_first else 1                  # the residency goes on in the primary's list
    assert policy._list[d] == which and policy._size[which] == 1 and sum(policy._size) == 1
    pool.release([d])
    assert policy.evict() == d


def test_arc_immediate_return_is_still_a_ghost_hit():
    policy = ARCPolicy()
    pool, x = _return_at_once(policy)
    assert policy.p == 1.0 and policy._list[x] == 2 and H not in policy._b1


@pytest.mark.parametrize("hit_first", [False, True])
def test_s3fifo_takeover_is_no_ghost_hit(hit_first):
    policy = S3FIFOPolicy()
    pool, p, d = _takeover(policy, hit_first)
    _evict_primary(pool, p, d)
    assert H not in policy._ghost
    # P was hit: the eviction moved it to M (lazy promotion) and then evicted it there
    queue = 1 if hit_first else 0
    assert policy._queue[d] == queue and policy._freq[d] == 0
    assert policy._size == ([0, 1] if hit_first else [1, 0])


def test_s3fifo_takeover_gives_back_the_ghost_it_pushed_out():
    policy = S3FIFOPolicy()
    pool = BlockPool(3, 4, policy)                 # S targets 1 block, G holds 2 hashes
    for h in ("g1", "g2"):
        (b,) = pool.allocate(1)
        pool.publish(b, h, None, 0)
        pool.release([b])
    pool.release(pool.allocate(3))                 # both evicted from S: G = [g1, g2]
    assert list(policy._ghost) == ["g1", "g2"]
    (p,) = pool.allocate(1)
    pool.publish(p, H, None, 0)
    pool.release([p])
    (d,) = pool.allocate(1)
    pool.publish(d, H, None, 0)                    # a duplicate of H
    pool.allocate(1)                               # the free block
    _evict_primary(pool, p, d)                     # H's ghost pushed g1 out, for nothing
    assert list(policy._ghost) == ["g1", "g2"]


def test_s3fifo_immediate_return_is_still_a_ghost_hit():
    policy = S3FIFOPolicy()
    pool, x = _return_at_once(policy)
    assert policy._queue[x] == 1 and H not in policy._ghost


@pytest.mark.parametrize("hit_first", [False, True])
def test_lrfu_takeover_resumes_the_score_without_an_access(hit_first):
    policy = LRFUPolicy(ghost=4.0)
    pool, p, d = _takeover(policy, hit_first)
    score = policy._score[p]
    last = dict(policy._last)
    median = policy.median_reuse_distance
    _evict_primary(pool, p, d)
    assert policy._score[d] == score               # not bumped: no request asked for H
    assert H not in policy._ghosts
    assert policy._last == last and policy.median_reuse_distance == median


def test_lrfu_immediate_return_is_still_a_ghost_hit():
    policy = LRFUPolicy(ghost=4.0)
    pool, x = _return_at_once(policy)
    assert policy.crf(x) > 1.0 and H not in policy._ghosts


def test_workload_takeover_is_no_reuse():
    policy = WorkloadPolicy()
    pool, p, d = _takeover(policy)
    mean, estimates = policy.mean, dict(policy.estimates)
    _evict_primary(pool, p, d)
    assert policy.mean == mean and dict(policy.estimates) == estimates
    assert H not in policy._ghost


def test_workload_immediate_return_is_still_reuse():
    policy = WorkloadPolicy()
    mean = policy.mean
    _return_at_once(policy)
    assert policy.mean > mean and policy.estimates[H] > mean


# -- the policies without ghosts: a takeover keeps the hash's history, it is no fresh publish --------------
# lfu counted it as an access and dropped the hash's weight to 1, gdsf reset its count to 1, slru put a
# proven shared block back on probation, fifo sent the hash to the young end although it had been cached
# since the primary's publish.
def _hit_twice_then_takeover(policy):
    pool = BlockPool(3, 4, policy)
    (p,) = pool.allocate(1)
    pool.publish(p, H, None, 0)
    pool.release([p])
    for _ in range(2):
        pool.acquire_hits([p])
        pool.release([p])
    (q,) = pool.allocate(1)
    pool.publish(q, ("q",), None, 0)             # cached after H, never hit; stays in use
    (d,) = pool.allocate(1)
    pool.publish(d, H, None, 0)                  # a duplicate of H
    return pool, p, q, d


def test_lfu_takeover_keeps_the_weight():
    from prefixkv.policies import LFUPolicy

    policy = LFUPolicy(half_life=100)
    pool, p, q, d = _hit_twice_then_takeover(policy)
    weight, accesses = policy.weight(p), policy._accesses
    assert weight == 3.0
    _evict_primary(pool, p, d)
    assert policy.weight(d) == weight and policy._accesses == accesses
    pool.release([q])
    pool.release([d])
    assert policy.evict() == q                   # the frequent hash stays


def test_gdsf_takeover_keeps_the_count():
    from prefixkv.policies import GDSFPolicy

    policy = GDSFPolicy()
    pool, p, q, d = _hit_twice_then_takeover(policy)
    _evict_primary(pool, p, d)
    assert policy._freq[d] == 3
    pool.release([q])
    pool.release([d])
    assert policy.evict() == q


def test_slru_takeover_stays_protected():
    from prefixkv.policies import SLRUPolicy

    policy = SLRUPolicy()
    pool, p, q, d = _hit_twice_then_takeover(policy)
    _evict_primary(pool, p, d)
    assert policy._protected[d] and policy._num_protected == 1
    pool.release([d])
    pool.release([q])                            # released last, but on probation
    assert policy.evict() == q


def test_fifo_takeover_keeps_the_turn():
    from prefixkv.policies import FIFOPolicy

    policy = FIFOPolicy()
    pool, p, q, d = _hit_twice_then_takeover(policy)
    _evict_primary(pool, p, d)
    pool.release([q])
    pool.release([d])
    assert policy.evict() == d                   # H was cached before q


@pytest.mark.parametrize("name", ["fifo", "lfu", "slru", "gdsf", "arc", "s3fifo", "lrfu", "workload"])
def test_a_takeover_after_clear_or_a_fresh_publish_restarts(name):
    """The victim remembered for a takeover is the latest eviction's only until the next on_cached:
    a later promotion of the same hash (after it was published afresh) is not matched with it."""
    from prefixkv.policies import make_policy

    policy = make_policy(name)
    pool, x = _return_at_once(policy)            # H evicted, then published afresh
    assert policy._victim is None
    policy.clear()
    assert policy._victim is None
