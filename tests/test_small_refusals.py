"""Small input-validation defects: bad input that was silently accepted (or ignored) is refused with a
message naming the flag, field or position. Each test failed before its fix; all run in milliseconds
(the built-in workloads are replaced by a sentinel, so a refusal that does not happen fails fast)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from prefixkv.cli import main
from cli_helpers import fails
from prefixkv.engine.model import model_vocab_size
from prefixkv.engine.request import InvalidRequestTokens, check_prompt_tokens
from prefixkv.fleet.simulator import FleetConfig

SENTINEL = "the built-in workload was used"


@pytest.fixture
def no_builtin(monkeypatch):
    """Building a built-in workload raises: a command that falls back to one fails at once, saying so."""
    import prefixkv.sim.workloads as workloads

    def refuse(*args, **kwargs):
        raise RuntimeError(SENTINEL)
    monkeypatch.setattr(workloads, "builtin_trace", refuse)


# -- 1, 2: bench --trace '' / --plot '' ---------------------------------------------------------------

def test_bench_refuses_an_empty_trace_path(capsys, no_builtin):
    # --trace '' (an empty shell variable) ran the built-in workload instead
    err = fails(capsys, "bench", "--trace=")
    assert "--trace" in err and "empty" in err and SENTINEL not in err
    err = fails(capsys, "bench", "--trace=", "--workload", "default")
    assert "--trace" in err and SENTINEL not in err


def test_bench_refuses_an_empty_plot_path(capsys, no_builtin):
    # --plot '' was ignored: the run went ahead and no plot was written
    err = fails(capsys, "bench", "--plot=")
    assert "--plot" in err and SENTINEL not in err


# -- 3: fleet --trace '' ------------------------------------------------------------------------------

def test_fleet_refuses_an_empty_trace_path(capsys, no_builtin):
    # --trace '' ran the built-in workload instead
    err = fails(capsys, "fleet", "--trace=")
    assert "--trace" in err and "empty" in err and SENTINEL not in err
    from prefixkv.fleet.cli import main as fleet_main
    with pytest.raises(SystemExit) as info:
        fleet_main(["--trace="])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--trace" in err and SENTINEL not in err


def test_plot_dir_refuses_an_empty_name(tmp_path):
    """``plot_dir('')`` read '' as the current directory (as ``Path('')`` does): it is refused, as
    ``plot_file('')`` is, whoever calls it."""
    from prefixkv.outputs import OutputError, plot_dir

    with pytest.raises(OutputError, match="needs a directory name"):
        plot_dir("")
    assert plot_dir(tmp_path / "plots") == tmp_path / "plots"


def test_fleet_names_a_trace_folder_given_with_a_trailing_slash(tmp_path, monkeypatch, capsys):
    """A trace folder given as ``traces/`` whose trace has no requests was reported as ": the trace has
    no requests" (the basename of a path ending in a slash is ''): the folder is named."""
    import prefixkv.sim.traces as traces
    from prefixkv.cli import main

    folder = tmp_path / "emptytraces"
    folder.mkdir()
    monkeypatch.setattr(traces, "load_trace", lambda path, fmt="auto": traces.Trace([], 16, name=str(path)))
    with pytest.raises(SystemExit):
        main(["fleet", "--trace", str(folder) + "/"])
    assert "emptytraces: the trace has no requests" in capsys.readouterr().err
