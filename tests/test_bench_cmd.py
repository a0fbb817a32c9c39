"""``prefixkv bench``: the design notes' numbers, the fixed budget, paged vs reserved,
determinism, the CLI, and the cost model next to the real engine (no timing assertions)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from prefixkv import KVCacheManager
from prefixkv.bench import (PROFILES, BenchConfig, CostModel, CostModelExecutor, ReservedAllocator, load_params,
                            prepare_trace, run_bench, run_block_size, run_reserved)
from prefixkv.bench.cli import main as bench_main
from prefixkv.bench.costmodel import StepCounts
from prefixkv.bench.report import to_json
from prefixkv.bench.runner import tokens_for_hash
from prefixkv.engine import PreemptionCostModel
from prefixkv.sizing import KVSpec
from prefixkv.traces import Trace, TraceRequest

MiB, GiB = 2**20, 2**30
TINY = KVSpec(layers=2, kv_heads=2, head_dim=16, dtype="float32")      # 512 B per token


def mixed_trace(n=24, seed=3) -> Trace:
    """Mixed lengths, shared system prompt, everyone arrives at once."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(40)]
    reqs = []
    for i in range(n):
        prompt = system + [rng.randrange(1000) for _ in range(rng.choice((8, 30, 120, 300)))]
        out = [rng.randrange(1000) for _ in range(rng.choice((4, 16, 64)))]
        reqs.append(TraceRequest(0.01 * i, len(prompt), len(out), None, prompt, out))
    return Trace(reqs, 16, "mixed", format="tokens")


def tiny_cfg(**kw) -> BenchConfig:
    base = dict(block_sizes=(8, 32), pool_bytes=256 * 1024, spec=TINY, max_num_batched_tokens=256, max_num_seqs=32,
                params=PROFILES["cpu-tiny"])
    base.update(kw)
    return BenchConfig(**base)


# -- the design notes' worked numbers --------------------------------------------------

def test_seed_preemption_numbers():
    cost = PreemptionCostModel(prefill_tokens_per_s=20_000, link_bytes_per_s=25 * GiB)
    assert cost.recompute_s(4000) == pytest.approx(0.200)
    assert round(cost.swap_one_way_s(500 * MiB) * 1e3, 1) == 19.5
    assert round(cost.swap_round_trip_s(500 * MiB) * 1e3, 1) == 39.1
    # the h200 profile charges prefill at the notes' rate, and the runner hands it to the scheduler
    h200 = PROFILES["h200"]
    assert 4000 * h200.prefill_s_per_token == pytest.approx(0.200)
    assert h200.link_bytes_per_s == 25 * GiB


def test_cost_model_terms():
    spec = KVSpec(32, 8, 128, "bfloat16")
    model = CostModel(replace(PROFILES["h200"], step_overhead_s=0.0, block_alloc_s=0.0, block_table_entry_s=0.0,
                              hit_block_s=0.0, hash_s_per_token=0.0), spec.bytes_per_token)
    assert model.step_time(StepCounts(prefill_tokens=4000)) == pytest.approx(0.2)
    swap = model.step_time(StepCounts(swap_bytes=500 * MiB))
    assert round(swap * 1e3, 1) == 19.5
    assert model.step_time(StepCounts()) == 0.0


