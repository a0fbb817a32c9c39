"""The command line's review: flags that work as the README says, bad input refused with a message
that names the flag or file (never a traceback, never accepted silently), outputs written whole.

Every test runs ``main`` in-process on a tiny trace written to ``tmp_path`` (or stops at argument
parsing), so the whole file takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys

import pytest

from prefixkv.cli import main
from cli_helpers import fails


def _mooncake(path, rows):
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


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


# -- prefixkv tier ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "1e10", "nan", "0", "-1", "x"])
def test_tier_timeout_must_be_a_usable_number_of_seconds(capsys, value):
    # inf and 1e10 reached the socket and the writer's join: OverflowError with a traceback
    for command in ("stats", "clear"):
        err = fails(capsys, "tier", command, "redis://127.0.0.1:1", f"--timeout={value}")
        assert "--timeout" in err and "OverflowError" not in err


@pytest.mark.parametrize("prefix", ["", "a b", "x" * 65])
def test_tier_clear_refuses_a_bad_prefix_instead_of_clearing_the_default_one(capsys, prefix):
    # --prefix "" (an empty shell variable) used to clear the default prefix pkv's blocks
    err = fails(capsys, "tier", "clear", "redis://127.0.0.1:1", f"--prefix={prefix}")
    assert "--prefix" in err and "unreachable" not in err


def test_tier_without_redis_py_says_what_to_install(capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")
                 or m.startswith("prefixkv.tiers.redis")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)        # import redis -> ImportError
    err = fails(capsys, "tier", "stats", "redis://127.0.0.1:1")
    assert "prefixkv[redis]" in err


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


# -- lists of block counts, empty paths -------------------------------------------------------

@pytest.mark.parametrize("flag, message", [("--capacities", "comma-separated positive block counts"),
                                           ("--host-capacity", "comma-separated block counts")])
def test_block_count_lists_with_non_ascii_digits_say_what_is_expected(capsys, flag, message):
    # '²'.isdigit() is True and int('²') raises: argparse said "invalid _capacity_list value"
    err = fails(capsys, "compare", flag, "100,²")
    assert message in err and "_list" not in err


def test_an_empty_plot_path_is_refused_not_ignored(capsys, trace):
    err = fails(capsys, "compare", "--trace", trace, "--capacities", 3, "--policies", "lru", "--plot=")
    assert "--plot" in err


def test_an_empty_trace_path_is_refused_not_read_as_the_current_directory(capsys, monkeypatch, trace):
    monkeypatch.chdir(trace.parent)
    err = fails(capsys, "replay", "--trace=", "--capacity", 3)
    assert "--trace" in err
    err = fails(capsys, "compare", "--trace", trace, "--trace=", "--capacities", 3, "--policies", "lru")
    assert "--trace" in err


# -- output files -------------------------------------------------------------------------------

def test_atomic_files_follow_the_umask_and_keep_a_replaced_files_mode(tmp_path):
    # mkstemp's 0600 was renamed into place: plots and traces others could not read
    from prefixkv.outputs import atomic_path

    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh.png"
        with atomic_path(fresh) as tmp:
            tmp.write_bytes(b"x")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        kept = tmp_path / "kept.jsonl"
        kept.write_text("old")
        kept.chmod(0o640)
        with atomic_path(kept) as tmp:
            tmp.write_text("new")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.png", "kept.jsonl"]


from redis_fixtures import REDIS_SERVER, SKIP_REASON, redis_server  # noqa: E402,F401  (a module's server)


@pytest.mark.redis
@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_tier_stats_and_clear_still_work_with_their_checked_options(capsys, redis_server):  # noqa: F811
    doc = json.loads(ok(capsys, "tier", "stats", redis_server.url, "--timeout", "0.5", "--json"))
    assert doc["url"] == redis_server.url and len(doc["nodes"]) == 1
    out = ok(capsys, "tier", "clear", redis_server.url, "--prefix", "review-x", "--timeout", "2")
    assert "deleted 0 block(s) of every fingerprint" in out


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
