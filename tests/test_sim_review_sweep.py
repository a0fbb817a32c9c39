"""Review of the sweep behind ``prefixkv compare`` (process pool and Ray backends), the remote
tier's replay model, the slot store and the lab: each test was written to fail first."""

from __future__ import annotations

import json

import pytest

from prefixkv.sim import sweep as sweep_mod
from prefixkv.sim.sweep import SweepCellError, TraceSource, sweep
from prefixkv.sim.workloads import builtin_trace


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    trace = builtin_trace("default", tmp_path_factory.mktemp("traces"))
    return TraceSource("default", (str(trace.path),), "tokens")


def _mooncake(path, requests):
    with open(path, "w") as f:
        for i, ids in enumerate(requests):
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                "hash_ids": ids}) + "\n")


# -- a remote tier without a host tier: replay sizes a staging host tier itself ------------------

@pytest.mark.parametrize("workers", [1, 2])
def test_a_remote_tier_sweep_without_host_capacity_returns_its_cells(source, workers):
    # replay stages remote blocks through a host tier of its own size when none is given, and
    # reports that size as host_capacity: the sweep must not look its cells up by it (KeyError)
    results = sweep([source], ["lru", "fifo"], {"default": [50, 100]}, workers=workers, remote_capacity=400)
    assert [(r["policy"], r["capacity"]) for r in results] == [("lru", 50), ("lru", 100), ("fifo", 50),
                                                                ("fifo", 100)]
    assert all(r["remote_capacity"] == 400 for r in results)


def test_compare_prints_a_table_for_a_remote_tier_without_host_capacity(capsys):
    from prefixkv.cli import main

    code = main(["compare", "--policies", "lru,fifo", "--capacities", "200", "--remote-capacity", "500",
                 "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "lru" in out and "fifo" in out


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


# -- a trace file is read as it is now, not as an earlier sweep of this process saw it ----------

@pytest.mark.parametrize("workers", [1, 2])
def test_a_rewritten_trace_file_is_read_again(tmp_path, workers):
    path = tmp_path / "t.jsonl"
    _mooncake(path, [[1, 2 + i % 3] for i in range(10)])
    source = TraceSource("t", (str(path),), "mooncake")
    assert len(source.load()) == 10      # as compare's auto capacities load it, before the workers fork
    assert sweep([source], ["lru"], {"t": [4]}, workers=workers)[0]["requests"] == 10
    _mooncake(path, [[1, 2 + i % 3] for i in range(40)])
    again = sweep([source], ["lru", "fifo"], {"t": [4]}, workers=workers)
    assert [r["requests"] for r in again] == [40, 40]
    assert len(source.load()) == 40


# -- the slot store refuses what a real store could not do, instead of wrapping or broadcasting ----

def test_slot_store_refuses_a_negative_slot():
    from prefixkv.sim.slotstore import UNWRITTEN, SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(IndexError):
        store.write([-1], [5])            # numpy wrapped it to the pool's last slot
    assert (store.slots == UNWRITTEN).all()


def test_slot_store_refuses_a_count_mismatch():
    from prefixkv.sim.slotstore import UNWRITTEN, SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(ValueError, match="3 slots.*1 value"):
        store.write([0, 1, 2], [9])       # numpy broadcast the one value into three slots
    assert (store.slots == UNWRITTEN).all()


def test_slot_store_gather_refuses_a_negative_block_and_a_length_past_the_table():
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(IndexError):
        store.gather([-1], 4)             # read the pool's last block
    with pytest.raises(ValueError, match="20 tokens.*8 slots"):
        store.gather([0, 1], 20)          # returned 8 values, silently short
    with pytest.raises(IndexError):
        store.copy_blocks([(0, -1)])


# -- a worker process that dies (killed for memory, a crashing extension) ends the sweep naming its cell --

_CRASH_SCRIPT = """
import os, sys
from prefixkv.policies import LRUPolicy, register
from prefixkv.sim import sweep as sweep_mod
from prefixkv.sim.sweep import SweepCellError, TraceSource, sweep

PARENT = os.getpid()

class DiesInWorker(LRUPolicy):
    name = "dies"
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if os.getpid() != PARENT:
            os._exit(3)

register("dies", DiesInWorker)
source = TraceSource("default", (sys.argv[1],), "tokens")
try:
    sweep([source], ["lru", "dies"], {"default": [50, 100]}, workers=2)
except SweepCellError as exc:
    print("ERROR", exc)
"""


def test_a_worker_that_dies_ends_the_sweep_naming_its_cell(source):
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _CRASH_SCRIPT, source.paths[0]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)       # the pool waited forever for the lost cell
        proc.communicate()
        pytest.fail("the sweep hung after a worker process died")
    assert proc.returncode == 0, err
    assert out.startswith("ERROR default, policy dies, capacity "), out
    assert "worker process" in out and "died" in out


class _FakeRay:
    """Just what ``ray_backend.run_cells`` calls; a task's outcome is decided by ``outcome(cell)``."""

    class TaskError(Exception):
        pass

    def __init__(self, outcome):
        self.outcome = outcome
        self.cancelled = []
        self.shut_down = False

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        pass

    def shutdown(self):
        self.shut_down = True

    def put(self, value):
        return value

    def remote(self, **kwargs):
        fake = self

        def wrap(fn):
            class Task:
                @staticmethod
                def remote(cell, trace, options):
                    return ("ref", cell)
            return Task
        return wrap

    def wait(self, refs, num_returns=1):
        return refs[:1], refs[1:]

    def get(self, ref):
        return self.outcome(ref[1])

    def cancel(self, ref, force=False):
        self.cancelled.append(ref)


def test_a_ray_task_that_fails_outside_replay_is_named(source, monkeypatch):
    # a Ray worker killed for memory (or a cell that cannot be deserialised) fails in ray.get,
    # outside replay_cell's error record: the sweep's error must still name the cell
    import sys

    def outcome(cell):
        if cell.capacity == 100:
            raise _FakeRay.TaskError("The worker died unexpectedly while executing this task")
        return {"policy": cell.policy, "capacity": cell.capacity, "trace": cell.source.label}

    fake = _FakeRay(outcome)
    monkeypatch.setitem(sys.modules, "ray", fake)
    with pytest.raises(SweepCellError, match=r"^default, policy lru, capacity 100: TaskError: The worker died"):
        sweep([source], ["lru"], {"default": [50, 100, 200]}, backend="ray")
    assert fake.shut_down and len(fake.cancelled) == 1       # the cell still pending is cancelled


# -- the remote tier's counters ------------------------------------------------------------------

def test_remote_counters_leave_out_the_warmup(source):
    from prefixkv.sim.replay import replay

    trace = source.load()
    whole = replay(trace, "lru", 100, host_capacity=50, remote_capacity=500).as_dict()
    measured = replay(trace, "lru", 100, host_capacity=50, remote_capacity=500, warmup=0.5).as_dict()
    assert measured["tier_block_hits"]["remote"] < whole["tier_block_hits"]["remote"]   # windowed
    assert measured["remote_fetches"] < whole["remote_fetches"]


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


def _mooncake_lines(rows) -> str:
    return "".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                   for ts, n, ids in rows)


