"""compare's two backends: the local process pool and Ray give identical results, and a failing
cell is named (trace, policy, capacity) whichever runs it."""

from __future__ import annotations

import importlib.util

import pytest

from prefixkv.sim.sweep import SweepCellError, TraceSource, sweep
from prefixkv.sim.workloads import builtin_trace

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = [pytest.mark.ray, pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (extra [ray])")]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    trace = builtin_trace("default", tmp_path_factory.mktemp("traces"))
    return TraceSource("default", (str(trace.path),), "tokens")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.parametrize("backend", ["process", pytest.param("ray", marks=needs_ray)])
def test_a_failing_cell_is_named(source, backend, request):
    if backend == "ray":
        request.getfixturevalue("local_ray")
    # belady needs trace order: every cell fails in replay, inside a worker
    with pytest.raises(SweepCellError, match=r"^default, policy belady, capacity 100: ValueError: belady"):
        sweep([source], ["belady"], {"default": [100]}, mode="concurrent", workers=2, backend=backend)


@pytest.mark.ray
@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (extra [ray])")
def test_ray_gives_the_process_pools_results(source, local_ray):
    caps = {"default": [60, 300, 1500]}
    seen = []
    by_ray = sweep([source], ["lru", "fifo", "belady"], caps, backend="ray", on_done=seen.append)
    by_pool = sweep([source], ["lru", "fifo", "belady"], caps, backend="process", workers=2)
    assert by_ray == by_pool and len(by_ray) == 9
    assert len(seen) == 9                     # the progress bar advances per cell


def test_unknown_backend_is_refused(source):
    with pytest.raises(ValueError, match="backend must be one of process, ray"):
        sweep([source], ["lru"], {"default": [10]}, backend="dask")


@pytest.mark.ray
@pytest.mark.skipif(not HAS_RAY, reason="ray is not installed (extra [ray])")
def test_ray_loads_and_puts_each_trace_once(tmp_path, local_ray, monkeypatch):
    # Every cell of a trace reads the one object the driver put, not a copy pickled into each task.
    import json

    import ray

    from prefixkv.sim import sweep as sweep_mod

    sources = []
    for k in range(5):
        path = tmp_path / f"m{k}.jsonl"
        path.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                                            "hash_ids": [10 * k + i, 10 * k + i + 1]}) + "\n" for i in range(4)))
        sources.append(TraceSource(f"m{k}", (str(path),), "mooncake"))
    loads, puts = [], []
    real_load, real_put = sweep_mod.load_trace, ray.put
    monkeypatch.setattr(sweep_mod, "load_trace", lambda path, **kw: loads.append(path) or real_load(path, **kw))
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value, **kw))
    sweep_mod._forget_trace()
    results = sweep(sources, ["lru", "fifo"], {s.label: [2, 4, 8] for s in sources}, backend="ray")
    assert len(results) == 30
    assert sorted(loads) == sorted(s.paths[0] for s in sources)
    assert [t.path for t in puts] == [s.paths[0] for s in sources]


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
