"""Defects found in review of the replay / compare / bench paths, one test each."""

import json

import pytest

from prefixkv.sim.replay import replay
from prefixkv.sim.traces import load_trace


def _write(path, text):
    path.write_text(text)
    return path


def test_kvcache_tester_token_hits_never_count_the_unhashed_tail(tmp_path):
    # kv-cache-tester hash_ids cover the full blocks only: a 100-token request at block size 64
    # has one hashed block (64 tokens) and a 36-token tail that no cache can serve. The second,
    # identical request hits its one block: 64 tokens, not 100.
    doc = {"id": "c1", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 100, "out": 5, "hash_ids": [1]},
        {"t": 1.0, "type": "n", "in": 100, "out": 5, "hash_ids": [1]}]}
    trace = load_trace(_write(tmp_path / "c1.json", json.dumps(doc)))
    for mode in ("cache", "concurrent"):
        r = replay(trace, "lru", 10, mode=mode)
        assert (r.block_accesses, r.block_hits) == (2, 1)
        assert r.hit_tokens == 64, mode
        assert r.token_hit_rate == pytest.approx(64 / 200)


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


def test_kvcache_tester_entry_with_hash_ids_and_nested_requests_is_refused_not_half_read(tmp_path):
    # An entry holding both its own hash_ids and nested requests was read as one request and its
    # nested requests were dropped without a word. It is ambiguous: refuse it, naming the entry.
    from prefixkv.sim.traces import TraceFormatError

    doc = {"id": "c", "block_size": 4, "requests": [
        {"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]},
        {"t": 1, "in": 8, "out": 1, "hash_ids": [1, 2],
         "requests": [{"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]}]}]}
    path = _write(tmp_path / "c.json", json.dumps(doc))
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:1: requests[1]:")
    assert "hash_ids" in str(err.value) and "requests" in str(err.value)


def test_kvcache_tester_local_ids_never_collide_with_a_global_file(tmp_path):
    # File 0's local namespace (k = 0) was the global ids' own: local id 1 of the first file and
    # global id 1 of another file were taken for the same block (hits that never happened).
    from prefixkv.sim.traces import load_kvcache_tester

    for stem, scope in (("a", "local"), ("b", "global"), ("c", "global")):
        doc = {"id": stem, "block_size": 4, "hash_id_scope": scope,
               "requests": [{"t": 0.0, "in": 8, "out": 1, "hash_ids": [1, 2]}]}
        _write(tmp_path / f"{stem}.json", json.dumps(doc))
    trace = load_kvcache_tester(tmp_path)
    a, b, c = trace.requests
    assert b.block_hashes == c.block_hashes == [1, 2]          # global ids are shared, as they are
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert trace.distinct_blocks() == 4
    assert replay(trace, "lru", 100).block_hits == 2