# -- the sweep's trace cache --------------------------------------------------------------------

def _traces(tmp_path, count: int) -> list[TraceSource]:
    sources = []
    for k in range(count):
        path = tmp_path / f"m{k}.jsonl"
        path.write_text(_mooncake_lines([(i, 1024, [100 * k + i, 100 * k + i + 1]) for i in range(6)]))
        sources.append(TraceSource(f"m{k}", (str(path),), "mooncake"))
    return sources


def _count_loads(monkeypatch, log):
    """Every load_trace the sweep makes appends its path to ``log`` (a file: pool workers are forked)."""
    real = sweep_mod.load_trace

    def counting(path, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{path}\n")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(sweep_mod, "load_trace", counting)
    sweep_mod._forget_trace()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_over_more_traces_than_the_cache_held_loads_each_a_bounded_number_of_times(
        tmp_path, monkeypatch, workers):
    # Cells ran biggest capacity first across all traces, so a process cycled through the six traces
    # once per capacity and its four-trace cache reloaded every one of them each time (18 loads serially).
    sources = _traces(tmp_path, 6)
    log = tmp_path / "loads.log"
    _count_loads(monkeypatch, log)
    results = sweep(sources, ["lru", "fifo"], {s.label: [2, 4, 8] for s in sources}, workers=workers)
    assert len(results) == 36
    loads = log.read_text().split()
    assert sorted(set(loads)) == sorted(s.paths[0] for s in sources)
    assert all(loads.count(path) <= workers for path in set(loads)), loads
    assert [(r["trace"], r["policy"], r["capacity"]) for r in results] == \
        [(s.label, p, c) for s in sources for p in ("lru", "fifo") for c in (2, 4, 8)]


def test_a_process_holds_one_trace_at_a_time(tmp_path, monkeypatch):
    sources = _traces(tmp_path, 3)
    _count_loads(monkeypatch, tmp_path / "loads.log")
    for s in sources:
        s.load()
    assert sweep_mod._held is not None and sweep_mod._held[0][0] == sources[-1].paths


def test_a_changed_file_is_reloaded(tmp_path, monkeypatch):
    (source,) = _traces(tmp_path, 1)
    log = tmp_path / "loads.log"
    _count_loads(monkeypatch, log)
    assert len(source.load()) == 6 and len(source.load()) == 6
    with open(source.paths[0], "a") as f:
        f.write(_mooncake_lines([(99, 512, [999])]))
    assert len(source.load()) == 7
    assert len(log.read_text().split()) == 2


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
