"""The disk tier's replay model (``prefixkv.sim.disk_model``) and the stack it joins: an exclusive LRU
disk below the host tier is one host tier of both sizes (random traces), and exclusive LRU device +
host + disk hits what one LRU of the summed capacity hits on the shared conversation trace (where it
is here), as device + host does; write-through keeps every published block and serves what
the remote tier below it served; the counters and the CLI report the tier; bad options are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.errors import InvalidArgument
from prefixkv.sim.disk_model import DiskModel
from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace, load_trace
from prefixkv.sim.traces import TraceRequest as Req

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def random_trace(seed: int, n: int = 300, depth: int = 8) -> Trace:
    """Requests that share prefixes of a few roots at random depths, as conversations do (at most
    ``depth + 2`` blocks each)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(10**9) for _ in range(depth)] for _ in range(12)]
    reqs = []
    for i in range(n):
        root = rng.choice(roots)
        blocks = root[:rng.randrange(1, depth + 1)] + [rng.randrange(10**9) for _ in range(rng.randrange(0, 3))]
        reqs.append(Req(float(i), 4 * len(blocks), 1, blocks))
    return Trace(reqs, 4)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), device=st.integers(20, 60), host=st.integers(21, 60), disk=st.integers(1, 80))
def test_an_exclusive_disk_below_the_host_is_one_host_tier_of_both_sizes(seed, device, host, disk):
    """Exclusive LRU host + disk hit exactly what one exclusive LRU host tier of the summed size hits,
    and the device's hits do not move. (The host holds two of the largest requests: staging a disk hit's
    chain needs free host blocks beside the chain's own, as in the real tier; a host tier too small for
    that stops a chain where one host tier of the summed size would not.)"""
    trace = random_trace(seed)
    tiers = replay(trace, "lru", device, host_capacity=host, disk_capacity=disk, disk_mode="exclusive").as_dict()
    one = replay(trace, "lru", device, host_capacity=host + disk).as_dict()
    assert tiers["block_hits"] == one["block_hits"]
    assert tiers["tier_block_hits"]["device"] == one["tier_block_hits"]["device"]
    assert tiers["tier_block_hits"]["host"] + tiers["tier_block_hits"]["disk"] == one["tier_block_hits"]["host"]
    assert tiers["disk_fetches"] == tiers["tier_block_hits"]["disk"]


@pytest.mark.skipif(not (TRACES / "conversation_trace.jsonl").exists(), reason="shared traces are not here")
def test_exclusive_stack_on_the_conversation_trace():
    trace = load_trace(TRACES / "conversation_trace.jsonl")
    tiers = replay(trace, "lru", 5_000, host_capacity=15_000, disk_capacity=30_000, disk_mode="exclusive").as_dict()
    assert tiers["block_hits"] == replay(trace, "lru", 50_000).block_hits == 102_290
    assert tiers["tier_block_hits"] == {"device": 32_260, "host": 50_745, "disk": 19_285}


def test_write_through_keeps_published_blocks_and_what_the_remote_tier_served():
    # A, B, C push [1, 2, 3] out of the device and then out of the (exclusive) host tier; the disk
    # and the remote tier were written through with every block, and D reads it back from the disk
    reqs = [Req(0.0, 12, 1, [1, 2, 3]), Req(1.0, 12, 1, [4, 5, 6]), Req(2.0, 12, 1, [7, 8, 9]),
            Req(3.0, 12, 1, [1, 2, 3])]
    r = replay(Trace(reqs, 4), "lru", 3, host_capacity=3, disk_capacity=16, remote_capacity=16).as_dict()
    assert r["tier_block_hits"] == {"device": 0, "host": 0, "disk": 3, "remote": 0}
    assert r["disk_writes"] == 9 and r["disk_fetches"] == 3 and r["remote_fetches"] == 0
    # a one-block disk keeps only the last block written: the remote tier serves the chain, and the
    # disk keeps what it served (written through from below)
    r = replay(Trace(reqs, 4), "lru", 3, host_capacity=3, disk_capacity=1, remote_capacity=16).as_dict()
    assert r["tier_block_hits"] == {"device": 0, "host": 0, "disk": 0, "remote": 3}
    # writes: 9 for A-C, 3 of what the remote served, 3 as D publishes them (each evicts the one before)
    assert r["remote_fetches"] == 3 and r["disk_writes"] == 9 + 3 + 3


def test_the_model_holds_at_most_its_capacity():
    disk = DiskModel(3)
    disk.write([1, 2, 3, 4, 5])
    assert disk.leading([3, 4, 5], 0) == 3 and disk.leading([1, 2], 0) == 0 and disk.evictions == 2
    ex = DiskModel(2, "exclusive")
    ex.write([1, 2])                  # an exclusive disk takes only the host's victims
    assert ex.leading([1], 0) == 0
    ex.demote([1, 2, 3])
    assert ex.leading([2, 3], 0) == 2
    ex.read([2])
    assert ex.leading([2], 0) == 0 and ex.fetched == 1


@pytest.mark.parametrize("kwargs, problem", [
    (dict(disk_capacity=-1), "disk_capacity"),
    (dict(disk_capacity=2.5), "disk_capacity"),
    (dict(disk_capacity=4, disk_mode="victim"), "disk_mode"),
    (dict(disk_capacity=4, disk_read_bytes_per_s=0), "disk_read_bytes_per_s"),
    (dict(disk_capacity=4, disk_write_bytes_per_s=float("nan")), "disk_write_bytes_per_s"),
])
def test_bad_disk_options_are_refused_naming_them(kwargs, problem):
    with pytest.raises(InvalidArgument, match=problem):
        replay(random_trace(0, 5), "lru", 8, **kwargs)


def test_concurrent_mode_refuses_a_disk_tier():
    with pytest.raises(ValueError, match="cache mode only"):
        replay(random_trace(0, 5), "lru", 8, disk_capacity=4, mode="concurrent")


def test_replay_and_compare_report_the_disk_tier(tmp_path, capsys):
    from prefixkv.cli import main

    trace = tmp_path / "t.jsonl"
    rows = random_trace(1, 80).requests
    trace.write_text("".join(json.dumps({"timestamp": int(r.timestamp * 1000),
                                         "input_length": 512 * len(r.block_hashes), "output_length": 1,
                                         "hash_ids": r.block_hashes}) + "\n" for r in rows))
    assert main(["replay", "--trace", str(trace), "--capacity", "20", "--host-capacity", "10",
                 "--disk-capacity", "40", "--cost-params", "h200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["tier_block_hits"]) == {"device", "host", "disk"}
    for key in ("disk_fetches", "disk_writes", "disk_evictions", "disk_transfer_s"):
        assert key in out
    assert out["disk_mode"] == "write-through" and out["disk_transfer_s"] > 0
    assert main(["compare", "--trace", str(trace), "--capacities", "20,30", "--policies", "lru,fifo",
                 "--host-capacity", "10", "--disk-capacity", "40", "--disk-mode", "exclusive", "--json",
                 "--workers", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(r["tier_block_hits"]["disk"] == r["disk_fetches"] for r in doc["results"])
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "--trace", str(trace), "--capacity", "20", "--disk-mode", "exclusive"])
    assert exit_.value.code == 2 and "--disk-mode applies to a disk tier" in capsys.readouterr().err


def test_plan_sizes_a_disk_pool(capsys):
    from prefixkv.cli import main

    assert main(["plan", "--disk-pool", "1TiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["disk_blocks"] == 2**40 // d["disk_value_bytes"] and d["disk_value_bytes"] > d["bytes_per_block"]
    assert 0 < d["disk_block_read_s"] < d["disk_block_write_s"]
