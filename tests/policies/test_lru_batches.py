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
