"""Helpers shared by the CLI tests."""

from __future__ import annotations

import pytest

from prefixkv.cli import main


def fails(capsys, *argv) -> str:
    """Run ``prefixkv argv``, expect exit status 2, return stderr (which must hold no traceback)."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err