def test_load_params_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('base = "cpu-tiny"\nprefill_s_per_token = 1e-5\n')
    p = load_params(path)
    assert p.prefill_s_per_token == 1e-5 and p.decode_s_per_token == PROFILES["cpu-tiny"].decode_s_per_token
    (tmp_path / "bad.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(ValueError, match="unknown cost parameter"):
        load_params(tmp_path / "bad.json")


# -- the fixed budget ------------------------------------------------------------------

@pytest.mark.parametrize("pool", [8 * GiB, 8 * GiB + 3 * MiB + 5])
def test_same_pool_bytes_same_capacity(pool):
    spec = KVSpec(32, 8, 128, "bfloat16")
    trace = mixed_trace(4)
    requests = prepare_trace(trace)
    caps = {}
    for size in (4, 128):
        s = run_block_size(requests, size, BenchConfig(block_sizes=(size,), pool_bytes=pool, spec=spec)).summary
        assert s["num_blocks"] == pool // spec.bytes_per_block(size)
        assert s["capacity_bytes"] <= pool
        caps[size] = s["capacity_bytes"]
    # a smaller block never gets more memory than one block of the larger size's rounding
    assert abs(caps[4] - caps[128]) < spec.bytes_per_block(128)


# -- paged vs reserved ------------------------------------------------------------------

def test_seed_example_8_used_24_reserved():
    alloc = ReservedAllocator(24)
    for rid in ("a", "b"):
        assert alloc.reserve(rid, 12) is not None
        alloc.append(rid, 4)
    st = alloc.stats()
    assert (st["used_slots"], st["reserved_slots"], st["empty_reserved_slots"]) == (8, 24, 16)
    assert alloc.reserve("c", 12) is None                      # the empty reservations keep c out
    mgr = KVCacheManager(6, 4, hash_seed=0)                    # the same 24 slots, paged
    for i, rid in enumerate("abc"):
        mgr.admit(rid, [10 * i + t for t in range(4)])
    assert mgr.stats().active_blocks == 3 and mgr.num_free_blocks == 3
    alloc.release("a")
    assert alloc.reserve("c", 12) == 0


def test_reserved_allocator_merges_ranges():
    alloc = ReservedAllocator(30)
    for rid in "abc":
        alloc.reserve(rid, 10)
    alloc.release("a")
    alloc.release("c")
    assert alloc.largest_free_range == 10
    alloc.release("b")
    assert alloc.largest_free_range == 30 and alloc.free_slots == 30


def test_reserved_admits_fewer_than_paging():
    cfg = tiny_cfg(block_sizes=(16,), enable_caching=False)
    requests = prepare_trace(mixed_trace())
    paged = run_block_size(requests, 16, cfg).summary
    reserved = run_reserved(requests, cfg, reserve_tokens="max")
    assert reserved["completed"] == paged["completed"] == len(requests)
    assert reserved["concurrency_max"] < paged["concurrency_max"]
    assert reserved["concurrency_mean"] < paged["concurrency_mean"]
    oracle = run_reserved(requests, cfg, reserve_tokens="request")
    assert oracle["concurrency_mean"] >= reserved["concurrency_mean"]


# -- hashed traces -----------------------------------------------------------------------

def test_hashed_trace_tokens_follow_hash_ids():
    assert list(tokens_for_hash(7, 8, 1000)) == list(tokens_for_hash(7, 8, 1000))
    assert list(tokens_for_hash(7, 8, 1000)) != list(tokens_for_hash(8, 8, 1000))
    reqs = [TraceRequest(0.0, 20, 3, [1, 2, 3]), TraceRequest(0.5, 18, 3, [1, 2, 9])]
    trace = Trace(reqs, 8, "hashed", format="mooncake")
    a, b = prepare_trace(trace, vocab=1000)
    assert len(a.prompt) == 20 and len(b.prompt) == 18
    assert a.prompt[:16] == b.prompt[:16] and a.prompt[16:18] != b.prompt[16:18]
    s = run_block_size([a, b], 8, tiny_cfg(block_sizes=(8,))).summary
    assert s["prefix_hit_tokens"] == 16 and s["completed"] == 2


# -- determinism and the CLI ---------------------------------------------------------------

def test_same_trace_same_json():
    trace = mixed_trace()
    first = to_json(run_bench(trace, tiny_cfg(), compare_reserved=True))
    second = to_json(run_bench(mixed_trace(), tiny_cfg(), compare_reserved=True))
    assert first == second
    doc = json.loads(first)
    assert [r["block_size"] for r in doc["runs"]] == [8, 32]
    for r in doc["runs"]:
        for key in ("tail_waste_mib_mean", "block_table_len_mean", "preemptions", "ttft_p50_s", "ttft_p99_s",
                    "itl_p50_s", "itl_p99_s", "completed_per_s", "prefix_hit_rate", "usage_mean", "timeline"):
            assert key in r
        assert r["completed"] == len(trace)


def test_cli_json_and_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["--workload", "chat", "--requests", "25", "--block-sizes", "16,64", "--pool", "256MiB",
            "--compare-reserved", "--json"]
    assert bench_main(argv) == 0
    first = capsys.readouterr().out
    assert bench_main(argv + ["--plot", str(tmp_path / "plots")]) == 0
    second = capsys.readouterr().out
    assert first == second                       # same trace + seed -> identical JSON
    doc = json.loads(first)
    assert [r["block_size"] for r in doc["runs"]] == [16, 64]
    assert doc["config"]["pool_bytes"] == 256 * MiB and doc["reserved"]["reserved"]["completed"] == 25
    for name in ("latency_cdf.png", "block_size.png", "pool_usage.png", "reserved.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    assert bench_main(["--workload", "chat", "--requests", "10", "--block-sizes", "16", "--pool", "64MiB"]) == 0
    assert "TTFT" in capsys.readouterr().out


def test_cli_rejects_bad_args(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--block-sizes", "0,4"])
    with pytest.raises(SystemExit):
        bench_main(["--pool", "8GB"])


# -- the cost model next to the real engine ---------------------------------------------------

def test_cost_model_against_engine():
    pytest.importorskip("torch")
    from prefixkv.bench.runner import compare_executors, format_comparison

    trace = mixed_trace(n=10)
    cfg = tiny_cfg(block_sizes=(16,), pool_bytes=1 * MiB)
    cmp = compare_executors(trace, cfg)
    print(format_comparison(cmp))
    (row,) = cmp["rows"]
    assert row["block_size"] == 16
    for key in ("ttft_p50_s", "itl_p50_s", "makespan_s"):
        assert row[key]["engine"] > 0 and row[key]["cost_model"] > 0
