"""Issue 17's targets, prefixkv side (pytest-benchmark).

    .venv/bin/pytest benches/test_bench_issue17.py --benchmark-only --benchmark-columns=min,median
    PREFIXKV_BENCH_1M=1 .venv/bin/pytest benches/test_bench_issue17.py --benchmark-only   # + 1M blocks

* eviction-heavy admission: a pool whose every block is cached and evictable; one round =
  admit a fresh 2,048-token prompt (128 blocks of 16: 128 evictions, counted) and free it.
  ``raw_ids``: the round starts from token ids (encode + hash inside the timing, as
  ``compare_peers.py``'s headline ``hash+admit+free``); ``prehashed``: the prompt is hashed
  in the setup (``admit+free``). 16k and 131k blocks; 1M with PREFIXKV_BENCH_1M=1 (its fill
  takes seconds). The same scenario beside vLLM: ``benches/compare_peers.py --scenarios evict``.
* a 32k-token prompt looked up on precomputed hashes (``mgr.match`` on an already hashed,
  fully cached prompt) in a pool whose every block is cached (issue target <= 0.1 ms;
  ``test_bench_core.py::test_match_cached_32k`` is the same lookup in a 4,096-block pool).
"""

from __future__ import annotations

import itertools
import os

import pytest

from prefixkv import KVCacheManager

BLOCK = 16
PROMPT = 2048
PER = PROMPT // BLOCK
SIZES = [16_384, 131_072] + ([1_048_576] if os.environ.get("PREFIXKV_BENCH_1M") else [])
LONG_HIT = (32768 - 1) // BLOCK * BLOCK


def _fresh_ids():
    """Distinct 2,048-token prompts, cheap to make (fill content does not matter)."""
    for i in itertools.count():
        yield list(range(i * PROMPT, (i + 1) * PROMPT))


def _fill(mgr: KVCacheManager, ids) -> None:
    n = mgr.pool.num_blocks
    for i in range(-(-(n - mgr.pool.num_cached) // PER)):
        assert mgr.admit(f"fill{i}", next(ids)) == 0
        mgr.free(f"fill{i}")
    s = mgr.stats()
    assert s.evictable_blocks == n and s.free_uncached_blocks == 0


@pytest.fixture(scope="module")
def full_pools():
    """One full pool per size, shared by the benches of this module (each round leaves it full)."""
    pools: dict[int, tuple] = {}

    def get(num_blocks: int):
        if num_blocks not in pools:
            mgr = KVCacheManager(num_blocks, BLOCK, hash_seed=0)
            ids = _fresh_ids()
            _fill(mgr, ids)
            pools[num_blocks] = (mgr, ids)
        return pools[num_blocks]

    return get


@pytest.mark.parametrize("hashing", ["raw_ids", "prehashed"])
@pytest.mark.parametrize("num_blocks", SIZES)
def test_evict_heavy_admit_free(benchmark, full_pools, num_blocks, hashing):
    mgr, ids = full_pools(num_blocks)
    rids = itertools.count()
    hits = []
    ev0 = mgr.pool.evictions

    def setup():
        tokens = next(ids)
        if hashing == "prehashed":
            prompt = mgr.prompt(tokens)
            prompt.block_hashes()
            return (f"new{next(rids)}", prompt), {}
        return (f"new{next(rids)}", tokens), {}

    def admit_free(rid, prompt):
        hits.append(mgr.admit(rid, prompt))
        mgr.free(rid)

    benchmark.pedantic(admit_free, setup=setup, rounds=100, iterations=1, warmup_rounds=0)
    assert hits and set(hits) == {0}
    assert mgr.pool.evictions - ev0 == PER * len(hits)
    s = mgr.stats()
    assert s.evictable_blocks == num_blocks and s.active_blocks == 0 and s.free_uncached_blocks == 0


def test_match_32k_precomputed_full_pool(benchmark, long_tokens):
    """``mgr.match(prompt)`` on an already hashed, fully cached 32k-token prompt; the other
    14,336 blocks of the 16,384-block pool are cached too."""
    mgr = KVCacheManager(16_384, BLOCK, hash_seed=0)
    mgr.admit("long", long_tokens)
    mgr.free("long")
    _fill(mgr, _fresh_ids())
    prompt = mgr.prompt(long_tokens)
    prompt.block_hashes()  # hashed once, outside the timing
    m = benchmark(mgr.match, prompt)
    assert m.hit_tokens == LONG_HIT and m.hit_blocks == 2047 and m.total_blocks == 2048 and m.fits
    assert mgr.stats().evictions == 0


def test_replay_lru_matches_loop(benchmark):
    """LRU replay of the first 300 requests of the WEKA sample at 2,000 blocks, timed;
    ``replay_vs_loop.lru_loop`` over the same references must give the same hits and
    evictions (the full comparison: ``python benches/replay_vs_loop.py``)."""
    from pathlib import Path

    from prefixkv.sim.replay import replay
    from prefixkv.sim.traces import Trace, load_trace
    from replay_vs_loop import lru_loop

    path = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "weka-kv-cache-tester"
    if not path.is_dir():
        pytest.skip(f"trace folder {path} not found")
    full = load_trace(path)
    trace = Trace(full.requests[:300], full.block_size, name="weka-300")
    result = benchmark.pedantic(replay, args=(trace, "lru", 2000), rounds=3, iterations=1)
    hits, evictions = lru_loop([r.block_hashes for r in trace.requests], 2000)
    assert (result.block_hits, result.evictions) == (hits, evictions)
    assert hits > 0 and evictions > 0
