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
