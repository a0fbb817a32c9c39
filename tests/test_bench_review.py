"""Review of ``prefixkv bench``, ``prefixkv.costs`` and ``prefixkv.sizing``: one test (or group) per
defect found; each failed before its fix."""

from __future__ import annotations

import json

import pytest

from prefixkv.costs import CostParams, load_params


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
