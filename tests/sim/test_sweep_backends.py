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
