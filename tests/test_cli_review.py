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
