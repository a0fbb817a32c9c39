"""Eviction cost per policy through the real pool (pytest-benchmark; no timing assertions).

Each round admits a fresh 64-block request into a pool whose every block is a
cached, evictable block, so all 64 allocations evict, then frees it (64
releases). The cost per event is the round's time / 128.
"""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.policies import available_policies

BLOCK = 16
POOL = 16_384
REQUEST_BLOCKS = 64
POLICIES = [p for p in available_policies() if p != "belady"]


@pytest.mark.parametrize("policy", POLICIES)
def test_evict_64_blocks(benchmark, policy):
    mgr = KVCacheManager(POOL, BLOCK, policy=policy, hash_seed=0)
    counter = iter(range(10**9))

    def fresh_prompt():
        base = next(counter) * REQUEST_BLOCKS * BLOCK
        return mgr.prompt(range(base, base + REQUEST_BLOCKS * BLOCK))

    for _ in range(POOL // REQUEST_BLOCKS):          # fill the pool with evictable cached blocks
        rid = next(counter)
        mgr.admit(rid, fresh_prompt(), compute_last_token=False)
        mgr.free(rid)
    assert mgr.stats().evictable_blocks == POOL

    def setup():
        return (next(counter), fresh_prompt()), {}

    rounds = []

    def round_trip(rid, prompt):
        mgr.admit(rid, prompt, compute_last_token=False)
        mgr.free(rid)
        rounds.append(rid)

    before = mgr.stats().evictions
    benchmark.pedantic(round_trip, setup=setup, rounds=50, warmup_rounds=2)
    assert rounds and mgr.stats().evictions - before == len(rounds) * REQUEST_BLOCKS
    mgr.check_invariants()
