"""Messages a new user met that did not say what was wrong (issue 29, item 10)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from cli_helpers import fails
from prefixkv.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def mooncake(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                        "hash_ids": [1, 2 + i]}) + "\n" for i in range(3)))
    return path


@pytest.fixture
def kvcache_folder(tmp_path):
    folder = tmp_path / "weka"
    folder.mkdir()
    doc = {"id": "c1", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 128, "out": 4, "hash_ids": [11, 12]},
        {"t": 1.0, "type": "n", "in": 192, "out": 4, "hash_ids": [11, 12, 13]}]}
    (folder / "trace_0001.json").write_text(json.dumps(doc))
    return folder


def test_a_folder_read_as_a_file_format_says_only_kvcache_tester_is_a_folder(capsys, kvcache_folder):
    for fmt in ("mooncake", "tokens"):
        err = fails(capsys, "replay", "--format", fmt, "--trace", kvcache_folder, "--capacity", "100")
        assert "Errno 21" not in err and "is a directory" in err, err
        assert "only a kv-cache-tester set is a directory" in err and "kvcache-tester or auto" in err, err


def test_a_file_read_as_another_format_says_what_it_looks_like(capsys, mooncake):
    err = fails(capsys, "replay", "--format", "kvcache-tester", "--trace", mooncake, "--capacity", "100")
    assert "looks like a mooncake one: use format mooncake or auto" in err, err
    err = fails(capsys, "replay", "--format", "tokens", "--trace", mooncake, "--capacity", "100")
    assert "looks like a mooncake one" in err, err
    assert main(["replay", "--trace", str(mooncake), "--capacity", "100", "--json"]) == 0     # auto reads it


def test_a_misspelt_option_names_the_command_and_the_option_meant(capsys):
    err = fails(capsys, "compare", "--polices", "lru")
    assert err.startswith("usage: prefixkv compare"), err
    assert "--polices: did you mean --policies?" in err, err
    err = fails(capsys, "tier", "stats", "redis://127.0.0.1:1/0", "--jsn")
    assert "usage: prefixkv tier stats" in err and "did you mean --json?" in err, err
    err = fails(capsys, "replay", "--capacity", "3", "stray")
    assert "usage: prefixkv replay" in err and "unrecognized arguments: stray" in err and "did you" not in err


def test_one_request_reads_as_one_request(capsys, tmp_path):
    trace = tmp_path / "one.jsonl"
    assert main(["workload", "--out", str(trace), "--requests", "1"]) == 0
    out = capsys.readouterr().out
    assert ": 1 request of workload" in out, out
    assert main(["replay", "--trace", str(trace), "--capacity", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 requests" not in out and "1 blocks" not in out, out
    assert "1 request, blocks of 16 tokens" in out and "capacity 1 block," in out, out
    assert "1 of 1 measured request did not fit" in out, out


def test_the_fleet_workers_commands_are_in_its_help_and_the_readme():
    out = subprocess.run([sys.executable, "-m", "prefixkv.fleet.worker", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    for text in ('{"op": "admit", "id": "r1", "tokens": [1, 2, 3, ...]}', '{"op": "free", "id": "r1"}',
                 '{"op": "reset"}', '{"op": "drop_next"}', '{"ok": OP}', '{"error": "..."}'):
        assert text in out, text
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert '`{"op": "admit", "id": "r1",\n"tokens": [1, 2, 3]}`' in readme
    assert '`{"op": "free", "id": "r1"}`' in readme
