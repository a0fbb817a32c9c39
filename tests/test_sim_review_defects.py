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
