"""``prefixkv trace export``: libCacheSim's formats, both orders, bad input, and the round trip
(libCacheSim's LRU on the forward-reverse stream hits the blocks prefixkv's LRU replay hits)."""

from __future__ import annotations

import csv
import json
import os
import random

import pytest

from prefixkv.cli import main
from prefixkv.sim.export import block_stream, export_trace, next_access, read_oracle_general
from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace, TraceRequest, load_trace

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces", "conversation_trace.jsonl")


def chain_trace(seed: int = 0, n: int = 400) -> Trace:
    """Prefix-chained block ids: conversations that grow turn by turn, and shared system prompts."""
    rng = random.Random(seed)
    next_id = iter(range(1, 10**9))
    systems = [[next(next_id) for _ in range(rng.randrange(1, 4))] for _ in range(3)]
    convs: list[list[int]] = []
    requests = []
    for t in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
        else:
            conv = list(rng.choice(systems))
            convs.append(conv)
        conv += [next(next_id) for _ in range(rng.randrange(1, 4))]
        blocks = conv[:12]
        requests.append(TraceRequest(timestamp=float(t) * 0.5, input_length=len(blocks) * 4, output_length=1,
                                     block_hashes=list(blocks)))
    return Trace(requests, block_size=4)


def test_orders_and_next_access():
    trace = Trace([TraceRequest(0.0, 8, 1, block_hashes=[70, 71]), TraceRequest(2.5, 12, 1, block_hashes=[70, 71, 72])],
                  block_size=4)
    assert block_stream(trace, "forward") == ([0, 0, 2, 2, 2], [1, 2, 1, 2, 3])
    assert block_stream(trace, "forward-reverse") == ([0] * 4 + [2] * 6, [1, 2, 2, 1, 1, 2, 3, 3, 2, 1])
    assert next_access([1, 2, 2, 1, 3]) == [3, 2, -1, -1, -1]


def test_oracle_general_and_csv_records(tmp_path):
    trace = chain_trace(n=30)
    summary = export_trace(trace, tmp_path / "t.bin", "oracle-general", "forward")
    records = read_oracle_general(tmp_path / "t.bin")
    assert len(records) == summary.references == summary.lookups == trace.num_block_accesses()
    _, ids = block_stream(trace, "forward")
    assert [r[1] for r in records] == ids and {r[2] for r in records} == {1}
    assert [r[3] for r in records] == next_access(ids)
    export_trace(trace, tmp_path / "t.csv", "csv", "forward")
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["timestamp", "obj_id", "obj_size", "next_access_vtime"]
    assert [tuple(map(int, row)) for row in rows[1:]] == records


def test_bad_arguments_name_the_problem(tmp_path):
    trace = chain_trace(n=5)
    with pytest.raises(ValueError, match="format"):
        export_trace(trace, tmp_path / "x", "parquet")
    with pytest.raises(ValueError, match="order"):
        export_trace(trace, tmp_path / "x", "csv", "backward")
    (tmp_path / "odd.bin").write_bytes(b"\0" * 25)
    with pytest.raises(ValueError, match="whole number of 24-byte"):
        read_oracle_general(tmp_path / "odd.bin")


def test_cli_exports_and_refuses_to_overwrite(tmp_path, capsys):
    src = tmp_path / "w.jsonl"
    assert main(["workload", "--name", "default", "--requests", "40", "--out", str(src)]) == 0
    out = tmp_path / "w.bin"
    capsys.readouterr()
    assert main(["trace", "export", str(src), str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["order"] == "forward-reverse" and doc["references"] == 2 * doc["lookups"] > 0
    assert "ORACLE_GENERAL_TRACE" in doc["reader_options"]
    assert len(read_oracle_general(out)) == doc["references"]
    with pytest.raises(SystemExit):
        main(["trace", "export", str(src), str(out)])
    assert "exists; give --force" in capsys.readouterr().err
    assert main(["trace", "export", str(src), str(out), "--force", "--format", "csv", "--order", "forward"]) == 0
    assert "csv lru" in capsys.readouterr().out


def _libcachesim_lru_hits(lcs, path, fmt, capacity, references):
    if fmt == "csv":
        params = lcs.ReaderInitParam(has_header=True, delimiter=",")
        params.time_field, params.obj_id_field, params.obj_size_field, params.next_access_vtime_field = 1, 2, 3, 4
        reader = lcs.TraceReader(str(path), lcs.TraceType.CSV_TRACE, params)
    else:
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _ = lcs.LRU(capacity).process_trace(reader)
    return round((1 - miss_ratio) * references)


@pytest.mark.parametrize("fmt", ["oracle-general", "csv"])
def test_round_trip_libcachesim_lru_hits_what_prefixkv_lru_hits(tmp_path, fmt):
    lcs = pytest.importorskip("libcachesim", reason="libcachesim is not installed (pip install -e '.[test]')")
    trace = chain_trace(seed=3)
    summary = export_trace(trace, tmp_path / "t", fmt, "forward-reverse")
    matched = 0
    for capacity in (summary.largest_request, 20, 40, 90):
        ours = replay(trace, "lru", capacity).block_hits
        theirs = _libcachesim_lru_hits(lcs, tmp_path / "t", fmt, capacity, summary.references)
        assert theirs - summary.lookups == ours       # every release reference hits
        matched += ours > 0
    assert matched == 4
    # the forward stream is no paged LRU: a per-object LRU keeps extensions without their prefix
    export_trace(trace, tmp_path / "f", fmt, "forward")
    forward = _libcachesim_lru_hits(lcs, tmp_path / "f", fmt, 40, summary.lookups)
    assert forward != replay(trace, "lru", 40).block_hits


@pytest.mark.skipif(not os.path.exists(SHARED), reason="the shared Mooncake trace is not on this machine")
def test_round_trip_on_the_shared_conversation_trace(tmp_path):
    lcs = pytest.importorskip("libcachesim", reason="libcachesim is not installed (pip install -e '.[test]')")
    trace = load_trace(SHARED)
    trace.requests = trace.requests[:2000]
    summary = export_trace(trace, tmp_path / "c.bin")
    for capacity in (summary.largest_request, 4 * summary.largest_request):
        ours = replay(trace, "lru", capacity).block_hits
        assert _libcachesim_lru_hits(lcs, tmp_path / "c.bin", "oracle-general", capacity,
                                     summary.references) - summary.lookups == ours
