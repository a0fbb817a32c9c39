"""Paths on the command line: an empty one (an empty shell variable) is refused naming its flag,
never read as the current directory, ignored, or replaced by the built-in workload (which a sentinel
stands in for, so a refusal that does not happen fails fast); ``plot_dir('')`` is refused whoever
calls it; a trace folder given with a trailing slash is named in messages."""

from __future__ import annotations

import json

import pytest

from cli_helpers import fails


def _mooncake(path, rows):
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


@pytest.fixture
def trace(tmp_path):
    return _mooncake(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 4]])


def test_an_empty_plot_path_is_refused_not_ignored(capsys, trace):
    err = fails(capsys, "compare", "--trace", trace, "--capacities", 3, "--policies", "lru", "--plot=")
    assert "--plot" in err


def test_an_empty_trace_path_is_refused_not_read_as_the_current_directory(capsys, monkeypatch, trace):
    monkeypatch.chdir(trace.parent)
    err = fails(capsys, "replay", "--trace=", "--capacity", 3)
    assert "--trace" in err
    err = fails(capsys, "compare", "--trace", trace, "--trace=", "--capacities", 3, "--policies", "lru")
    assert "--trace" in err


# -- the built-in workload is never run in an empty path's place ---------------------------------------

SENTINEL = "the built-in workload was used"


@pytest.fixture
def no_builtin(monkeypatch):
    """Building a built-in workload raises: a command that falls back to one fails at once, saying so."""
    import prefixkv.sim.workloads as workloads

    def refuse(*args, **kwargs):
        raise RuntimeError(SENTINEL)
    monkeypatch.setattr(workloads, "builtin_trace", refuse)


# -- bench --trace '' / --plot '' ---------------------------------------------------------------------

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


# -- fleet --trace '' ---------------------------------------------------------------------------------

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
