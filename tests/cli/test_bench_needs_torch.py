"""``bench --executor engine`` without torch says what to install (as ``generate`` does), instead of
a raw ``ModuleNotFoundError`` traceback; the cost-model executor needs no torch."""

from __future__ import annotations

import sys

import pytest

from cli_helpers import fails
from prefixkv.cli import main


def test_engine_executor_without_torch_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # `import torch` raises ImportError
    err = fails(capsys, "bench", "--executor", "engine", "--requests", "2", "--block-sizes", "16")
    assert "--executor engine needs torch (pip install 'prefixkv[torch]')" in err, err
    assert main(["bench", "--requests", "2", "--block-sizes", "16", "--json"]) == 0
