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


# -- 5: check_prompt_tokens and booleans ------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False])
def test_check_prompt_tokens_refuses_booleans(bad):
    # True/False were taken as token ids 1 and 0
    with pytest.raises(InvalidRequestTokens) as info:
        check_prompt_tokens([5, bad, 7], 100, request_id="r1")
    assert info.value.position == 1 and info.value.token is bad
    assert "'r1'" in str(info.value) and "position 1" in str(info.value) and "bool" in str(info.value)
    with pytest.raises(InvalidRequestTokens, match="prompt 3 of the batch.*position 0"):
        check_prompt_tokens([bad], None, prompt_index=3)


def test_check_prompt_tokens_refuses_boolean_tensors_and_keeps_integers():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidRequestTokens, match="position 2"):
        check_prompt_tokens([1, 0, torch.tensor(True)], 100, request_id="r")
    with pytest.raises(InvalidRequestTokens, match="position 0"):
        check_prompt_tokens(torch.tensor([True, False]), 100, request_id="r")
    assert check_prompt_tokens([1, np.int64(2), torch.tensor(3)], 100, request_id="r") == (1, 2, 3)
    assert check_prompt_tokens(torch.tensor([4, 5]), 100, request_id="r") == (4, 5)


# -- 6: model_vocab_size ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [256.7, math.nan, math.inf, True, "256"])
def test_model_vocab_size_refuses_a_non_integer(value):
    # int(256.7) silently became 256
    with pytest.raises(ValueError, match="vocab_size"):
        model_vocab_size(SimpleNamespace(vocab_size=value))
    with pytest.raises(ValueError, match="vocab_size"):
        model_vocab_size(SimpleNamespace(config=SimpleNamespace(vocab_size=value)))


def test_model_vocab_size_keeps_integers():
    assert model_vocab_size(SimpleNamespace(vocab_size=256)) == 256
    assert model_vocab_size(SimpleNamespace(vocab_size=np.int64(64))) == 64
    assert model_vocab_size(SimpleNamespace(config=SimpleNamespace(vocab_size=32000.0))) == 32000
    assert model_vocab_size(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="positive"):
        model_vocab_size(SimpleNamespace(vocab_size=0))


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
