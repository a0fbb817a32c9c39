"""The fleet simulator and ``prefixkv fleet``: the issue's acceptance points on smaller slices.

Full-size figures (whole conversation trace, built-in ``large``) are in benches/RESULTS.md;
the simulator is deterministic, so these thresholds cannot flake.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import pytest

from prefixkv.fleet.cli import main
from prefixkv.fleet.simulator import FleetConfig, compare, simulate
from prefixkv.sim.traces import Trace, load_trace
from prefixkv.sim.workloads import builtin_trace

CONVERSATION = pathlib.Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
JSON_KEYS = {"router", "hit_rate", "single_hit_rate", "round_robin_hit_rate", "busiest_share", "p99_wait_s",
             "round_robin_p99_wait_s"}


def _conversation_slice(n: int = 3000) -> Trace:
    if not CONVERSATION.exists():
        pytest.skip(f"shared trace not found: {CONVERSATION}")
    full = load_trace(CONVERSATION)
    return Trace(full.requests[:n], full.block_size, name="conversation[:3000]")


def _two_percent(trace: Trace) -> int:
    return round(0.02 * trace.distinct_blocks())


@pytest.fixture(scope="module", params=["conversation", "large"])
def acceptance(request):
    trace = _conversation_slice() if request.param == "conversation" else builtin_trace("large")
    config = FleetConfig(replicas=4, capacity=_two_percent(trace), router="kv-aware+guard")
    return trace, config, compare(trace, config)


def test_guarded_router_beats_round_robin_near_the_pooled_cache(acceptance):
    _, _, out = acceptance
    assert out["hit_rate"] >= 0.95 * out["single_hit_rate"]
    assert out["hit_rate"] >= 1.6 * out["round_robin_hit_rate"]
    assert out["busiest_share"] <= 0.30
    assert out["p99_wait_s"] <= 0.5 * out["round_robin_p99_wait_s"]


def test_events_fifty_requests_late_keep_the_hit_rate_with_predicted_inserts(acceptance):
    trace, config, on_time = acceptance
    late = simulate(trace, replace(config, event_delay=50))
    assert late.hit_rate >= 0.95 * on_time["hit_rate"]


def test_overlap_alone_sends_the_conversation_trace_to_one_replica():
    trace = _conversation_slice()
    prefix = simulate(trace, FleetConfig(replicas=4, capacity=_two_percent(trace), router="prefix"))
    assert prefix.busiest_share > 0.95    # every request shares the root block


def test_simulation_is_deterministic_and_counts_every_request():
    trace = builtin_trace("default")
    config = FleetConfig(replicas=3, capacity=200, router="kv-aware+guard", event_delay=5)
    a, b = simulate(trace, config), simulate(trace, config)
    assert a.as_dict() == b.as_dict()
    assert a.requests == len(trace) and sum(a.per_replica) == len(trace) and len(a.waits) == len(trace)


def test_fleet_command_json_keys_and_text(capsys):
    assert main(["--workload", "default", "--replicas", "2", "--capacity", "5%", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= out.keys() and out["router"] == "kv-aware+guard" and out["replicas"] == 2
    assert main(["--workload", "default", "--replicas", "2", "--capacity", "300", "--router", "least-load"]) == 0
    text = capsys.readouterr().out
    assert "hit rate" in text and "busiest" in text and "round robin" in text


def test_fleet_command_refuses_bad_capacity(capsys):
    with pytest.raises(SystemExit):
        main(["--capacity", "0%"])
    assert "percentage" in capsys.readouterr().err
