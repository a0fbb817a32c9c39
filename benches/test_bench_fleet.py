"""Router hot path: pick() on a 4,096-token prompt, 4 workers, 1M indexed blocks (target <= 1 ms).

    .venv/bin/pytest benches/test_bench_fleet.py --benchmark-only --benchmark-columns=min,median
"""

from __future__ import annotations

import pytest

from prefixkv.fleet.index import KVIndex
from prefixkv.fleet.router import RouterConfig, WorkerLoad, make_router
from prefixkv.hashing import BlockHasher, encode_tokens
from prefixkv.prompt import Prompt

BLOCK = 16
WORKERS = [f"w{i}" for i in range(4)]


@pytest.fixture(scope="module")
def million_block_index():
    index = KVIndex()
    for i, w in enumerate(WORKERS):
        index.add_worker(w)
        index.stored(w, [(i, k) for k in range(250_000)])       # 4 x 250k = 1M distinct hashes
    return index


@pytest.mark.parametrize("router_name", ["kv-aware+guard", "kv-aware"])
def test_pick_4096_tokens_4_workers_1m_blocks(benchmark, million_block_index, router_name):
    hasher = BlockHasher(BLOCK, seed=0)
    tokens = encode_tokens(list(range(4096)))
    hashes = Prompt(hasher, tokens, len(tokens)).block_hashes()   # 256 blocks
    million_block_index.stored("w2", hashes[:200])                # w2 holds a 200-block prefix
    router = make_router(router_name, million_block_index, RouterConfig(block_size=BLOCK))
    loads = [WorkerLoad(w, queued_prefill_tokens=16 * i, running_requests=i % 2) for i, w in enumerate(WORKERS)]
    decision = benchmark(router.pick, hashes, loads)
    assert million_block_index.num_blocks() >= 1_000_000
    assert decision.worker_id == "w2" and decision.overlap_blocks == 200
