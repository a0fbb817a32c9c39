"""Review of prefixkv/fleet: each test pins one defect that was found and fixed.

ZeroMQ tests use real sockets on 127.0.0.1 (a scripted worker speaking the wire format),
a test clock for the subscriber's notion of time, and bounded loops for every wait.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from prefixkv.fleet.simulator import FleetConfig, simulate
from prefixkv.sim.traces import Trace
from prefixkv.sim.workloads import builtin_trace

BOUND_S = 15.0


# -- simulator ---------------------------------------------------------------------------

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
