"""Review of the sweep behind ``prefixkv compare`` (process pool and Ray backends), the remote
tier's replay model, the slot store and the lab: each test was written to fail first."""

from __future__ import annotations

import json

import pytest

from prefixkv.sim import sweep as sweep_mod
from prefixkv.sim.sweep import SweepCellError, TraceSource, sweep
from prefixkv.sim.workloads import builtin_trace


def test_compare_prints_a_table_for_a_remote_tier_without_host_capacity(capsys):
    from prefixkv.cli import main

    code = main(["compare", "--policies", "lru,fifo", "--capacities", "200", "--remote-capacity", "500",
                 "--workers", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "lru" in out and "fifo" in out
