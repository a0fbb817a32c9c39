"""The fleet simulator and ``prefixkv fleet``: the issue's acceptance points on smaller slices.

Full-size figures (whole conversation trace, built-in ``large``) are in benches/RESULTS.md;
the simulator is deterministic, so these thresholds cannot flake. Waits do not depend on where the
trace's clock starts; a trace out of arrival order is refused, and so are FleetConfig's bad numbers.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import replace

import numpy as np
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


# -- the simulator's waits and arrival order -----------------------------------------------------

def test_simulated_queue_waits_do_not_depend_on_where_the_trace_clock_starts():
    """Waits were (relative now) - (absolute timestamp): a trace whose first request is not
    at t=0 (a slice of a trace, a kv-cache-tester file) got waits shifted by its start."""
    base = builtin_trace("default")
    requests = base.requests[:60]
    at_zero = simulate(Trace(requests, base.block_size), FleetConfig(replicas=2, capacity=200))
    shifted = [replace(r, timestamp=r.timestamp + 1000.0) for r in requests]
    later = simulate(Trace(shifted, base.block_size), FleetConfig(replicas=2, capacity=200))
    assert min(later.waits) >= 0.0
    assert later.waits == pytest.approx(at_zero.waits, abs=1e-6)
    assert later.as_dict()["p99_wait_s"] == pytest.approx(at_zero.as_dict()["p99_wait_s"], abs=1e-6)


def test_a_trace_out_of_arrival_order_is_refused_by_the_simulator():
    """Arrivals went back in simulated time (before prefills already finished): the run ended
    with figures for a timeline that never was. Loaders refuse such files; a Trace built in
    code is now refused the same way."""
    base = builtin_trace("default")
    shuffled = [base.requests[1], base.requests[0], *base.requests[2:20]]
    assert shuffled[0].timestamp > shuffled[1].timestamp
    with pytest.raises(ValueError, match=r"request 1: timestamp .* earlier than"):
        simulate(Trace(shuffled, base.block_size), FleetConfig(replicas=2, capacity=200))


# -- FleetConfig's numbers ----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("speedup", 0), ("speedup", -1.0), ("speedup", math.nan), ("speedup", math.inf), ("speedup", "2"),
    ("speedup", True),
    ("predict_ttl_s", 0), ("predict_ttl_s", math.nan), ("predict_ttl_s", -1.0),
    ("lower_tier_credit", math.nan), ("lower_tier_credit", 1.5),
    ("decode_share", math.nan), ("decode_share", math.inf), ("decode_share", -0.5),
    ("guard_slack", math.nan), ("guard_slack", -1.0),
    ("replicas", 2.5), ("replicas", math.nan), ("replicas", True),
    ("capacity", 2.5), ("capacity", math.nan),
    ("event_delay", 0.5), ("event_delay", math.nan),
    ("seed", 1.5),
])
def test_fleet_config_refuses_bad_numbers_naming_the_field(field, value):
    # all of these were accepted: speedup 0 divided by zero later, nan/inf/negative gave meaningless costs
    with pytest.raises(ValueError, match=field):
        FleetConfig(**{"replicas": 2, "capacity": 10, field: value})


def test_fleet_config_keeps_valid_numbers():
    config = FleetConfig(replicas=np.int64(2), capacity=10, speedup=2, predict_ttl_s=math.inf, guard_slack=math.inf,
                         lower_tier_credit=1, decode_share=0, event_delay=0, seed=-3)
    assert config.speedup == 2 and config.replicas == 2
    assert FleetConfig(replicas=1, capacity=1, speedup=0.5).speedup == 0.5
