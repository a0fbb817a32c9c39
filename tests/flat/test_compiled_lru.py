"""``CompiledLRU`` (the LRU a flat pool runs for "lru", kept in arrays) against ``LRUPolicy``.

* Driven alone through the policy protocol (no pool), the two give the same order, length,
  membership and victims after every event, including bursts that empty the order.
* The protocol check every policy passes (``check_policy``), and a manager or host tier built with
  ``policy="lru"`` on a flat index runs it (the same figures as ``LRUPolicy`` on the dict index are
  checked by ``tests/flat/test_flat_pool.py``'s lockstep machine and the manager tests).
* The pool's compiled batches: a batch they refuse (a block not evictable, listed twice, out of
  range) ends as on the dict pool; the links are checked by ``snapshot``.
"""

import pytest

pytest.importorskip("numba")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.copies import BlockCopies  # noqa: E402
from prefixkv.flat.lru import CompiledLRU  # noqa: E402
from prefixkv.flat.pool import FlatBlockPool  # noqa: E402
from prefixkv.policies import check_policy  # noqa: E402
from prefixkv.policies.lru import LRUPolicy  # noqa: E402
from prefixkv.pool import BlockPool  # noqa: E402

BLOCKS = 24

EVENTS = st.lists(st.one_of(
    st.tuples(st.just("release"), st.lists(st.integers(0, BLOCKS - 1), max_size=6, unique=True)),
    st.tuples(st.just("hit"), st.integers(0, BLOCKS - 1)),
    st.tuples(st.just("hit_batch"), st.lists(st.integers(0, BLOCKS - 1), max_size=6, unique=True)),
    st.tuples(st.just("evict"), st.integers(0, 8)),
    st.tuples(st.just("clear"), st.none()),
), max_size=60)


def _state(policy):
    return policy.snapshot(), len(policy), [b in policy for b in range(-1, BLOCKS + 1)]


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_same_order_and_victims_as_lru_policy(events):
    ref, fast = LRUPolicy(), CompiledLRU()
    ref.on_grow(BLOCKS)
    fast.on_grow(BLOCKS)
    for kind, arg in events:
        evictable = set(ref.snapshot())
        if kind == "release":
            blocks = [b for b in arg if b not in evictable]      # (the pool releases a block once)
            ref.on_released_batch(blocks)
            fast.on_released_batch(blocks)
        elif kind == "hit":
            was = arg in evictable
            ref.on_hit(arg, was)
            fast.on_hit(arg, was)
        elif kind == "hit_batch":
            blocks = [b for b in arg if b in evictable]
            ref.on_hit_batch(blocks)
            fast.on_hit_batch(blocks)
        elif kind == "evict":
            k = min(arg, len(evictable))
            assert fast.evict_many(k) == ref.evict_many(k)
            if len(ref):
                assert fast.evict() == ref.evict()
        else:
            ref.clear()
            fast.clear()
        assert _state(fast) == _state(ref)


def test_evicting_more_than_it_holds_is_refused():
    lru = CompiledLRU()
    lru.on_released_batch([3, 1])
    with pytest.raises(IndexError):
        lru.evict_many(3)
    assert lru.snapshot() == (3, 1)


def test_it_passes_the_policy_check():
    report = check_policy(CompiledLRU)
    assert report.evictions > 0


def test_managers_and_host_tiers_run_it_by_name():
    mgr = KVCacheManager(64, 4, hash_seed=0, num_host_blocks=64, host_cache=True, index="flat")
    assert type(mgr.pool.policy) is CompiledLRU and type(mgr.host.pool.policy) is CompiledLRU
    mine = LRUPolicy()
    mgr = KVCacheManager(64, 4, hash_seed=0, policy=mine, index="flat")
    assert mgr.pool.policy is mine           # a policy object given is kept as it is
    assert type(KVCacheManager(64, 4, hash_seed=0, index="dict").pool.policy) is LRUPolicy


def _pool(n=16, flat=True):
    pool = FlatBlockPool(n, 4, CompiledLRU(), digest_size=16) if flat else BlockPool(n, 4, LRUPolicy())
    blocks = pool.allocate(6, 4)
    pool.publish_run(blocks, [bytes([i]) * 16 for i in range(6)], None, 0)
    pool.release(blocks[::-1])
    return pool, blocks


def _outcome(pool, call):
    try:
        call(pool)
    except Exception as exc:
        return type(exc).__name__, pool.snapshot()
    return "ok", pool.snapshot()


