"""Hot paths the other bench files do not time: trace replay (both modes), a lone free,
a lone append, the bench cost-model run and the reserved baseline (pytest-benchmark;
no timing assertions, every bench checks what it timed)."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.bench import BenchConfig, ReservedAllocator, prepare_trace, run_block_size
from prefixkv.sim.replay import replay
from prefixkv.sizing import KVSpec
from prefixkv.sim.workloads import DEFAULT_WORKLOAD, WorkloadConfig, generate_requests
from prefixkv.sim.traces import Trace

BLOCK = 16


@pytest.fixture(scope="module")
def default_trace() -> Trace:
    return Trace(generate_requests(DEFAULT_WORKLOAD), BLOCK, "default", format="tokens")


@pytest.mark.parametrize("mode", ["cache", "concurrent"])
def test_replay_default_workload_lru(benchmark, default_trace, mode):
    result = benchmark.pedantic(replay, args=(default_trace, "lru", 2048), kwargs=dict(mode=mode),
                                rounds=3, iterations=1)
    assert result.requests == len(default_trace) and 0 < result.block_hit_rate < 1


def test_free_128_blocks(benchmark):
    mgr = KVCacheManager(4096, BLOCK, hash_seed=0)
    counter = iter(range(10**9))

    def setup():
        rid = next(counter)
        mgr.admit(rid, list(range(rid * 4096, rid * 4096 + 128 * BLOCK)))
        return (rid,), {}

    benchmark.pedantic(mgr.free, setup=setup, rounds=100, iterations=1)
    assert len(mgr) == 0 and mgr.stats().active_blocks == 0
    mgr.check_invariants()


def test_append_one_token_crossing_blocks(benchmark):
    mgr = KVCacheManager(8192, BLOCK, hash_seed=0)
    mgr.admit("s", list(range(100)))
    calls = []

    def append():
        mgr.append("s", [len(calls)])
        calls.append(1)

    benchmark.pedantic(append, rounds=2000, iterations=1)
    assert calls and mgr.num_tokens("s") == 100 + len(calls)
    mgr.check_invariants()


@pytest.mark.parametrize("block_size", [4, 64])
def test_bench_cost_model_run(benchmark, block_size):
    trace = Trace(generate_requests(WorkloadConfig(num_requests=60)), BLOCK, "small", format="tokens")
    requests = prepare_trace(trace)
    cfg = BenchConfig(block_sizes=(block_size,), pool_bytes=2**30, spec=KVSpec(32, 8, 128, "bfloat16"))
    run = benchmark.pedantic(run_block_size, args=(requests, block_size, cfg), rounds=3, iterations=1)
    assert run.summary["completed"] == 60


def test_reserved_allocator_cycle(benchmark):
    alloc = ReservedAllocator(1 << 20)

    def cycle():
        for i in range(64):
            alloc.reserve(i, 4096)
        for i in range(0, 64, 2):
            alloc.release(i)
        for i in range(1, 64, 2):
            alloc.release(i)

    benchmark(cycle)
    assert alloc.largest_free_range == 1 << 20
