import json
import subprocess
import sys

import pytest

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
