"""The sweep behind ``prefixkv compare``: its cells (a remote tier without host capacity, repeated
or impossible cells refused up front, workers capped at the number of cells, a trace without
capacities named) and its automatic capacities (a trace without full blocks, fractions in any order,
numpy fractions, fractions that are not positive numbers refused, concurrent mode's bound covering
what a request holds with its output)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.sim.replay import replay
from prefixkv.sim.sweep import TraceSource, sweep
from prefixkv.sim.traces import load_trace
from prefixkv.sim.workloads import builtin_trace


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    trace = builtin_trace("default", tmp_path_factory.mktemp("traces"))
    return TraceSource("default", (str(trace.path),), "tokens")


# -- a remote tier without a host tier: replay sizes a staging host tier itself ------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_a_remote_tier_sweep_without_host_capacity_returns_its_cells(source, workers):
    # replay stages remote blocks through a host tier of its own size when none is given, and
    # reports that size as host_capacity: the sweep must not look its cells up by it (KeyError)
    results = sweep([source], ["lru", "fifo"], {"default": [50, 100]}, workers=workers, remote_capacity=400)
    assert [(r["policy"], r["capacity"]) for r in results] == [("lru", 50), ("lru", 100), ("fifo", 50),
                                                                ("fifo", 100)]
    assert all(r["remote_capacity"] == 400 for r in results)


# -- auto capacities -------------------------------------------------------------------------

def test_auto_capacities_of_a_trace_without_full_blocks():
    # every prompt shorter than a block: nothing to share (0 distinct blocks), yet each request
    # needs one block; the note used to divide by the 0 distinct blocks
    from prefixkv.sim.sweep import auto_capacities
    from prefixkv.sim.traces import Trace, TraceRequest

    trace = Trace([TraceRequest(float(i), 5, 1, tokens=[1, 2, 3, 4, 5]) for i in range(3)], 16)
    caps, note = auto_capacities(trace)
    assert caps == [1]
    assert note is not None and "1 block" in note


# -- sweep's own arguments ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(capacities={"default": [50, 50]}), "capacity 50 twice"),
    (dict(policies=["lru", "lru"]), "policy 'lru' twice"),
    (dict(host_capacities=(0, 10, 10)), "host capacity 10 twice"),
    (dict(capacities={"default": [0, 50]}), "capacities must be positive"),
    (dict(host_capacities=(-1,)), "host capacities must be >= 0"),
    (dict(workers=-2), "workers must be positive"),
])
def test_sweep_refuses_repeated_and_impossible_cells_up_front(source, kwargs, message):
    # a repeated cell was replayed twice and listed twice (and counted twice by a progress bar
    # sized on the distinct cells); a capacity of 0 failed only once a worker reached it
    args = dict(policies=["lru"], capacities={"default": [50]})
    args.update(kwargs)
    seen = []
    with pytest.raises(ValueError, match=message):
        sweep([source], args.pop("policies"), args.pop("capacities"), on_done=seen.append, **args)
    assert seen == []


# -- auto capacities with other fractions ----------------------------------------------------------

def _big_request_trace():
    from prefixkv.sim.traces import Trace, TraceRequest

    # the largest request (10 blocks) does not fit in half of the 11 distinct blocks
    return Trace([TraceRequest(0.0, 5120, 1, list(range(10))), TraceRequest(1.0, 512, 1, [100])], 512)


def test_auto_capacities_with_one_fraction_starts_at_the_largest_request():
    from prefixkv.sim.sweep import auto_capacities

    # ZeroDivisionError: the geometric steps divided by len(fractions) - 1
    caps, note = auto_capacities(_big_request_trace(), (0.5,))
    assert caps == [10] and "largest request" in note


def test_auto_capacities_reads_fractions_in_any_order():
    from prefixkv.sim.sweep import auto_capacities

    # (0.5, 0.1) took 0.5 as the low end and 0.1 as the high one
    assert auto_capacities(_big_request_trace(), (0.5, 2.0, 1.0)) == auto_capacities(_big_request_trace(),
                                                                                      (0.5, 1.0, 2.0))


@pytest.mark.parametrize("fractions", [(), (0.0, 0.5), (-1.0, 2.0), (0.1, float("nan")), (0.1, "0.5"), (True,)])
def test_auto_capacities_refuses_fractions_that_are_not_positive_numbers(fractions):
    from prefixkv.errors import InvalidArgument
    from prefixkv.sim.sweep import auto_capacities

    # () was an IndexError; 0 or a negative fraction was read as a capacity of 1 block
    with pytest.raises(InvalidArgument) as info:
        auto_capacities(_big_request_trace(), fractions)
    assert info.value.argument == "fractions"


# -- auto capacities: fractions as numpy numbers ---------------------------------------------------

def _trace():
    from prefixkv.sim.traces import Trace, TraceRequest

    return Trace([TraceRequest(float(i), 64, 1, list(range(i * 10, i * 10 + 4))) for i in range(50)], 16)


@pytest.mark.parametrize("fractions", [np.array([0.05, 0.1], dtype=np.float32), (np.float32(0.05), 0.1),
                                       np.array([0.05, 0.1])])
def test_auto_capacities_takes_numpy_fractions(fractions):
    """Fractions checked as numbers take numpy ones too: a numpy float32 (a fractions array read
    with numpy) gives what the equal Python floats give, not an InvalidArgument."""
    from prefixkv.sim.sweep import auto_capacities

    assert auto_capacities(_trace(), fractions) == auto_capacities(_trace(), (0.05, 0.1))


@pytest.mark.parametrize("bad", [(np.float32("nan"),), (np.float64(0.0),), (np.int64(-1),), ("0.1",)])
def test_auto_capacities_still_refuses_bad_numpy_fractions(bad):
    from prefixkv.sim.sweep import auto_capacities

    with pytest.raises(InvalidArgument, match="fractions"):
        auto_capacities(_trace(), bad)


# -- concurrent mode: every request fits with its output ----------------------------------------------

def _write(path, text):
    path.write_text(text)
    return path


def _mooncake(path, rows):
    return _write(path, "".join(json.dumps(dict(zip(("timestamp", "input_length", "output_length", "hash_ids"), r)))
                                + "\n" for r in rows))


def test_concurrent_capacity_bound_covers_what_a_hashed_request_holds(tmp_path):
    # A hashed request holds its hash ids' blocks (the last one whole) plus its output slots:
    # 600 prompt tokens at block size 512 are 2 blocks, 100 output tokens a third, though
    # ceil((600 + 100) / 512) is 2. Three such requests arrive together; at 9 blocks they all run
    # at once, so the clamp must not go below that (it went to 6, and one request waited).
    from prefixkv.sim.sweep import capacity_bound

    trace = load_trace(_mooncake(tmp_path / "m.jsonl", [(0, 600, 100, [1, 2]), (0, 600, 100, [3, 4]),
                                                         (0, 600, 100, [1, 2])]))
    bound = capacity_bound(trace, "concurrent")
    at_bound, above = (replay(trace, "lru", c, mode="concurrent").as_dict() for c in (bound, 100))
    assert above["waited_admissions"] == 0
    assert {k: v for k, v in at_bound.items() if k != "capacity"} == \
           {k: v for k, v in above.items() if k != "capacity"}


def test_auto_capacities_in_concurrent_mode_fit_every_request_with_its_output(tmp_path):
    # 1,000 prompt tokens and 600 output tokens at block size 512: 4 blocks held while running.
    # The auto capacities promise "every request fits"; in concurrent mode they started at 2.
    from prefixkv.cli import main

    trace = _mooncake(tmp_path / "m.jsonl", [(i * 1000, 1000, 600, [2 * i, 2 * i + 1]) for i in range(20)])
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["compare", "--trace", str(trace), "--mode", "concurrent", "--policies", "lru",
                     "--workers", "1", "--json"]) == 0
    rows = json.loads(out.getvalue())["results"]
    assert rows and all(r["oversized_requests"] == 0 for r in rows)
    assert min(r["capacity"] for r in rows) == 4


# -- workers and capacities per trace -------------------------------------------------------------

def _tiny_mooncake(path, n=6):
    with open(path, "w") as f:
        for i in range(n):
            ids = [i % 2, 10 + i]
            f.write(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": ids}) + "\n")
    return path


def test_an_explicit_worker_count_is_capped_at_the_number_of_cells(tmp_path, monkeypatch):
    # --workers 8 for 2 cells started a pool of 8 processes (each forked with the parent's memory);
    # only the default was capped.
    import multiprocessing

    from prefixkv.sim import sweep as sweep_mod

    real = multiprocessing.get_context()
    sizes = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def Pool(self, processes, *args, **kwargs):
            sizes.append(processes)
            return real.Pool(processes, *args, **kwargs)

    monkeypatch.setattr(sweep_mod.multiprocessing, "get_context", lambda *a: Spy())
    source = sweep_mod.TraceSource("m", (str(_tiny_mooncake(tmp_path / "m.jsonl")),), "mooncake")
    results = sweep_mod.sweep([source], ["lru"], {"m": [3, 5]}, workers=8)
    assert len(results) == 2 and sizes == [2]


def test_a_sweep_without_capacities_for_a_trace_names_it(tmp_path):
    # A KeyError: 'b' came out of the sweep's checks, naming nothing.
    from prefixkv.sim.sweep import TraceSource, sweep

    path = str(_tiny_mooncake(tmp_path / "m.jsonl"))
    sources = [TraceSource("a", (path,), "mooncake"), TraceSource("b", (path,), "mooncake")]
    with pytest.raises(ValueError, match="no capacities for trace 'b'"):
        sweep(sources, ["lru"], {"a": [3]}, workers=1)
