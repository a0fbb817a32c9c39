"""The command line's review: flags that work as the README says, bad input refused with a message
that names the flag or file (never a traceback, never accepted silently), outputs written whole.

Every test runs ``main`` in-process on a tiny trace written to ``tmp_path`` (or stops at argument
parsing), so the whole file takes seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

import pytest

from prefixkv.cli import main


def _mooncake(path, rows):
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


@pytest.fixture
def trace(tmp_path):
    return _mooncake(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 4]])


def fails(capsys, *argv) -> str:
    """Run ``prefixkv argv``, expect exit status 2, return stderr (which must hold no traceback)."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


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
