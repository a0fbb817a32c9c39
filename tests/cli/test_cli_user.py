"""The command line as a new user meets it: Ctrl-C, sizes, outputs checked before the work,
files never replaced silently, the cached built-in trace verified, tables that fit a terminal.

Subprocess tests run the installed ``prefixkv`` entry point the way a user does; their time
bounds are generous (a busy 2-core machine), the targets are measured in benches/RESULTS.md.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import stat
import subprocess
import sys
import time

import pytest

from prefixkv.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"
PREFIXKV = [sys.executable, "-m", "prefixkv"]


def cli(*argv, env=None, timeout=120, cwd=None):
    return subprocess.run([*PREFIXKV, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _interrupt_once_workers_run(argv, tmp_path, *, wait_for_workers: int) -> tuple[subprocess.CompletedProcess, float]:
    """Start ``prefixkv argv`` in its own process group, wait until its sweep has worker processes,
    send SIGINT to the whole group (what Ctrl-C in a terminal does); (result, seconds to exit)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([*PREFIXKV, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < wait_for_workers and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"finished before it could be interrupted: {proc.communicate()}"
    time.sleep(0.3)          # let the workers start on their cells
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("still running 10 s after Ctrl-C")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), time.monotonic() - sent


# -- 1. Ctrl-C ------------------------------------------------------------------------------

def test_ctrl_c_stops_the_readme_main_command(tmp_path):
    result, took = _interrupt_once_workers_run(["compare"], tmp_path, wait_for_workers=1)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1] == "interrupted"
    assert took < 10
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []                  # no half-written trace or plot


@pytest.mark.skipif(not CONVERSATION.exists(), reason=f"{CONVERSATION} is not here")
def test_ctrl_c_stops_a_two_worker_sweep_and_shows_the_finished_cells(tmp_path):
    result, took = _interrupt_once_workers_run(
        ["compare", "--trace", str(CONVERSATION), "--workers", "2", "--plot", str(tmp_path / "x.png")],
        tmp_path, wait_for_workers=2)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr and "interrupted" in result.stderr
    assert took < 10
    assert list(tmp_path.iterdir()) == []   # no plot of a partial sweep, no temporary file
    if result.stdout:                       # cells that finished before Ctrl-C, marked as such
        assert "INCOMPLETE" in result.stdout


def test_interrupted_sweep_keeps_its_finished_cells():
    from prefixkv.sim.sweep import SweepInterrupted, TraceSource, sweep
    from prefixkv.sim.workloads import builtin_trace

    source = TraceSource("default", (str(builtin_trace("default").path),), "tokens")
    seen = []

    def stop_after_two(result):
        seen.append(result)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(SweepInterrupted) as info:
        sweep([source], ["lru", "fifo"], {"default": [100, 200]}, workers=1, on_done=stop_after_two)
    assert len(info.value.finished) == 2 and info.value.total == 4


# -- 2. sizes -------------------------------------------------------------------------------

