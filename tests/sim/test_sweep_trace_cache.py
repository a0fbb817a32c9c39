"""The sweep's trace cache: a trace file is read as it is now, not as an earlier sweep of this
process saw it (a rewritten or changed file is read again); a process holds one trace at a time,
and a sweep over more traces than the cache held loads each a bounded number of times."""

from __future__ import annotations

import json

import pytest

from prefixkv.sim import sweep as sweep_mod
from prefixkv.sim.sweep import TraceSource, sweep
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
