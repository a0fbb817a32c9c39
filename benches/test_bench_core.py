"""Micro-benchmarks of prefixkv's hot paths (pytest-benchmark).

    .venv/bin/pytest benches/ --benchmark-only --benchmark-columns=min,median
    .venv/bin/pytest benches/ --benchmark-disable      # smoke: every body runs once

No timing assertions; every bench checks the result it timed (hit counts,
slots, evictions, invariants). Benches that change state round by round use
``benchmark.pedantic`` with a fixed number of rounds so the state they measure
(cache contents, sequence lengths) is the same whatever the calibration does.
"""

from __future__ import annotations

import itertools

import pytest

from prefixkv import KVCacheManager

BLOCK = 16
VOCAB = 32000


def _cached_manager(tokens, num_blocks=4096) -> KVCacheManager:
    mgr = KVCacheManager(num_blocks, BLOCK, hash_seed=0)
    mgr.admit("warm", tokens)
    mgr.free("warm")
    return mgr


# -- 32k-token prompt: hash, match, both ---------------------------------------
LONG_HIT = (32768 - 1) // BLOCK * BLOCK  # capped at len-1, block aligned: 32752


def test_hash_32k(benchmark, long_tokens):
    mgr = KVCacheManager(4096, BLOCK, hash_seed=0)

    def run():
        return mgr.prompt(long_tokens).block_hashes()

    hashes = benchmark(run)
    assert len(hashes) == 2048 and len(set(hashes)) == 2048
    assert hashes == mgr.prompt(long_tokens).block_hashes()  # deterministic under a pinned seed


def test_match_cached_32k(benchmark, long_tokens):
    mgr = _cached_manager(long_tokens)
    prompt = mgr.prompt(long_tokens)
    prompt.block_hashes()  # hashed once, outside the timing
    m = benchmark(mgr.match, prompt)
    assert m.hit_tokens == LONG_HIT and m.hit_blocks == 2047 and m.total_blocks == 2048 and m.fits


def test_hash_plus_match_32k(benchmark, long_tokens):
    mgr = _cached_manager(long_tokens)
    m = benchmark(lambda: mgr.match(mgr.prompt(long_tokens)))
    assert m.hit_tokens == LONG_HIT


# -- admission -----------------------------------------------------------------
def test_admit_free_2k_half_cached(benchmark, rng):
    """A 2,048-token request whose first 1,024 tokens are cached: admit (encode,
    hash 128 blocks, look up, pin 64 hits, allocate and publish 64) then free."""
    prefix = [rng.randrange(VOCAB) for _ in range(1024)]
    mgr = KVCacheManager(16384, BLOCK, hash_seed=0)
    mgr.admit("warm", prefix + [rng.randrange(VOCAB) for _ in range(1024)])
    mgr.free("warm")
    ids = itertools.count()
    hits = []

    def setup():
        # A fresh unique suffix each round, so exactly half of the prompt is cached.
        return (f"r{next(ids)}", prefix + [rng.randrange(VOCAB) for _ in range(1024)]), {}

    def admit_free(rid, tokens):
        hits.append(mgr.admit(rid, tokens))
        mgr.free(rid)

    benchmark.pedantic(admit_free, setup=setup, rounds=200, iterations=1, warmup_rounds=0)
    assert hits and set(hits) == {1024}
    assert mgr.stats().active_blocks == 0 and mgr.stats().evictions == 0
    mgr.check_invariants()


