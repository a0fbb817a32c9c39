"""The pool's fast paths against its block-by-block definition, over random histories that reach the
states the other tests rarely do: duplicate hashes (active duplicates, a hash twice in one batch,
already cached), priorities that appear mid-run, clear_cache in the middle, forget, track_reuse,
verify mode, events, keep_chain, and pools grown lazily past their first 1,024 blocks.

Pool ``fast`` runs LRU, whose batch events (``on_released_batch``, ``on_hit_batch``,
``evict_many`` with ``valid_victims``) and ``reads_chain = False`` open every fast path;
pool ``slow`` runs a subclass that overrides the single events only, so the pool must take the
block-by-block paths (per-block release, hit, evict, publish). Every call must give both the same
result and leave both in the same state, victims reported to ``on_evict_many`` in the same order."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.errors import OutOfBlocks
from prefixkv.policies.lru import LRUPolicy
from prefixkv.pool import BlockPool

from policy_doubles import SingleEventLRU


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
