"""``prefixkv bench``: the design notes' numbers, the fixed budget, paged vs reserved,
determinism, the CLI, and the cost model next to the real engine (no timing assertions); bad
arguments refused before any run, traces of only empty prompts refused, concurrency counted while
requests run, the no-cache comparison run like the paged runs, tail ids outside trace namespaces."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from prefixkv import KVCacheManager
from prefixkv.bench import (BenchConfig, CostModel, CostModelExecutor, ReservedAllocator, prepare_trace,
                            run_bench, run_block_size, run_reserved)
from prefixkv.bench.cli import main as bench_main
from prefixkv.bench.costmodel import StepCounts
from prefixkv.bench.report import to_json
from prefixkv.bench.runner import tokens_for_hash
from prefixkv.costs import PROFILES, PreemptionCostModel, load_params
from prefixkv.sim.traces import Trace, TraceRequest
from prefixkv.sizing import KVSpec

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


# -- rejected requests, untruncated output, argument checks, errors, reserved failure -----------------

def _rejecting_result(**kw):
    """A 256-token pool (128 KiB at 512 B/token): mixed_trace's longest requests cannot fit at all."""
    cfg = tiny_cfg(pool_bytes=128 * 1024, **kw)
    return run_bench(mixed_trace(), cfg)


def test_render_shows_rejected_requests(capsys):
    from prefixkv.bench.report import render

    result = _rejecting_result()
    runs = [r.summary for r in result.runs]
    assert all(r["rejected_too_long"] > 0 for r in runs)
    assert all(r["completed"] + r["rejected_too_long"] == r["requests"] for r in runs)
    render(result)
    out = capsys.readouterr().out
    assert "done / rejected" in out
    for r in runs:
        assert f"{r['completed']:,} / {r['rejected_too_long']:,}" in out
    note = [line for line in out.splitlines() if "rejected" in line and "too long" in line]
    assert len(note) == 1
    if len({r["rejected_too_long"] for r in runs}) == 1:
        assert f"{runs[0]['rejected_too_long']} of {len(mixed_trace())} requests rejected" in note[0]
    else:
        for r in runs:
            assert f"B={r['block_size']}: {r['rejected_too_long']} of" in note[0]


def test_render_no_rejection_note_when_all_complete(capsys):
    from prefixkv.bench.report import render

    render(run_bench(mixed_trace(), tiny_cfg()))
    out = capsys.readouterr().out
    assert "too long" not in out and f"{len(mixed_trace())} / 0" in out


def test_render_off_terminal_is_not_truncated(capsys):
    from prefixkv.bench.report import render
    from prefixkv.console import make_console

    # the notes' model on an 8 GiB pool: wide numbers (thousands of blocks, TTFTs in the thousands of ms)
    result = run_bench(mixed_trace(60), BenchConfig(block_sizes=(4, 8, 16, 32, 64, 128), max_num_seqs=4),
                       compare_reserved=True)
    console = make_console()
    assert not console.is_terminal
    render(result, console)
    explicit = capsys.readouterr().out
    render(result)                                  # the default console is the same kind
    default = capsys.readouterr().out
    for out in (explicit, default):
        assert "TTFT" in out and "reserved-max-length" in out
        assert "…" not in out
        assert f"{result.runs[0].summary['num_blocks']:,}" in out


def test_cli_output_to_pipe_is_not_truncated(capsys):
    assert bench_main(["--workload", "chat", "--requests", "25", "--block-sizes", "4,16,128",
                       "--compare-reserved"]) == 0
    out = capsys.readouterr().out
    assert "done / rejected" in out and "…" not in out


def _parse_bench_args(argv):
    """Parse like ``bench_main`` without running the benchmark (a bad value must not reach it)."""
    import argparse

    from prefixkv.bench.cli import add_bench_command

    parser = argparse.ArgumentParser(prog="prefixkv")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize("value", ["0", "-1", "0.0", "nan", "inf", "abc"])
