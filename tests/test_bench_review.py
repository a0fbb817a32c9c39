"""Review of ``prefixkv bench``, ``prefixkv.costs`` and ``prefixkv.sizing``: one test (or group) per
defect found; each failed before its fix."""

from __future__ import annotations

import json

import pytest

from prefixkv.costs import CostParams, load_params


# -- cost profile files: a bad field names the file, the field and its line ---------------------------

@pytest.mark.parametrize("name, text, field, line", [
    ("a.json", '{\n  "base": "h200",\n  "prefill_s_per_token": "abc"\n}\n', "prefill_s_per_token", 3),
    ("b.toml", 'base = "cpu-tiny"\n\nlink_bytes_per_s = 0\n', "link_bytes_per_s", 3),
    ("c.json", '{"decode_s_per_token": 1e999}', "decode_s_per_token", 1),
])
def test_cost_file_bad_value_names_file_field_and_line(tmp_path, name, text, field, line):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_params(path)
    msg = str(info.value)
    assert f"{path}:{line}" in msg and field in msg


@pytest.mark.parametrize("text, field", [
    ('{"read_whole_blocks": "no"}', "read_whole_blocks"),        # a truthy string: whole blocks read
    ('{"decode_s_per_token": true}', "decode_s_per_token"),       # true is not 1 s per token
    ('{"name": 5}', "name"),
    ('{"base": ["h200"]}', "base"),                               # was TypeError: unhashable type
])
def test_cost_file_wrong_type_is_refused(tmp_path, text, field):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_params(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_cost_params_checks_types_when_built_directly():
    with pytest.raises(ValueError, match="read_whole_blocks"):
        CostParams(read_whole_blocks="no")
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        CostParams(prefill_s_per_token=True)
    assert CostParams(read_whole_blocks=False).read_whole_blocks is False


# -- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("9007199254740993", 2**53 + 1),                  # a byte count past float precision
    ("12345678901234567891", 12345678901234567891),
    ("4.5TiB", 9 * 2**39),
    ("0.5KiB", 512),
])
def test_parse_size_is_exact(text, value):
    from prefixkv.sizing import parse_size

    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["1.0000000000000001GiB", "0.3B", "\u0663GiB"])
def test_parse_size_refuses_what_is_not_whole_ascii_bytes(text):
    from prefixkv.sizing import parse_size

    with pytest.raises(ValueError):
        parse_size(text)


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


# -- KVSpec and plan: non-integer, zero and negative inputs ------------------------------------------

def test_kvspec_refuses_non_integer_fields():
    from prefixkv.sizing import KVSpec

    with pytest.raises(ValueError, match="layers"):
        KVSpec(layers=1.5, kv_heads=8, head_dim=128)           # was: a float bytes_per_token
    with pytest.raises(ValueError, match="head_dim"):
        KVSpec(layers=32, kv_heads=8, head_dim="128")          # was: TypeError
    with pytest.raises(ValueError, match="kv_heads"):
        KVSpec(layers=32, kv_heads=True, head_dim=128)


def test_block_and_pool_sizes_are_checked():
    from prefixkv.sizing import KVSpec, plan

    spec = KVSpec(32, 8, 128)
    with pytest.raises(ValueError, match="block_size"):
        spec.num_blocks(2**30, 0)                              # was ZeroDivisionError
    with pytest.raises(ValueError, match="block_size"):
        spec.bytes_per_block(-16)                              # was a negative byte count
    with pytest.raises(ValueError, match="pool_bytes"):
        spec.num_blocks(-1, 16)
    with pytest.raises(ValueError, match="pool_bytes"):
        plan(spec, 16, -5, 10)                                 # was num_blocks -1, max_requests -1
    with pytest.raises(ValueError, match="host_pool_bytes"):
        plan(spec, 16, 2**30, 10, host_pool_bytes=-1)



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
