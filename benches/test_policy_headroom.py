"""The headroom script's two bounds on hand-checked traces (not timed)."""

from __future__ import annotations

import json

import pytest

from policy_headroom import ReuseOraclePolicy, headroom, hindsight_probabilities
from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace, TraceRequest


def single_blocks(ids: list[int]) -> Trace:
    return Trace([TraceRequest(float(i), 512, 1, [h]) for i, h in enumerate(ids)], block_size=512)


def test_reuse_oracle_evicts_dead_blocks_first():
    # Capacity 2. A B C A B: LRU evicts A for C, then B for A, then C for B: no hit. The oracle
    # knows C is never used again, so A's return evicts C and B hits.
    trace = single_blocks([1, 2, 3, 1, 2])
    assert replay(trace, "lru", 2).block_hits == 0
    assert replay(trace, ReuseOraclePolicy(), 2).block_hits == 1


def test_hindsight_probabilities_are_calibrated_and_monotone_along_a_chain():
    # Conversation-like: every request shares root 0; chain [0, 10] comes back once, [0, 20] never.
    reqs = [TraceRequest(0.0, 1024, 1, [0, 10]), TraceRequest(1.0, 1024, 1, [0, 20]),
            TraceRequest(2.0, 1536, 1, [0, 10, 11])]
    probs = hindsight_probabilities(reqs)
    # First requests: the depth-1 blocks share one cell (first access, leaf, turn 0): 1 of 2 reused.
    assert probs[0][1] == probs[1][1] == 0.5
    for row in probs:
        assert all(parent >= child for parent, child in zip(row, row[1:]))
    # Nothing after the last request: its blocks' cells were never reused.
    assert probs[2][-1] == 0.0


def test_headroom_runs_on_a_mooncake_file(tmp_path):
    path = tmp_path / "tiny.jsonl"
    lines = []
    for i in range(60):
        conversation = i % 7
        turn = i // 7
        ids = [0] + [1000 * conversation + k for k in range(1, turn + 2)]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 8,
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    row = headroom(path, 6, ["lrfu"])
    rates = row["rates"]
    assert row["capacity"] == 6
    assert set(rates) == {"lru", "lrfu", "belady", "reuse oracle", "hindsight table"}
    for name, rate in rates.items():
        assert 0.0 <= rate <= rates["belady"] + 1e-12, name
    assert rates["reuse oracle"] >= rates["lru"]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
