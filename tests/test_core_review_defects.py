"""Defects found reviewing the pool's and the manager's fast paths: each test failed before its fix."""

import random

import pytest

from prefixkv import HashMismatch, KVCacheManager, PolicyError, SessionHint
from prefixkv.policies.lru import LRUPolicy
from prefixkv.policies.session import SessionPolicy
from prefixkv.pool import BlockPool


# -- append_slots let a sequence's hash chain repeat one hash -----------------------------------------
def test_append_slots_refuses_a_hash_the_sequence_already_holds():
    """resume / swap_in match a sequence by its own hashes, counting the blocks as distinct: a
    repeated hash held block 0 twice on one reference ('refcount 1 but held by 2 block tables')."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0, index="dict")
    mgr.admit("a", mgr.prompt_from_hashes([1, 2], 8))
    before = mgr.snapshot()
    with pytest.raises(HashMismatch, match="repeats"):
        mgr.append_slots("a", 5, [1])
    assert mgr.snapshot() == before
    mgr.append_slots("a", 5, [3])
    mgr.preempt("a")
    assert mgr.resume("a") == 1
    mgr.check_invariants()


# -- an empty release told a batch policy of an empty batch -------------------------------------------
class _Recording(LRUPolicy):
    name = "recording"

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_released(self, block):
        self.calls.append(("one", block))
        super().on_released(block)

    def on_released_batch(self, blocks):
        self.calls.append(("batch", list(blocks)))
        super().on_released_batch(blocks)


def test_an_empty_release_sends_no_event():
    """The block-by-block definition of releasing nothing is no event at all; the fast path called
    on_released_batch([]) (a hinted free of an empty sequence, a preemption of one)."""
    policy = _Recording()
    pool = BlockPool(8, 4, policy)
    pool.release([])
    pool.release((), 0, SessionHint("s", end="tool_use", time=1.0))
    assert policy.calls == []
    mgr = KVCacheManager(8, 4, policy=_Recording(), hash_seed=0)
    mgr.admit("e", [])
    mgr.free("e", hint=SessionHint("s", end="tool_use", time=1.0))
    mgr.admit("f", [])
    mgr.preempt("f")
    assert mgr.pool.policy.calls == []


def _session_history(empty_frees: bool):
    """The session policy after hinted frees of empty requests, or after only their hints."""
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, policy="session")
    policy = mgr.pool.policy
    rng = random.Random(1)
    for i in range(40):
        if i % 3 == 0:
            hint = SessionHint(f"s{i % 4}", end="tool_use", time=float(i))
            if empty_frees:
                mgr.admit(("empty", i), [])
                mgr.free(("empty", i), hint=hint)
            else:
                policy.on_hint(hint)       # what releasing no block means
        mgr.admit(i, [rng.randrange(3) for _ in range(rng.randrange(1, 20))])
        mgr.free(i, hint=SessionHint(f"s{i % 4}", end="tool_use", time=float(i)))
        mgr.check_invariants()
    return policy.snapshot(), [policy.evict() for _ in range(len(policy))]


def test_hinted_frees_of_empty_requests_keep_the_session_policy_working():
    """The empty batch made the session policy open an empty group, which evict() then chose:
    'dictionary is empty' (a PolicyError at the next allocation that evicts)."""
    assert _session_history(True) == _session_history(False)


# -- on_cached_batch was used even where a subclass overrides on_cached only ----------------------------
class _SeesCached(SessionPolicy):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_cached(self, block):
        self.seen.append(block)
        super().on_cached(block)


def test_a_subclass_overriding_on_cached_is_not_bypassed_by_its_parents_batch():
    policy = _SeesCached()
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0, policy=policy)
    mgr.admit("a", list(range(12)), compute_last_token=False)
    table = mgr.block_ids("a")
    assert policy.seen == table
    host = _SeesCached()
    pool = BlockPool(8, 4, host)
    blocks = pool.cache_many([b"x", b"y"], [None, b"x"], [0, 1])
    assert host.seen == blocks


# -- a PolicyError in an admission with prefix hits leaked the hit blocks -------------------------------
class _Armed(LRUPolicy):
    name = "armed"
    armed = False

    def evict(self):
        if self.armed:
            raise RuntimeError("boom")
        return super().evict()

    def evict_many(self, k):
        if self.armed:
            raise RuntimeError("boom")
        return super().evict_many(k)


def test_a_policy_error_after_prefix_hits_releases_them():
    policy = _Armed()
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_seed=0, policy=policy)
    mgr.admit("a", list(range(16)), compute_last_token=False)
    mgr.free("a")
    policy.armed = True
    with pytest.raises(PolicyError, match="boom"):
        mgr.admit("b", list(range(8)) + [99] * 8, compute_last_token=False)   # 2 hits, 2 to evict
    mgr.check_invariants()
    s = mgr.stats()
    assert s.active_blocks == 0 and s.evictable_blocks + s.free_uncached_blocks == 4
    policy.armed = False
    assert mgr.admit("b", list(range(8)) + [99] * 8, compute_last_token=False) == 8
    mgr.check_invariants()


@pytest.mark.parametrize("inclusive", [False, True])
def test_a_policy_error_after_host_hits_unpins_them(inclusive):
    policy = _Armed()
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_seed=0, policy=policy, num_host_blocks=8,
                         host_cache=True, host_inclusive=inclusive)
    a, c = list(range(16)), list(range(100, 116))
    mgr.admit("a", a, compute_last_token=False)
    mgr.free("a")
    mgr.admit("c", c, compute_last_token=False)          # evicts a's blocks to the host
    mgr.take_demotions()
    mgr.free("c")
    assert mgr.match(a, compute_last_token=False).lower_hit_blocks == 4
    policy.armed = True
    with pytest.raises(PolicyError, match="boom"):
        mgr.admit("a2", a, compute_last_token=False)       # 4 loads, 4 device blocks to evict
    mgr.check_invariants()
    assert mgr.stats().host_active_blocks == 0
    policy.armed = False
    mgr.admit("a3", c, compute_last_token=False)
    mgr.check_invariants()