def test_alloc_under_eviction_pressure(benchmark, rng):
    """Every block is cached and evictable; an unrelated 2,048-token prompt
    (hashed beforehand) must evict 128 blocks to be admitted."""
    num_blocks = 4096
    mgr = KVCacheManager(num_blocks, BLOCK, hash_seed=0)
    for i in range(num_blocks // 128):
        mgr.admit(f"fill{i}", [rng.randrange(VOCAB) for _ in range(2048)])
        mgr.free(f"fill{i}")
    s = mgr.stats()
    assert s.evictable_blocks == num_blocks and s.free_uncached_blocks == 0
    ids = itertools.count()
    held = []
    results = []

    def setup():
        if held:  # free the previous round's request: its blocks join the evictable ones
            mgr.free(held.pop())
        rid = f"new{next(ids)}"
        held.append(rid)
        prompt = mgr.prompt([rng.randrange(VOCAB) for _ in range(2048)])
        prompt.block_hashes()
        return (rid, prompt), {}

    def admit(rid, prompt):
        results.append(mgr.admit(rid, prompt))

    benchmark.pedantic(admit, setup=setup, rounds=100, iterations=1, warmup_rounds=0)
    mgr.free(held.pop())
    s = mgr.stats()
    assert results and set(results) == {0}
    assert s.evictions == 128 * len(results)
    assert s.evictable_blocks == num_blocks and s.active_blocks == 0
    mgr.check_invariants()


# -- decode ------------------------------------------------------------------------
NUM_RUNNING = 256
DECODE_ROUNDS = 64  # every sequence crosses 4 block boundaries (allocate + hash + publish)


def _running_manager(rng):
    mgr = KVCacheManager(8192, BLOCK, hash_seed=0)
    seq_ids = [f"s{i}" for i in range(NUM_RUNNING)]
    for sid in seq_ids:
        mgr.admit(sid, [rng.randrange(VOCAB) for _ in range(rng.randint(100, 400))])
    return mgr, seq_ids


def _check_decoded(mgr, seq_ids, before, rounds):
    assert all(mgr.num_tokens(s) == before[s] + rounds for s in seq_ids)
    mgr.check_invariants()


@pytest.mark.parametrize("how", ["decode_step", "append_token"])
def test_decode_256(benchmark, rng, how):
    """One decode step: one token appended to each of 256 running sequences."""
    mgr, seq_ids = _running_manager(rng)
    before = {s: mgr.num_tokens(s) for s in seq_ids}
    tokens = [rng.randrange(VOCAB) for _ in seq_ids]
    rounds = []
    if how == "decode_step":
        def step():
            rounds.append(mgr.decode_step(seq_ids, tokens))
    else:
        append_token = mgr.append_token

        def step():
            rounds.append([append_token(s, t) for s, t in zip(seq_ids, tokens)])

    benchmark.pedantic(step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=0)
    assert all(len(r) == NUM_RUNNING for r in rounds)
    last = [int(x) for x in rounds[-1]]
    assert len(set(last)) == NUM_RUNNING  # distinct physical slots
    _check_decoded(mgr, seq_ids, before, len(rounds))


# -- the peers' workload, reduced ------------------------------------------------------
def _reference_hits(reqs, prefix_len, block_size):
    """Hits without eviction: a request hits its shared prefix iff an earlier
    request used it (random suffixes never match), capped at len-1, block aligned."""
    seen, total = set(), 0
    for r in reqs:
        key = tuple(r.prompt[:prefix_len])
        if key in seen:
            total += min(prefix_len // block_size, (len(r.prompt) - 1) // block_size) * block_size
        seen.add(key)
    return total


def test_peer_workload_200(benchmark, peer_workload_module):
    import peer_workload

    W = peer_workload_module
    cfg = dict(W.DEFAULTS, num_requests=200)
    reqs = W.make_workload(cfg["seed"], cfg["num_requests"], cfg["num_prefixes"], cfg["prefix_len"],
                           cfg["suffix_max"], cfg["decode_steps"], cfg["vocab"])
    expected = _reference_hits(reqs, cfg["prefix_len"], cfg["block_size"])
    out = []

    def replay():
        ad, st = peer_workload.replay(W, reqs, num_blocks=cfg["num_blocks"], block_size=cfg["block_size"],
                                      concurrency=cfg["concurrency"])  # asserts block ops, no leak
        out.append((st.hit_tokens, st.requests, ad.mgr.stats().evictions))

    benchmark.pedantic(replay, rounds=5, iterations=1, warmup_rounds=1)
    assert set(out) == {(expected, 200, 0)}