@pytest.mark.parametrize("call", [
    lambda p, b: p.take_cached([b[0], b[0]]),          # listed twice
    lambda p, b: p.take_cached([b[0], 15]),            # 15 was never handed out (not evictable)
    lambda p, b: p.acquire_hits([b[1], b[1], b[2]]),
    lambda p, b: p.release([b[3]]),                    # not held
    lambda p, b: p.release([]),
    lambda p, b: p.take_cached([b[2], 99]),            # out of range
], ids=["take-twice", "take-uncached", "hit-twice", "release-unheld", "release-none", "take-out-of-range"])
def test_batches_the_kernels_refuse_end_as_on_the_dict_pool(call):
    """A batch the compiled path refuses falls back to the base class's paths: the same result (or
    error) and the same state as the dict pool with ``LRUPolicy``."""
    (flat, fb), (ref, rb) = _pool(), _pool(flat=False)
    assert fb == rb
    assert _outcome(flat, lambda p: call(p, fb)) == _outcome(ref, lambda p: call(p, rb))


def test_pool_batches_keep_the_lru_order():
    pool, blocks = _pool()
    assert pool.policy.snapshot() == tuple(blocks[::-1])
    pool.acquire_hits(blocks[1:4], distinct=True)            # a run out of the middle
    assert pool.policy.snapshot() == (blocks[5], blocks[4], blocks[0])
    pool.release(blocks[1:4][::-1])
    assert pool.policy.snapshot() == (blocks[5], blocks[4], blocks[0], blocks[3], blocks[2], blocks[1])
    got = pool.allocate(12)           # 10 free blocks, then the two least recent evictable ones
    assert got[-2:] == [blocks[5], blocks[4]] and pool.evictions == 2
    pool.check([got])


def test_block_copies_read_as_the_list_of_pairs():
    copies = BlockCopies([3, 1], [0, 2])
    assert copies == [(3, 0), (1, 2)] and list(copies) == [(3, 0), (1, 2)] and copies[1] == (1, 2)
    assert copies[1:] == [(1, 2)] and len(BlockCopies.join([copies, copies])) == 4
    assert BlockCopies() == [] and not BlockCopies()
    with pytest.raises(ValueError):
        BlockCopies([1], [])


def _host_pool():
    pool = FlatBlockPool(64, 4, CompiledLRU(), digest_size=16)
    blocks = pool.allocate(40)
    pool.release(blocks)                 # forty free-uncached blocks on the stack
    pool.cache_run([bytes([100]) * 16], [None], [0])
    return pool


def _hashes(first, n):
    return [bytes([first + i]) * 16 for i in range(n)]


def test_cache_new_run_of_a_hash_already_here_changes_nothing():
    pool = _host_pool()
    before = pool.snapshot()
    assert pool.cache_new_run(_hashes(1, 20) + [bytes([100]) * 16]) is None
    assert pool.snapshot() == before


def test_cache_new_run_does_what_cache_run_does():
    hashes = _hashes(1, 20)
    fast, slow = _host_pool(), _host_pool()
    assert fast.cache_new_run(hashes).tolist() == list(slow.cache_run(hashes, [None] * 20, [0] * 20))
    assert fast.snapshot() == slow.snapshot()
    fast.check([])
    twice = _hashes(30, 18) + [bytes([30]) * 16]       # a hash listed twice: the second copy dropped
    assert fast.cache_new_run(twice).tolist() == list(slow.cache_run(twice, [None] * 19, [0] * 19))
    assert fast.snapshot() == slow.snapshot()


def test_cache_new_run_leaves_other_batches_to_the_checked_path():
    pool = _host_pool()
    before = pool.snapshot()
    assert pool.cache_new_run(_hashes(100, 50)) is None       # more than the 40 free blocks
    assert pool.cache_new_run(_hashes(1, 3)) is None          # short: the list paths serve it
    assert pool.snapshot() == before


def test_a_pool_past_int32_block_ids_keeps_int64_links():
    """Links are int32 where every block id fits; a pool of 2^31 blocks or more keeps int64 ones (its
    ids would not fit), through the compiled batches too."""
    small = FlatBlockPool(64, 4, CompiledLRU(), digest_size=16)
    big = FlatBlockPool(2**31, 4, CompiledLRU(), digest_size=16)
    assert small.policy.views()[0].dtype.itemsize == 4 and big.policy.views()[0].dtype.itemsize == 8
    for pool in (small, big):
        blocks = pool.allocate(20, 4)
        pool.publish_run(blocks, _hashes(1, 20), None, 0)
        pool.release(blocks[::-1])
        pool.acquire_hits(blocks[:18], distinct=True)
        pool.release(blocks[:18][::-1])
        assert pool.policy.snapshot() == (*blocks[18:][::-1], *blocks[:18][::-1])
        pool.check([])
