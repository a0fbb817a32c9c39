"""The session policy's cost against LRU's: one replay of the 72-file WEKA set at 5% of its distinct
blocks (16,114), cache mode, the same trace object for both (pytest-benchmark; no timing assertions).

    .venv/bin/pytest benches/test_bench_session.py --benchmark-only       # timed: compare the medians
    .venv/bin/pytest benches/test_bench_session.py --benchmark-disable    # smoke: each body once

Issue 16 asks for session <= 2x LRU here. Without the shared traces (a fresh clone), the bench runs on a
small generated agent trace instead, so the bodies still run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace, TraceRequest, load_trace

MORE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "weka-kv-cache-tester-more"


def _small_agent_trace() -> Trace:
    reqs = []
    for k in range(200):
        session = f"s{k % 20}"
        turn = k // 20
        ids = [1000 * (k % 20) + i for i in range(20 + 4 * turn)]
        reqs.append(TraceRequest(float(k), len(ids) * 64, 10, ids, session=session,
                                 stop="tool_use" if k % 3 else "end_turn"))
    return Trace(reqs, 64, "agent-small")


@pytest.fixture(scope="module")
def trace_and_capacity():
    if MORE.is_dir():
        trace = load_trace(MORE)
        return trace, max(1, round(trace.distinct_blocks() * 0.05))
    # the small stand-in's 20 interleaved sessions need more room than 5% to hit at all
    trace = _small_agent_trace()
    return trace, max(1, round(trace.distinct_blocks() * 0.5))


@pytest.mark.parametrize("policy", ["lru", "session", "lrfu"])
def test_replay_weka_more_at_5_percent(benchmark, trace_and_capacity, policy):
    trace, capacity = trace_and_capacity
    result = benchmark.pedantic(replay, args=(trace, policy, capacity), rounds=3, iterations=1)
    assert result.requests == len(trace) and 0 < result.block_hit_rate < 1
    if policy == "session":
        assert result.predictions == len(trace) and result.return_auc is not None
