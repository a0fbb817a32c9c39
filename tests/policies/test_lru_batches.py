"""Issue 17: LRU's release runs (lazy deletion, batch events) order blocks exactly as an
OrderedDict LRU does; the pool refuses a bad evict_many."""

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import KVCacheManager, PolicyError
from prefixkv.policies import LRUPolicy

N = 12
ops = st.lists(st.tuples(st.sampled_from(["release", "hit", "evict"]),
                         st.lists(st.integers(0, N - 1), min_size=1, max_size=6, unique=True)),
               max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_batches_match_an_ordereddict_lru(script):
    policy = LRUPolicy()
    policy._stamp = [0] * N            # as bind() sizes it
    ref: OrderedDict = OrderedDict()
    active = set(range(N))             # every block starts held, cached
    for kind, blocks in script:
        if kind == "release":
            todo = [b for b in blocks if b in active]
            policy.on_released_batch(todo)     # empty too: a release of only uncached blocks
            for b in todo:
                active.discard(b)
                ref[b] = None
        elif kind == "hit":
            todo = [b for b in blocks if b in ref]
            if len(todo) > 1:
                policy.on_hit_batch(todo)
            elif todo:
                policy.on_hit(todo[0], True)
            for b in todo:
                del ref[b]
                active.add(b)
        else:
            k = min(len(blocks), len(ref))
            if k:
                got = policy.evict_many(k)
                want = [ref.popitem(last=False)[0] for _ in range(k)]
                assert got == want
                active.update(got)
        assert len(policy) == len(ref) and policy.snapshot() == tuple(ref)
        assert all((b in policy) == (b in ref) for b in range(N))


def test_many_hits_compact_the_runs():
    policy = LRUPolicy()
    policy._stamp = [0] * 4
    for _ in range(5000):            # release and hit the same block: stale entries pile up
        policy.on_released_batch([1])
        policy.on_hit(1, True)
    assert policy._entries < 5000 and len(policy) == 0


class BadMany(LRUPolicy):
    name = "bad-many"

    def evict_many(self, k):
        out = LRUPolicy.evict_many(self, k - 1)
        return out + [out[0]]         # returns one victim twice (and loses no block)

    evict = LRUPolicy.evict           # defined here too, so the pool uses evict_many


def test_a_victim_returned_twice_is_refused_and_the_pool_stays_consistent():
    mgr = KVCacheManager(8, 4, policy=BadMany(), hash_seed=0)
    mgr.admit("a", list(range(32)))
    mgr.free("a")
    with pytest.raises(PolicyError, match="from evict_many"):
        mgr.admit("b", list(range(100, 132)))
    mgr.check_invariants()
    s = mgr.stats()
    assert s.active_blocks == 0 and s.free_uncached_blocks + s.evictable_blocks == 8


def test_lru_order_survives_compactions_with_a_partly_taken_front_run():
    """Thousands of stale entries (hits) force compactions while the front run is partly evicted:
    the order stays an OrderedDict LRU's, membership included."""
    import random
    from collections import OrderedDict

    rng = random.Random(7)
    n = 64
    policy = LRUPolicy()
    policy._stamp = [0] * n
    ref: OrderedDict = OrderedDict()
    active = set(range(n))
    compactions = 0
    for step in range(30_000):
        r = rng.random()
        if step % 6000 == 5999 and ref:
            k = rng.randrange(1, min(len(ref), 3) + 1)   # the front run partly taken, stale entries kept
            assert policy.evict_many(k) == [ref.popitem(last=False)[0] for _ in range(k)]
            active.update(b for b in range(n) if b not in ref)
        elif r < 0.5 and active:
            batch = rng.sample(sorted(active), min(len(active), rng.randrange(1, 6)))
            before = policy._entries
            policy.on_released_batch(batch)
            compactions += policy._entries < before
            for b in batch:
                active.discard(b)
                ref[b] = None
        elif ref:
            hits = rng.sample(list(ref), min(len(ref), rng.randrange(1, 4)))
            if len(hits) > 1:
                policy.on_hit_batch(hits)
            else:
                policy.on_hit(hits[0], True)
            for b in hits:
                del ref[b]
                active.add(b)
        if step % 97 == 0 or policy._entries <= len(ref) + 1:
            assert policy.snapshot() == tuple(ref) and len(policy) == len(ref)
            assert all((b in policy) == (b in ref) for b in range(n))
    assert compactions >= 3
