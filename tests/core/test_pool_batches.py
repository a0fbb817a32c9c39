"""The pool's batch operations for tiers (issue 13) end in exactly the state of the block-by-block
calls they stand for: ``cache_many`` = allocate + publish + release, ``take_cached`` =
acquire_hits + forget of the evictable ones, ``publish_many`` = publish each, a release of
uncached blocks = the free list in order, and ``on_evict_many`` sees every victim before it is
reused. Every policy that can run without an oracle, from random histories (duplicate and
already-cached hashes included).

The pool's fast paths against its block-by-block definition, over random histories that reach the
states the other tests rarely do: duplicate hashes (active duplicates, a hash twice in one batch,
already cached), priorities that appear mid-run, clear_cache in the middle, forget, track_reuse,
verify mode, events, keep_chain, and pools grown lazily past their first 1,024 blocks.
Pool ``fast`` runs LRU, whose batch events (``on_released_batch``, ``on_hit_batch``,
``evict_many`` with ``valid_victims``) and ``reads_chain = False`` open every fast path;
pool ``slow`` runs a subclass that overrides the single events only, so the pool must take the
block-by-block paths (per-block release, hit, evict, publish). Every call must give both the same
result and leave both in the same state, victims reported to ``on_evict_many`` in the same order.
The batch events keep the single events' meaning: an empty release sends none, and a subclass that
overrides a single event is not bypassed by its parent's batch."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy_doubles import SingleEventLRU

from prefixkv import KVCacheManager, SessionHint
from prefixkv.errors import OutOfBlocks
from prefixkv.policies import BUILTIN_POLICIES, make_policy
from prefixkv.policies.lru import LRUPolicy
from prefixkv.policies.session import SessionPolicy
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


# -- the fast paths against the block-by-block pool ------------------------------------------------

HASHES = st.integers(0, 40)      # a small universe: repeats and duplicates are common


op = st.one_of(
    st.tuples(st.just("allocate"), st.integers(1, 6), st.booleans()),
    st.tuples(st.just("big"), st.integers(100, 700), st.booleans()),
    st.tuples(st.just("request"), st.lists(HASHES, min_size=1, max_size=8), st.sampled_from([0, 0, 1])),
    st.tuples(st.just("publish"), st.integers(0, 50), st.lists(HASHES, min_size=1, max_size=6)),
    st.tuples(st.just("release"), st.integers(0, 50), st.sampled_from([0, 0, 0, 2, -1])),
    st.tuples(st.just("hit"), st.lists(HASHES, min_size=1, max_size=6)),
    st.tuples(st.just("take"), st.lists(HASHES, min_size=1, max_size=6)),
    st.tuples(st.just("cache_many"), st.lists(HASHES, min_size=1, max_size=8)),
    st.tuples(st.just("forget"), st.integers(0, 50)),
    st.tuples(st.just("clear"),),
)


def _state(pool, keep_chain):
    snap = pool.snapshot()
    if not keep_chain:
        snap = snap[:3] + snap[5:]
    reused = None if pool._reused is None else tuple(pool._reused)
    return snap, reused, pool.forgotten, pool.cleared, pool.unused_removals, pool.insertions, pool.num_free


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([24, 60, 1500, 2600]), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.lists(op, min_size=5, max_size=60))
def test_fast_paths_equal_the_block_by_block_pool(num_blocks, track_reuse, verify, events, keep_chain, script):
    pools = [BlockPool(num_blocks, 4, LRUPolicy(), verify=verify, record_events=events, track_reuse=track_reuse),
             BlockPool(num_blocks, 4, SingleEventLRU(), verify=verify, record_events=events,
                       track_reuse=track_reuse)]
    fast, slow = pools
    if keep_chain:
        fast.keep_chain = True
    chain = fast.keep_chain
    victims = ([], [])
    for pool, seen in zip(pools, victims):
        pool.on_evict_many = lambda blocks, hashes, seen=seen: seen.extend(zip(blocks, hashes))
    tables: list[list[int]] = []          # held references (a block may be held by several)
    unpublished: list[list[int]] = []     # of those, blocks allocated full and never published
    for step in script:
        kind = step[0]
        results = []
        for pool in pools:
            try:
                if kind == "allocate":
                    results.append(pool.allocate(step[1], 4))
                elif kind == "big":    # a long request, cached and released at once: grows the pool
                    blocks = pool.allocate(min(step[1], pool.num_free), 4)
                    pool.publish_run(blocks, [("big", len(script), i) for i in range(len(blocks))], None, 0)
                    if step[2]:
                        pool.release(blocks[::-1])
                    results.append(blocks)
                elif kind == "request":   # allocate, publish (repeats and duplicates likely), release
                    blocks = pool.allocate(len(step[1]), 4)
                    pool.publish_run(blocks, [("h", h) for h in step[1]], None, 0)
                    pool.release(blocks[::-1], step[2])
                    results.append(blocks)
                elif kind == "publish":
                    if not unpublished:
                        results.append(None)
                        continue
                    blocks = unpublished[step[1] % len(unpublished)][:len(step[2])]
                    hashes = [("h", h) for h in step[2][:len(blocks)]]
                    pool.publish_run(blocks, hashes, ("p", step[1]), step[1] % 5)
                    results.append(None)
                elif kind == "release":
                    if not tables:
                        results.append(None)
                        continue
                    table = tables[step[1] % len(tables)]
                    pool.release(table[::-1], step[2])
                    results.append(None)
                elif kind in ("hit", "take"):
                    blocks = [pool.lookup(("h", h)) for h in step[1]]
                    blocks = list(dict.fromkeys(b for b in blocks if b is not None))   # a match: distinct
                    if kind == "take":
                        blocks = [b for b in blocks if not pool.ref_count[b]]
                        pool.take_cached(blocks, distinct=True)
                    else:
                        pool.acquire_hits(blocks, distinct=True)
                    results.append(blocks)
                elif kind == "cache_many":
                    hashes = [("h", h) for h in step[1]]
                    results.append(pool.cache_many(hashes, [None] * len(hashes), list(range(len(hashes)))))
                elif kind == "forget":
                    held = [b for t in tables for b in t if pool.block_hash[b] is not None]
                    if held:
                        pool.forget(held[step[1] % len(held)])
                    results.append(None)
                else:
                    if pool.num_active:
                        pool.clear_cache(keep_active=True)
                    else:
                        pool.clear_cache()
                    results.append(None)
            except OutOfBlocks as exc:
                results.append(("OutOfBlocks", exc.needed, exc.available))
        assert results[0] == results[1], step
        got = results[0]
        # the caller's side: who holds what now
        if kind == "allocate" and isinstance(got, list) and got:
            tables.append(got)
            unpublished.append(list(got))
        elif kind == "big" and isinstance(got, list) and got and not step[2]:
            tables.append(got)
        elif kind == "publish" and unpublished:
            i = step[1] % len(unpublished)
            unpublished[i] = unpublished[i][len(step[2]):]
            if not unpublished[i]:
                del unpublished[i]
        elif kind == "release" and tables:
            table = tables.pop(step[1] % len(tables))
            gone = set(table)
            unpublished[:] = [u for u in ([b for b in u if b not in gone] for u in unpublished) if u]
        elif kind in ("hit", "take") and got:
            tables.append(got)
        elif kind == "clear":
            seen: set = set()      # every held block lost its hash: each may be published once again
            unpublished[:] = [u for u in ([b for b in t if not (b in seen or seen.add(b))] for t in tables) if u]
        for pool in pools:
            pool.check(tables)
        assert _state(fast, chain) == _state(slow, chain), step
        assert victims[0] == victims[1]
        if events:
            assert fast.drain_events() == slow.drain_events()


def test_take_cached_of_blocks_hit_before_ends_their_residency():
    """track_reuse: a block hit, released, then taken up a tier starts no residency marked as hit."""
    pools = [BlockPool(8, 4, LRUPolicy(), track_reuse=True), BlockPool(8, 4, SingleEventLRU(), track_reuse=True)]
    for pool in pools:
        blocks = pool.allocate(3, 4)
        pool.publish_run(blocks, ["a", "b", "c"], None, 0)
        pool.release(blocks[::-1])
        pool.acquire_hits(blocks, distinct=True)
        pool.release(blocks[::-1])
        pool.take_cached(blocks, distinct=True)
        pool.release(blocks[::-1])
        pool.check([])
    assert _state(pools[0], False) == _state(pools[1], False)


# -- an empty release sends no event, not an empty batch ---------------------------------------------
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


# -- on_cached_batch is not used where a subclass overrides on_cached only ------------------------------
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