def test_cli_rejects_bad_rate_scale(capsys, value):
    with pytest.raises(SystemExit) as exc:
        _parse_bench_args(["--rate-scale", value, "--requests", "5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --rate-scale: expected a positive number, got {value!r}" in err


def test_cli_rate_scale_scales_arrivals(capsys):
    argv = ["--workload", "chat", "--requests", "5", "--block-sizes", "16", "--pool", "256MiB", "--json"]
    assert bench_main(argv + ["--rate-scale", "2.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["rate_scale"] == 2.5 and doc["runs"][0]["completed"] == 5
    assert _parse_bench_args(["--rate-scale", "0.5"]).rate_scale == 0.5


@pytest.mark.parametrize("exc", [lambda: __import__("prefixkv.errors").errors.SequenceTooLong(10, 4),
                                 lambda: __import__("prefixkv.errors").errors.OutOfBlocks(3, 1)])
def test_cli_reports_prefixkv_errors(monkeypatch, capsys, exc):
    import prefixkv.bench.runner as runner
    from prefixkv.errors import PrefixKVError

    error = exc()
    assert isinstance(error, PrefixKVError) and not isinstance(error, (ValueError, RuntimeError))

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(runner, "run_bench", boom)
    with pytest.raises(SystemExit) as info:
        bench_main(["--workload", "chat", "--requests", "3", "--block-sizes", "16"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"prefixkv bench: error: {error}\n"
    assert "Traceback" not in captured.err


def test_reserved_failure_keeps_paged_results(capsys):
    from prefixkv.bench.report import render

    cfg = tiny_cfg(pool_bytes=128 * 1024)          # 256 tokens; every request reserves 403 tokens
    reserve = 403
    result = run_bench(mixed_trace(), cfg, compare_reserved=True, reserve_tokens=reserve)
    assert result.reserved is None and len(result.runs) == 2
    msg = result.reserved_error
    assert f"{reserve:,} tokens" in msg and f"{reserve * 512 / 1024:.2f} KiB" in msg   # the reservation
    assert "128 KiB pool (256 tokens)" in msg                                          # the pool
    assert "--reserve-tokens request" in msg and "--pool 1MiB" in msg                  # the fixes
    doc = json.loads(to_json(result))
    assert doc["reserved_error"] == msg and "reserved" not in doc and len(doc["runs"]) == 2
    render(result)
    out = capsys.readouterr().out
    assert "TTFT" in out and "--reserve-tokens request" in out and "paged results above are complete" in out
    # the suggested fix works
    fixed = run_bench(mixed_trace(), cfg, compare_reserved=True, reserve_tokens="request")
    assert fixed.reserved_error is None and fixed.reserved["reserved"]["completed"] > 0


def test_cli_reserved_failure_exit_0(capsys):
    argv = ["--workload", "chat", "--requests", "10", "--block-sizes", "16", "--pool", "256MiB",
            "--compare-reserved", "--reserve-tokens", "1000000000"]
    assert bench_main(argv + ["--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["runs"][0]["completed"] == 10 and "reserved" not in doc
    assert "1,000,000,000 tokens" in doc["reserved_error"] and "256 MiB pool" in doc["reserved_error"]
    assert "reserved baseline not run" in captured.err
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "reserved baseline not run" in out and "--reserve-tokens request" in out


def test_reserved_last_arrivals_rejected_is_not_an_error():
    cfg = tiny_cfg(pool_bytes=128 * 1024)
    short = [TraceRequest(0.0, 20, 4, None, list(range(20)), [1, 2, 3, 4])]
    long = [TraceRequest(1.0, 300, 4, None, list(range(300)), [1, 2, 3, 4])]     # arrives last, never fits
    requests = prepare_trace(Trace(short + long, 16, "t", format="tokens"))
    out = run_reserved(requests, cfg, reserve_tokens="request")
    assert (out["completed"], out["rejected_too_long"]) == (1, 1)


@pytest.mark.parametrize("argv, message", [
    (["--reserve-tokens", "foo"], "argument --reserve-tokens: expected max, request or a positive token count, "
                                  "got 'foo'"),
    (["--reserve-tokens", "0"], "argument --reserve-tokens: expected max, request or a positive token count, "
                                "got '0'"),
    (["--requests", "foo"], "argument --requests: expected a positive integer, got 'foo'"),
    (["--requests", "-3"], "argument --requests: expected a positive integer, got '-3'"),
    (["--max-seqs", "1.5"], "argument --max-seqs: expected a positive integer, got '1.5'"),
])
def test_cli_argument_errors_are_user_facing(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _parse_bench_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "_reserve" not in err and "_positive" not in err and "invalid" not in err


def test_bench_keeps_a_token_traces_salts(tmp_path):
    from prefixkv.bench.runner import BenchConfig, run_bench
    from prefixkv.sim.traces import TraceRequest, load_token_trace, write_token_trace

    tokens = list(range(1, 257))
    reqs = [TraceRequest(float(i), 256, 4, tokens=tokens, salt=salt) for i, salt in enumerate(("a", "b", "a"))]
    path = write_token_trace(tmp_path / "salted.jsonl", reqs, block_size=16)
    result = run_bench(load_token_trace(path), BenchConfig(block_sizes=(16,)))
    # only the third request (salt "a" again) hits: 240 of its 256 tokens (the last block is recomputed)
    assert result.runs[0].summary["prefix_hit_rate"] == pytest.approx(240 / (3 * 256))


def test_plot_path_that_is_a_file_is_refused_before_the_run(tmp_path, capsys):
    from prefixkv.bench.cli import main as bench_main

    target = tmp_path / "afile"
    target.write_text("x")
    with pytest.raises(SystemExit) as exc:
        bench_main(["--requests", "5", "--block-sizes", "16", "--plot", str(target)])
    assert exc.value.code == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_reserved_comparison_shows_what_paged_runs_recomputed():
    from prefixkv.bench.runner import run_bench
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default")
    trace.requests = trace.requests[:40]
    result = run_bench(trace, BenchConfig(block_sizes=(16,)), compare_reserved=True, reserve_tokens="request")
    rows = [*result.reserved["paged"], result.reserved["paged_no_cache"]]
    assert all({"preemptions", "recomputed_tokens"} <= set(row) for row in rows)
    assert rows[0]["preemptions"] == result.runs[0].summary["preemptions"]


def test_bench_reports_waiting_requests_and_skipped_empty_prompts(tmp_path):
    from prefixkv.bench.runner import run_bench
    from prefixkv.sim.traces import load_mooncake

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}\n'
                    + "".join(f'{{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [{i}, {i + 9}]}}\n'
                              for i in range(3)))
    # three requests arrive together and only one may run at a time: two wait at first
    result = run_bench(load_mooncake(path), BenchConfig(block_sizes=(16,), max_num_seqs=1))
    assert result.trace["empty_prompts_skipped"] == 1 and result.trace["requests"] == 3
    summary = result.runs[0].summary
    assert summary["waiting_max"] == 2 and summary["concurrency_max"] == 1
    assert max(summary["timeline"]["waiting"]) == 2


def test_reserve_max_is_the_longest_request_that_fits_the_pool():
    from prefixkv.bench.reserved import reservation_size

    class R:
        def __init__(self, prompt_len, new):
            self.prompt, self.max_new_tokens = [0] * prompt_len, new

    short, mid, huge = R(10, 1), R(20, 1), R(1000, 1)
    size = reservation_size([short, mid, huge], "max", capacity=100)
    # the request too long for any pool of 100 tokens reserves its own length (and is rejected,
    # as the paged runs reject it); the others reserve the longest that fits
    assert (size(short), size(mid), size(huge)) == (20, 20, 1000)
    assert reservation_size([short, mid, huge], "max")(short) == 1000
    cfg = tiny_cfg(pool_bytes=128 * 1024)          # 256 tokens: the mixed trace's longest does not fit
    result = run_bench(mixed_trace(), cfg, compare_reserved=True)
    reserved = result.reserved["reserved"]
    assert result.reserved_error is None and reserved["completed"] > 0 and reserved["rejected_too_long"] >= 1


def test_means_are_over_time_so_a_quiet_spell_counts(tmp_path):
    from prefixkv.bench.runner import run_bench
    from prefixkv.sim.traces import load_mooncake

    path = tmp_path / "t.jsonl"
    # two short requests 1,000 s apart: one is running during the steps, nothing in between
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 1000000, "input_length": 600, "output_length": 3, "hash_ids": [3, 4]}\n')
    summary = run_bench(load_mooncake(path), BenchConfig(block_sizes=(16,))).runs[0].summary
    assert max(summary["timeline"]["running"]) == 1
    per_step = sum(summary["timeline"]["running"]) / len(summary["timeline"]["running"])
    assert per_step > 0.5 and summary["concurrency_mean"] < 0.01
    usage = summary["usage_mean"]
    assert abs(usage["active"] + usage["evictable"] + usage["free"] - 1.0) < 1e-9


def test_placeholder_tokens_differ_for_ids_sharing_a_prefix_and_agree_across_processes():
    """String ids were reduced to their first 8 bytes ("request-1" and "request-2" got the same
    tokens, so their outputs' KV would hit each other), other ids went through the per-process
    salted hash()."""
    import subprocess
    import sys

    from prefixkv.bench.costmodel import placeholder_token

    ids = [f"request-{i}" for i in range(20)]
    tokens = [tuple(placeholder_token(r, i) for i in range(8)) for r in ids]
    assert len(set(tokens)) == len(ids)
    here = [placeholder_token(r, 3) for r in ids + [("tenant", 7)]]
    code = ("from prefixkv.bench.costmodel import placeholder_token as p; "
            f"print([p(r, 3) for r in {ids + [('tenant', 7)]!r}])")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert other.stdout.strip() == str(here)


# -- the bench command's arguments ----------------------------------------------------------------

def _no_run(monkeypatch):
    import prefixkv.bench.runner as runner

    def boom(*args, **kwargs):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(runner, "run_bench", boom)


def test_block_size_larger_than_the_pool_is_refused_before_any_run(monkeypatch, capsys):
    from prefixkv.bench.cli import main as bench_main

    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as info:
        bench_main(["--requests", "2", "--block-sizes", "16,100000000", "--pool", "1GiB"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--block-sizes" in err and "100000000" in err and "1 GiB" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, names", [
    (["--model-spec", "0,8,128"], "--model-spec"),
    (["--model-spec", "32,8,128,bf16,3"], "--model-spec"),
    (["--tp", "3"], "--tp"),
])
def test_bad_model_spec_names_the_argument(monkeypatch, capsys, argv, names):
    from prefixkv.bench.cli import main as bench_main

    _no_run(monkeypatch)
    with pytest.raises(SystemExit) as info:
        bench_main(["--requests", "2", "--block-sizes", "16", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err


# -- empty and zero-token traces ------------------------------------------------------------------

def test_trace_of_only_empty_prompts_is_refused(tmp_path, capsys):
    """Was: exit 0 with a table of zeros (usage fractions summing to 0, not 1)."""
    from prefixkv.bench.cli import main as bench_main

    path = tmp_path / "empty.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}\n'
                    '{"timestamp": 5, "input_length": 0, "output_length": 0, "hash_ids": []}\n')
    with pytest.raises(SystemExit) as info:
        bench_main(["--trace", str(path), "--block-sizes", "16", "--json"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "empty prompt" in captured.err and "Traceback" not in captured.err


# -- concurrency: a request that finishes in a step was running during it ------------------------------

def test_lone_request_counts_as_running(tmp_path):
    """One request, alone from arrival to finish: it ran during every step, so the time-weighted
    concurrency is 1 while it runs and the max 1 (was: sampled after each step, when a finished
    request is gone: max 0 and mean 0 for requests finishing in their first step)."""
    from prefixkv.bench.runner import BenchConfig, run_bench
    from prefixkv.sim.traces import load_mooncake

    path = tmp_path / "one.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 1000000, "input_length": 600, "output_length": 1, "hash_ids": [3, 4]}\n')
    result = run_bench(load_mooncake(path), BenchConfig(block_sizes=(16,)), compare_reserved=True,
                       reserve_tokens="request")
    runs = [result.runs[0].summary, result.reserved["reserved"]]
    for s in runs:
        assert s["completed"] == 2
        assert s["concurrency_max"] == 1
    # the quiet spell between the two requests counts as 0: the mean is tiny but not 0
    for s in runs:
        assert 0 < s["concurrency_mean"] < 0.01


def test_concurrency_mean_of_back_to_back_requests_is_one(tmp_path):
    from prefixkv.bench.runner import BenchConfig, run_bench
    from prefixkv.sim.traces import load_mooncake

    path = tmp_path / "one.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n')
    result = run_bench(load_mooncake(path), BenchConfig(block_sizes=(16,)), compare_reserved=True,
                       reserve_tokens="request")
    for s in (result.runs[0].summary, result.reserved["reserved"]):
        assert s["concurrency_mean"] == pytest.approx(1.0) and s["concurrency_max"] == 1


def test_engine_no_cache_comparison_runs_like_the_paged_runs(monkeypatch):
    """--executor engine --compare-reserved: the paged run without prefix cache (a row of the
    comparison) ran outside the --threads pin and without the warm-up run the paged runs get, so
    its latencies counted torch's first-shape slowness on another thread count."""
    pytest.importorskip("torch")
    import torch
    from dataclasses import replace

    import prefixkv.bench.runner as runner
    from prefixkv.bench.runner import BenchConfig, run_bench
    from prefixkv.sim.traces import Trace, TraceRequest

    real = runner.run_block_size
    calls = []

    def spy(requests, size, cfg):
        calls.append((size, cfg.enable_caching, torch.get_num_threads()))
        return real(requests, size, replace(cfg, executor="cost-model"))    # no torch needed here

    monkeypatch.setattr(runner, "run_block_size", spy)
    threads = 1 if torch.get_num_threads() != 1 else 2
    trace = Trace([TraceRequest(0.0, 40, 2, None, list(range(40)), [1, 2])], 16, "t", format="tokens")
    cfg = BenchConfig(block_sizes=(16,), pool_bytes=2**20, spec=runner.KVSpec(2, 2, 16, "float32"),
                      executor="engine", threads=threads)
    run_bench(trace, cfg, compare_reserved=True, reserve_tokens="request")
    no_cache = [c for c in calls if not c[1]]
    assert len(no_cache) == 2                                  # warm-up, then the kept run
    assert all(c[2] == threads for c in calls)


# -- a request's own tail tokens never take a trace block's ------------------------------------------

def test_a_tail_id_never_falls_into_a_trace_files_id_namespace():
    """A request's own tail tokens came from ``crc32 | 1 << 40``: the second kv-cache-tester file's
    namespace (its local id h is ``1 << 40 | h``), so a tail could take a trace block's tokens."""
    import zlib

    from prefixkv.bench.runner import _id64, tokens_for_hash
    from prefixkv.sim.traces import NAMESPACE_BITS

    tail = ("tail", 7)
    crc = zlib.crc32(repr(tail).encode())
    assert _id64(tail) >= 1 << 62 > 200 << NAMESPACE_BITS          # above any file's namespace
    assert list(tokens_for_hash(tail, 16, 32000)) != list(tokens_for_hash((1 << NAMESPACE_BITS) | crc, 16, 32000))
