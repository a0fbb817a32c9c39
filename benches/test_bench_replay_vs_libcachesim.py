"""Issue 28: prefixkv's replay beside libCacheSim's ``process_trace`` on the same block references
(pytest-benchmark, 5 rounds each: compare the medians; no timing assertions). The shared traces
at 5% of their distinct blocks; ``replay_vs_libcachesim.py`` is the same comparison as one
interleaved run with a table. Each bench checks what it timed; a trace not on this machine, or a
missing libcachesim, is a skip."""

from __future__ import annotations

import pytest

import replay_vs_libcachesim as vs

ROUNDS = 5
TRACES = vs.shared_traces()
POLICIES = ["lru", "fifo", "slru", "s3fifo", "arc", "lfu"]


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(label):
        if label not in TRACES:
            pytest.skip(f"shared trace {label} is not under {vs.SHARED}")
        if label not in cache:
            cache[label] = vs.load(TRACES[label])
        return cache[label]
    return get


@pytest.mark.parametrize("label", list(vs.TRACES))
def test_libcachesim_lru(benchmark, loaded, label, tmp_path):
    pytest.importorskip("libcachesim")
    trace, capacity = loaded(label)
    stream = tmp_path / "refs.oracleGeneral.bin"
    lookups = vs.write_oracle_general(trace, stream)
    assert lookups == trace.num_block_accesses()
    _, miss_ratio = benchmark.pedantic(vs.libcachesim_lru, args=(stream, capacity), rounds=ROUNDS, iterations=1)
    assert 0.0 < miss_ratio < 1.0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("label", list(vs.TRACES))
def test_prefixkv_replay(benchmark, loaded, label, policy):
    trace, capacity = loaded(label)
    result = benchmark.pedantic(vs.prefixkv_replay, args=(trace, policy, capacity), rounds=ROUNDS, iterations=1)
    assert result.requests == len(trace) and 0.0 < result.block_hit_rate < 1.0
    benchmark.extra_info["replay_s"] = result.replay_s
    benchmark.extra_info["engine"] = result.engine
