"""The command line in-process: plan, lab, replay, compare, workload and generate's parsing, their
output, and bad input refused with a message that names the flag or file (never a traceback,
never accepted silently); options of a lower tier refused without the tier; names printed as text,
not markup; help naming every command."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from cli_helpers import fails

from prefixkv.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_plan_json_seed_model(capsys):
    code, out = run(capsys, "plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
                    "--block-size", "16", "--pool", "24GiB", "--prompt-tokens", "4097", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["bytes_per_token"], d["bytes_per_block"], d["num_blocks"], d["blocks_per_request"],
            d["max_requests"], d["leftover_blocks"], d["unallocated_bytes"]) == (131072, 2 * 2**20, 12288, 257, 47, 209, 0)


def test_plan_text_second_example(capsys):
    code, out = run(capsys, "plan", "--layers", "24", "--kv-heads", "4", "--pool", "8GiB", "--prompt-tokens", "1025")
    assert code == 0
    assert "49,152 B (48 KiB)" in out and "10,922 blocks" in out and "168" in out
    assert "2 blocks + 512 KiB unallocated" in out


def test_plan_tp_json(capsys):
    _, out = run(capsys, "plan", "--tp", "16", "--json")
    assert json.loads(out)["kv_heads_per_gpu"] == 1


@pytest.mark.parametrize("argv,message", [
    (["plan", "--pool", "24GB"], "decimal"),
    (["plan", "--dtype", "float99"], "unknown dtype"),
    (["plan", "--block-size", "0"], "positive"),
    (["plan", "--tp", "3"], "split evenly"),
    (["lab", "--lengths", "1,x"], "comma-separated"),
    (["plan", "--pool", "0"], "expected a size above zero, got '0'"),
    (["replay", "--capacity", "abc"], "--capacity: expected a positive integer, got 'abc'"),
    (["replay", "--capacity", "10", "--warmup", "x"], "expected a fraction in [0, 1), got 'x'"),
    (["compare", "--policies", ","], "expected comma-separated policy names"),
    (["compare", "--capacities", "1000,,4000"], "comma-separated positive block counts, got '1000,,4000'"),
    (["workload", "--out", "/nonexistent-dir/x.jsonl"], "directory /nonexistent-dir does not exist"),
])
def test_bad_arguments_exit_2_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("block_size,line", [(16, "blocks=8 slots=128 useful=112 tail_waste=16"),
                                             (4, "blocks=29 slots=116 useful=112 tail_waste=4"),
                                             (64, "blocks=3 slots=192 useful=112 tail_waste=80")])
def test_lab(capsys, block_size, line):
    code, out = run(capsys, "lab", "--block-size", str(block_size), "--lengths", "17,32,63")
    assert code == 0
    assert line in out
    assert out.count("PASS") == 5 and "FAIL" not in out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "prefixkv.cli", "plan", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["max_requests"] == 47


SHARED = __import__("pathlib").Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def test_replay_builtin_workload_json(capsys):
    code, out = run(capsys, "replay", "--capacity", "500", "--json")
    d = json.loads(out)
    assert code == 0
    for key in ("requests", "block_accesses", "block_hit_rate", "token_hit_rate", "evictions"):
        assert key in d
    assert d["requests"] == 300 and 0 < d["block_hit_rate"] < 1


def test_replay_concurrent_text(capsys):
    code, out = run(capsys, "replay", "--capacity", "300", "--mode", "concurrent", "--policy", "fifo")
    assert code == 0 and "block_hit_rate" in out and "waited_admissions" in out


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces is not beside the repository")
def test_replay_mooncake_file(capsys):
    code, out = run(capsys, "replay", "--trace", str(SHARED / "synthetic_trace.jsonl"), "--capacity", "2000", "--json")
    d = json.loads(out)
    assert (d["requests"], d["block_accesses"], d["block_size"]) == (3993, 121877, 512)


def test_replay_names_a_bad_trace_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--trace", str(bad), "--capacity", "10"])
    assert exc.value.code == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_compare_table_json_and_plot(capsys, tmp_path):
    png = tmp_path / "curve.png"
    code, out = run(capsys, "compare", "--policies", "lru,fifo,belady", "--capacities", "100,400",
                    "--workers", "2", "--json", "--plot", str(png))
    d = json.loads(out)
    assert code == 0 and png.stat().st_size > 1000
    rates = {(r["policy"], r["capacity"]): r["block_hit_rate"] for r in d["results"]}
    assert len(rates) == 6
    for c in (100, 400):
        assert rates[("belady", c)] >= rates[("lru", c)] and rates[("belady", c)] >= rates[("fifo", c)]
    assert {row["capacity"] for row in d["summary"]} == {100, 400}


def test_compare_names_a_bad_trace_line_from_worker_processes(capsys, tmp_path):
    # The error is raised in a worker process and pickled back: it must keep its file:line message.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": 10 "output_length": 1}\n')
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--trace", str(bad), "--capacities", "10,20", "--policies", "lru,fifo", "--workers", "2"])
    assert exc.value.code == 2
    assert "bad.jsonl:2: bad JSON" in capsys.readouterr().err


def test_replay_text_prints_rates_as_percentages_and_the_generated_file(capsys):
    code, out = run(capsys, "replay", "--capacity", "500")
    assert code == 0
    assert "trace file " in out and "prefixkv-default-" in out
    rate_line = next(line for line in out.splitlines() if "block_hit_rate" in line)
    value = float(rate_line.split()[1])
    assert rate_line.rstrip().endswith("%") and 1.0 < value < 100.0


def test_help_lists_the_policies_and_has_no_markup(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    out = capsys.readouterr().out
    assert "lrfu" in out and "belady" in out and "s3fifo" in out
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "%%" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_compare_text_table(capsys):
    code, out = run(capsys, "compare", "--policies", "lru,fifo", "--capacities", "200", "--workers", "1")
    assert code == 0 and "lru" in out and "fifo" in out and "200" in out


def test_compare_sweeps_policy_settings(capsys):
    code, out = run(capsys, "compare", "--policies", "lru,lrfu:half_life=1,lrfu:half_life=8", "--capacities",
                    "200", "--workers", "1", "--json")
    rates = {r["policy"]: r["block_hit_rate"] for r in json.loads(out)["results"]}
    assert code == 0 and set(rates) == {"lru", "lrfu:half_life=1", "lrfu:half_life=8"}
    assert rates["lrfu:half_life=1"] != rates["lrfu:half_life=8"]


def test_compare_refuses_a_bad_policy_option_before_running(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--policies", "lru,lrfu:nope=1"])
    assert "'lrfu' has no option 'nope'" in capsys.readouterr().err


def test_compare_unknown_policy(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--policies", "lru,nope"])
    assert "unknown policy nope" in capsys.readouterr().err


def test_workload_command_is_deterministic(capsys, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(capsys, "workload", "--requests", "50", "--seed", "3", "--out", str(a))
    run(capsys, "workload", "--requests", "50", "--seed", "3", "--out", str(b))
    assert a.read_bytes() == b.read_bytes()


def _mooncake(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


def test_compare_keeps_two_traces_of_the_same_name_apart(capsys, tmp_path):
    a = _mooncake(tmp_path / "a" / "trace.jsonl", [[1, 2], [1, 2], [1, 2]])
    b = _mooncake(tmp_path / "b" / "trace.jsonl", [[1, 2], [3, 4], [5, 6]])
    code, out = run(capsys, "compare", "--trace", str(a), "--trace", str(b), "--policies", "lru",
                    "--capacities", "8", "--workers", "1", "--json")
    rates = {r["trace"]: r["block_hit_rate"] for r in json.loads(out)["results"]}
    assert code == 0 and len(rates) == 2
    assert sorted(rates.values()) == [0.0, pytest.approx(4 / 6)]


def test_compare_concurrent_leaves_min_out_and_refuses_it_by_name(capsys):
    code, out = run(capsys, "compare", "--mode", "concurrent", "--capacities", "300", "--workers", "1", "--json")
    assert code == 0 and "belady" not in {r["policy"] for r in json.loads(out)["results"]}
    with pytest.raises(SystemExit):
        main(["compare", "--mode", "concurrent", "--policies", "lru,belady"])
    assert "cache only" in capsys.readouterr().err


def test_compare_min_alone_and_oversized_requests_are_reported(capsys, tmp_path):
    trace = _mooncake(tmp_path / "t.jsonl", [[1, 2, 3, 4], [1, 2], [1, 2]])
    code, out = run(capsys, "compare", "--trace", str(trace), "--policies", "belady", "--capacities", "3",
                    "--workers", "1")
    assert code == 0 and "MIN (belady)" in out
    assert "requests larger than the whole cache, counted as all misses: 1 of 3 at 3 blocks" in out


@pytest.fixture
def trace(tmp_path):
    return _mooncake(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 4]])


def ok(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


# -- --model-spec ---------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["0,8,128", "32,-1,128", "32,8,0", "32,8,128,bf16,0", "32,8,128,bf16,-2"])
def test_model_spec_refuses_zero_and_negative_fields(text):
    from prefixkv.argtypes import model_spec

    with pytest.raises(argparse.ArgumentTypeError, match="--model-spec"):
        model_spec(text)


@pytest.mark.parametrize("spec", ["0,8,128", "32,8,128,bf16,3"])
def test_replay_names_model_spec_when_it_is_wrong(capsys, trace, spec):
    err = fails(capsys, "replay", "--trace", trace, "--capacity", 3, "--host-capacity", 2, f"--model-spec={spec}")
    assert "--model-spec" in err


# -- options of a lower tier given without the tier -----------------------------------------

@pytest.mark.parametrize("extra, flag", [
    (["--cost-params", "no-such-profile"], "--cost-params"),
    (["--cost-params", "h200"], "--cost-params"),
    (["--model-spec", "32,8,128"], "--model-spec"),
    (["--host-policy", "fifo"], "--host-policy"),
])
def test_replay_refuses_tier_options_without_a_tier(capsys, trace, extra, flag):
    err = fails(capsys, "replay", "--trace", trace, "--capacity", 3, *extra)
    assert flag in err and "--host-capacity" in err


def test_compare_refuses_tier_options_without_a_tier(capsys, trace):
    err = fails(capsys, "compare", "--trace", trace, "--capacities", 3, "--policies", "lru", "--workers", 1,
                "--host-capacity", 0, "--cost-params", "cpu-tiny")
    assert "--cost-params" in err


def test_tier_options_still_work_with_a_tier(capsys, trace):
    doc = json.loads(ok(capsys, "replay", "--trace", trace, "--capacity", 3, "--host-capacity", 2,
                        "--host-policy", "fifo", "--model-spec", "32,8,128", "--cost-params", "cpu-tiny", "--json"))
    assert doc["tier_block_hits"]["host"] >= 0 and doc["transfer_s"] > 0
    text = ok(capsys, "replay", "--trace", trace, "--capacity", 3, "--host-capacity", 2)
    assert "host tier 2 blocks (lru)" in text


def test_plan_refuses_cost_params_without_host_pool(capsys):
    err = fails(capsys, "plan", "--cost-params", "no-such-file.json")
    assert "--cost-params" in err and "--host-pool" in err
    doc = json.loads(ok(capsys, "plan", "--host-pool", "1GiB", "--cost-params", "cpu-tiny", "--json"))
    assert doc["cost_params"] == "cpu-tiny" and doc["host_blocks"] == 512


# -- cost parameter files -------------------------------------------------------------------

def test_cost_params_that_name_a_directory_say_so(capsys, tmp_path):
    err = fails(capsys, "plan", "--host-pool", "1GiB", "--cost-params", tmp_path)
    assert f"cost parameters {str(tmp_path)!r}" in err and "directory" in err
    err = fails(capsys, "plan", "--host-pool", "1GiB", "--cost-params=")
    assert "cost parameters" in err and "Errno" not in err


def test_a_cost_parameter_too_large_for_a_float_is_named_with_its_line(capsys, tmp_path):
    path = tmp_path / "big.json"
    path.write_text('{\n  "base": "h200",\n  "link_bytes_per_s": 1' + "0" * 400 + "\n}\n")
    err = fails(capsys, "plan", "--host-pool", "1GiB", "--cost-params", path)
    assert f"{path}:3: cost parameter link_bytes_per_s must be a finite number" in err
    from prefixkv.costs import CostParams

    with pytest.raises(ValueError, match="decode_s_per_token"):
        CostParams(decode_s_per_token=10**400)


# -- prefixkv generate (parsing only: no torch needed) ----------------------------------------

@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e400"])
def test_generate_temperature_must_be_finite_and_not_negative(capsys, value):
    # inf ran and printed "temperature": Infinity, which is not JSON
    err = fails(capsys, "generate", f"--temperature={value}")
    assert "--temperature" in err


@pytest.mark.parametrize("value", [str(2**64), str(10**30), "-1"])
def test_generate_seed_out_of_range_names_the_flag(capsys, value):
    # 10**30 reached torch: "Overflow when unpacking long long", no flag named
    err = fails(capsys, "generate", f"--seed={value}")
    assert "--seed" in err


# -- prefixkv lab ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--lengths", "1000000000000000"], ["--block-size", "100000000000000000000"],
                                  ["--block-size", "2", "--lengths", "10000000000,10000000000"]])
def test_lab_refuses_sizes_that_cannot_fit_before_running(capsys, monkeypatch, argv):
    # --lengths 10**12 was killed by the OOM killer; --block-size 10**20 crashed in struct.pack
    def never(*args):
        raise AssertionError("the lab ran")

    monkeypatch.setattr("prefixkv.sim.lab.run_lab", never)
    err = fails(capsys, "lab", *argv)
    assert "of host memory" in err


def test_lab_still_runs_its_default(capsys):
    out = ok(capsys, "lab")
    assert out.count("PASS") == 5


# -- prefixkv compare --workers ---------------------------------------------------------------

def test_compare_never_starts_more_workers_than_cells(capsys, monkeypatch, trace):
    # --workers 100000000 tried to fork 10^8 processes for 2 cells
    import prefixkv.sim.sweep as sweep_module

    real = sweep_module.sweep
    asked = []

    def sweep(sources, policies, capacities, **kwargs):
        asked.append(kwargs["workers"])
        if kwargs["workers"] > 2:
            raise AssertionError(f"{kwargs['workers']} workers for 2 cells")
        return real(sources, policies, capacities, **kwargs)

    monkeypatch.setattr(sweep_module, "sweep", sweep)
    doc = json.loads(ok(capsys, "compare", "--trace", trace, "--capacities", 3, "--policies", "lru,fifo",
                        "--workers", 100_000_000, "--json"))
    assert asked == [2] and len(doc["results"]) == 2


# -- lists of block counts -------------------------------------------------------------------

@pytest.mark.parametrize("flag, message", [("--capacities", "comma-separated positive block counts"),
                                           ("--host-capacity", "comma-separated block counts")])
def test_block_count_lists_with_non_ascii_digits_say_what_is_expected(capsys, flag, message):
    # '²'.isdigit() is True and int('²') raises: argparse said "invalid _capacity_list value"
    err = fails(capsys, "compare", flag, "100,²")
    assert message in err and "_list" not in err


# -- names printed through rich are text, not markup ------------------------------------------

def test_compare_prints_a_trace_name_with_brackets_as_it_is(capsys, tmp_path):
    # rich read "[red]" as a style: the table said "ab.jsonl"
    trace = _mooncake(tmp_path / "a[red]b.jsonl", [[1, 2], [1, 2], [3]])
    out = ok(capsys, "compare", "--trace", trace, "--capacities", 3, "--policies", "lru,session", "--workers", 1)
    assert "a[red]b.jsonl:" in out and "session: return AUC" in out


def test_compare_survives_a_path_that_reads_as_a_closing_tag(capsys, tmp_path):
    # two traces of one name are labelled by path: "[/x]" in it raised rich's MarkupError after the sweep
    (tmp_path / "d[" / "x]").mkdir(parents=True)
    (tmp_path / "e").mkdir()
    a = _mooncake(tmp_path / "d[" / "x]" / "t.jsonl", [[1, 2], [1, 2], [3]])
    b = _mooncake(tmp_path / "e" / "t.jsonl", [[1, 2], [3], [3]])
    out = ok(capsys, "compare", "--trace", a, "--trace", b, "--capacities", 3, "--policies", "lru", "--workers", 1)
    assert "[/x]" in out.replace("\n", "")


# -- flags that only mean something with another one ------------------------------------------

def test_format_without_a_trace_is_refused(capsys):
    # the built-in workload was replayed and --format ignored
    err = fails(capsys, "replay", "--capacity", 10, "--format", "mooncake")
    assert "--format" in err and "--trace" in err


def test_a_toml_cost_file_is_read_whatever_the_case_of_its_suffix(capsys, tmp_path):
    path = tmp_path / "link.TOML"
    path.write_text('base = "cpu-tiny"\nlink_bytes_per_s = 1e9\n')
    doc = json.loads(ok(capsys, "plan", "--host-pool", "1GiB", "--cost-params", path, "--json"))
    assert doc["block_transfer_s"] == pytest.approx(2 * 2**20 / 1e9)


# -- help -------------------------------------------------------------------------------------

def test_help_names_every_command_and_the_model_spec_tp(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    description = " ".join(capsys.readouterr().out.split("positional arguments")[0].split("}", 1)[1].split())
    for command in ("plan", "lab", "replay", "compare", "workload", "generate", "bench", "fleet", "tier"):
        assert re.search(rf"\([^)]*\b{command}\b[^)]*\)", description), command
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    assert "head_dim[,dtype[,tp]]" in " ".join(capsys.readouterr().out.split())


# -- compare with a remote tier and no host capacity ------------------------------------------

def test_compare_prints_a_table_for_a_remote_tier_without_host_capacity(capsys):
    from prefixkv.cli import main

    code = main(["compare", "--policies", "lru,fifo", "--capacities", "200", "--remote-capacity", "500",
                 "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "lru" in out and "fifo" in out