def test_a_capacity_past_what_the_trace_can_fill_is_clamped_and_reported(tmp_path):
    result = cli("replay", "--capacity", "1000000000", "--json", env={"TMPDIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["requested_capacity"] == 1_000_000_000
    assert doc["effective_capacity"] == doc["capacity"] < 10_000
    assert "more than this trace can ever fill" in result.stderr
    huge = cli("replay", "--capacity", str(10**20), env={"TMPDIR": str(tmp_path)}, timeout=60)
    assert huge.returncode == 0 and "Traceback" not in huge.stderr
    assert "ever fill" in huge.stdout


def test_the_clamp_does_not_change_the_result(tmp_path):
    from prefixkv.sim.replay import replay
    from prefixkv.sim.sweep import capacity_bound
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default", tmp_path)
    for mode in ("cache", "concurrent"):
        bound = capacity_bound(trace, mode)
        at_bound, above = (replay(trace, "lru", c, mode=mode).as_dict() for c in (bound, 3 * bound))
        assert {k: v for k, v in at_bound.items() if k != "capacity"} == \
               {k: v for k, v in above.items() if k != "capacity"}


@pytest.mark.parametrize("argv", [
    ["bench", "--pool", "1000000TiB"],
    ["generate", "--requests", "100000000"],
    ["workload", "--requests", "100000000", "--out", "never.jsonl"],
])
def test_impossible_sizes_are_refused_up_front_with_the_memory_they_need(argv, tmp_path):
    start = time.monotonic()
    result = cli(*argv, cwd=tmp_path, env={"TMPDIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "of host memory" in result.stderr and "available" in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 30
    assert not (tmp_path / "never.jsonl").exists()


# -- 3 and 4. outputs checked before the work, named as written -----------------------------

def test_compare_checks_the_plot_path_before_any_cell(tmp_path):
    start = time.monotonic()
    result = cli("compare", "--trace", str(CONVERSATION), "--plot", "/nonexistent/dir/x.png", timeout=60)
    assert result.returncode == 2 and "directory /nonexistent/dir does not exist" in result.stderr
    assert time.monotonic() - start < 30           # refused at once, not after a sweep


def test_plot_options_need_matplotlib_before_the_run(tmp_path):
    fake = tmp_path / "no-matplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {"PYTHONPATH": str(fake.parent), "TMPDIR": str(tmp_path)}
    for argv in (["bench", "--requests", "5", "--plot", str(tmp_path / "plots")],
                 ["compare", "--capacities", "100", "--plot", str(tmp_path / "x.png")]):
        result = cli(*argv, env=env)
        assert result.returncode == 2 and "needs matplotlib" in result.stderr and "Traceback" not in result.stderr
        assert result.stdout == ""                 # nothing ran


def test_an_unwritable_output_directory_is_refused_before_the_run(tmp_path):
    result = cli("bench", "--requests", "5", "--plot", "/proc/prefixkv-plots", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 2 and "cannot write into '/proc'" in result.stderr


def test_a_failed_plot_write_keeps_the_printed_results(tmp_path, capsys, monkeypatch):
    import prefixkv.bench.report as report

    def broken(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_plots", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--requests", "5", "--block-sizes", "16", "--plot", str(tmp_path / "plots")])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and "No space left" in err
    assert "tail waste" in out                     # the table came first


def test_plot_file_names_what_is_written(tmp_path):
    from prefixkv.outputs import OutputError, plot_file

    (tmp_path / "adir").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        plot_file(tmp_path / "adir")
    assert plot_file(tmp_path / "notes") == tmp_path / "notes.png"
    assert plot_file(tmp_path / "x.svg") == tmp_path / "x.svg"


def test_compare_reports_the_file_it_wrote(tmp_path):
    result = cli("compare", "--policies", "lru", "--capacities", "100", "--plot", str(tmp_path / "notes"),
                 env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "notes.png").stat().st_size > 0 and not (tmp_path / "notes").exists()
    assert f"plot written to {tmp_path / 'notes.png'}" in result.stdout


def test_workload_never_replaces_a_trace_without_force(tmp_path):
    target = tmp_path / "mytrace.jsonl"
    target.write_text("precious\n")
    refused = cli("workload", "--requests", "5", "--out", str(target))
    assert refused.returncode == 2 and "--force" in refused.stderr and target.read_text() == "precious\n"
    forced = cli("workload", "--requests", "5", "--out", str(target), "--force")
    assert forced.returncode == 0 and target.read_text().startswith("{")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mytrace.jsonl"]


# -- 5. the cached built-in trace -----------------------------------------------------------

def test_a_cut_or_corrupt_cached_trace_is_regenerated(tmp_path):
    from prefixkv.sim.workloads import builtin_trace

    path = builtin_trace("default", tmp_path).path
    fresh = pathlib.Path(path).read_bytes()
    lines = fresh.splitlines(keepends=True)
    pathlib.Path(path).write_bytes(b"".join(lines[:51]))            # header + 50 requests
    assert len(builtin_trace("default", tmp_path).requests) == 300
    pathlib.Path(path).write_bytes(fresh[:1000] + b"\x95\x00garbage" + fresh[1010:])
    assert len(builtin_trace("default", tmp_path).requests) == 300
    assert pathlib.Path(path).read_bytes() == fresh


# -- 6. tables that fit a terminal ----------------------------------------------------------

def _bench_result():
    from prefixkv.bench import BenchConfig, run_bench
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default")
    trace.requests = trace.requests[:20]
    return run_bench(trace, BenchConfig(block_sizes=(4, 8, 16, 32, 64, 128)))


def test_the_bench_table_fits_80_columns_and_wide_keeps_one(tmp_path):
    from rich.console import Console

    from prefixkv.bench.report import render

    result = _bench_result()
    for wide, tables in ((False, 2), (True, 1)):
        console = Console(width=80, record=True, file=open(os.devnull, "w"))
        render(result, console=console, wide=wide)
        text = console.export_text()
        assert text.count("┏") == tables
        if not wide:
            assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80


# -- 7. the engine executor's threads and the spinner's ETA ---------------------------------

def test_bench_engine_pins_torch_threads_and_the_spinner_says_time_left():
    pytest.importorskip("torch")
    import torch

    from prefixkv.bench import BenchConfig, run_bench
    from prefixkv.bench.cli import _progress
    from prefixkv.bench.cli import ENGINE_SPEC
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default")
    trace.requests = trace.requests[:2]
    seen = []
    before = torch.get_num_threads()
    run_bench(trace, BenchConfig(block_sizes=(16,), pool_bytes=2**20, spec=ENGINE_SPEC, executor="engine",
                                 threads=1), vocab=256, on_done=lambda _: seen.append(torch.get_num_threads()))
    assert seen == [1] and torch.get_num_threads() == before

    class Status:
        text = ""

        def update(self, text):
            self.text = text

    status = Status()
    tick = _progress(status, total=3)
    tick(16)
    assert "1 of 3" in status.text and "s left" in status.text


# -- 8. auto capacities start where the requests fit ----------------------------------------

def test_auto_capacities_start_where_every_request_fits(tmp_path):
    result = cli("compare", "--policies", "lru", "--json", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["results"]
    assert len(rows) == 6 and all(r["oversized_requests"] == 0 for r in rows)
    text = cli("compare", "--policies", "lru", env={"TMPDIR": str(tmp_path)}).stdout
    assert "auto capacities start at" in text and "the largest request" in text


# -- 10. messages ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["bench", "--cost-params", "{empty}"], "cost parameters {empty}: not valid JSON"),
    (["workload", "--seed", "-1", "--out", "x.jsonl"], "argument --seed: expected a non-negative integer"),
    (["replay", "--policy", "belady", "--mode", "concurrent", "--capacity", "10"], "--mode cache"),
    (["bench", "--pool", "-1GiB"], "argument --pool"),
    (["replay", "--trace", "{empty}", "--workload", "chat", "--capacity", "10"], "give one or the other"),
    (["bench", "--trace", "{empty}", "--workload", "chat"], "give one or the other"),
    (["bench", "--reserve-tokens", "100"], "needs --compare-reserved"),
])
def test_messages_name_the_option_or_file(argv, message, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    argv = [a.replace("{empty}", str(empty)) for a in argv]
    result = cli(*argv, cwd=tmp_path, env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 2 and message.replace("{empty}", str(empty)) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "expected one argument" not in result.stderr


def test_bench_plots_say_what_they_show(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from prefixkv.bench import BenchConfig, run_bench
    from prefixkv.bench.report import write_plots
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default")
    trace.requests = trace.requests[:20]
    result = run_bench(trace, BenchConfig(block_sizes=(8, 16)), compare_reserved=True)
    saved = []
    original = Figure.savefig

    def keep(fig, path, *args, **kwargs):
        saved.append(fig)
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    paths = write_plots(result, tmp_path)
    named = dict(zip((p.name for p in paths), saved))
    hit_axis = named["block_size.png"].axes[0]
    assert hit_axis.get_ylim()[0] == 0
    reserved_labels = [ax.get_ylabel() for ax in named["reserved.png"].axes]
    assert "running requests (time-weighted mean)" in reserved_labels
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


# -- 11. --version and python -m ------------------------------------------------------------

def test_version_and_python_dash_m():
    from prefixkv import __version__

    result = cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"prefixkv {__version__}"
    assert cli("plan", "--json").returncode == 0


# -- 12. hypothesis profiles ----------------------------------------------------------------

def test_the_state_machine_takes_its_size_from_the_profile():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/core/test_stateful.py::TestKVCacheManagerStateful", "--hypothesis-show-statistics"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "PREFIXKV_HYPOTHESIS_PROFILE": "quick"})
    assert result.returncode == 0, result.stdout[-2000:]
    assert "10 passing" in result.stdout


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
