"""The host tier below the device pool: demotion on eviction, promotion on a hit, exclusive and
inclusive, the load gate, events per tier, one host pool shared with swap space, failure atomicity."""

from __future__ import annotations

import pathlib

import pytest

from prefixkv import BlockRemoved, BlockStored, KVCacheManager, OutOfBlocks
from prefixkv.costs import PreemptionCostModel

B = 4
TRACES = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def tiered(num_blocks=4, host=8, **kwargs):
    return KVCacheManager(num_blocks, B, hash_seed=0, num_host_blocks=host, host_cache=True, **kwargs)


def fill(mgr, seq, tokens):
    hit = mgr.admit(seq, tokens, compute_last_token=False)
    mgr.free(seq)
    return hit


def test_an_evicted_block_is_demoted_and_a_later_hit_promotes_it():
    mgr = tiered()
    a = list(range(16))                       # 4 full blocks: the whole device
    fill(mgr, "a", a)
    assert mgr.take_demotions() == [] and mgr.take_loads() == []
    fill(mgr, "b", list(range(100, 116)))     # evicts all of a's blocks, tail first
    demoted = mgr.take_demotions()
    assert len(demoted) == 4 and mgr.stats().demotions == 4
    assert mgr.host.pool.num_cached == 4
    m = mgr.match(a, compute_last_token=False)
    assert (m.hit_blocks, m.lower_hit_blocks, m.blocks_needed) == (4, 4, 4)
    assert mgr.admit("a2", a, compute_last_token=False) == 16
    loads = mgr.take_loads()
    host_of = {dev: host for dev, host in demoted}
    assert sorted(h for h, _ in loads) == sorted(host_of.values())
    assert [dev for _, dev in loads] == mgr.block_ids("a2")
    stats = mgr.stats()
    assert (stats.loads, stats.host_hit_tokens, stats.hit_tokens) == (4, 16, 16)
    # exclusive: a's blocks left the host tier; b's, evicted to make room, went down
    assert mgr.host.count_leading(mgr.prompt(a).block_hashes()) == 0
    assert mgr.host.count_leading(mgr.prompt(list(range(100, 116))).block_hashes()) == 4
    mgr.check_invariants()


def test_inclusive_keeps_promoted_blocks_on_the_host():
    mgr = tiered(host_inclusive=True)
    fill(mgr, "a", list(range(16)))
    fill(mgr, "b", list(range(100, 116)))
    mgr.take_demotions()
    fill(mgr, "a2", list(range(16)))
    assert len(mgr.take_demotions()) == 4     # b's blocks made room
    assert len(mgr.take_loads()) == 4 and mgr.host.pool.num_cached == 8   # a's and b's blocks
    fill(mgr, "b2", list(range(100, 116)))    # a's blocks leave the device: already on the host, no copy
    assert mgr.take_demotions() == [] and len(mgr.take_loads()) == 4
    mgr.check_invariants()


def test_match_is_read_only_and_a_failed_admission_changes_no_tier():
    mgr = tiered(num_blocks=4, host=8)
    fill(mgr, "a", list(range(16)))
    fill(mgr, "b", list(range(100, 116)))
    mgr.take_demotions()
    mgr.admit("held", list(range(200, 208)), compute_last_token=False)   # 2 of 4 device blocks held
    before = mgr.snapshot()
    m = mgr.match(list(range(16)) + [1], compute_last_token=False)
    assert mgr.snapshot() == before and not m.fits and m.lower_hit_blocks == 4
    with pytest.raises(OutOfBlocks):
        mgr.admit("a2", list(range(16)) + [1], compute_last_token=False)
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_the_load_gate_refuses_host_hits_dearer_than_recomputing():
    cheap_link = PreemptionCostModel(prefill_tokens_per_s=1.0, link_bytes_per_s=1e12, kv_bytes_per_token=1)
    slow_link = PreemptionCostModel(prefill_tokens_per_s=1e12, link_bytes_per_s=1.0, kv_bytes_per_token=1)
    for gate, loads, refused in ((cheap_link, 4, 0), (slow_link, 0, 4)):
        mgr = tiered(load_gate=gate)
        fill(mgr, "a", list(range(16)))
        fill(mgr, "b", list(range(100, 116)))
        mgr.take_demotions()
        fill(mgr, "a2", list(range(16)))
        stats = mgr.stats()
        assert (stats.loads, stats.loads_refused) == (loads, refused)
        mgr.take_loads()


def test_events_name_the_tier_a_demotion_is_removed_from_the_device_and_stored_on_the_host():
    mgr = tiered(record_events=True)
    fill(mgr, "a", list(range(16)))
    mgr.drain_events()
    fill(mgr, "b", list(range(100, 116)))
    events = mgr.drain_events()
    host_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    device_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium is None]
    assert len(host_stored) == 4 and {e.block_hash for e in host_stored} == {e.block_hash for e in device_removed}
    mgr.take_demotions()
    fill(mgr, "a2", list(range(16)))
    mgr.take_loads()
    events = mgr.drain_events()
    assert sum(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events) == 4   # promoted: gone from the host
    assert sum(isinstance(e, BlockStored) and e.medium is None for e in events) == 4


def test_swap_space_and_host_tier_are_one_pool_and_a_swap_feeds_the_cache():
    mgr = tiered(num_blocks=8, host=8)
    mgr.admit("a", list(range(16)), compute_last_token=False)
    copies = mgr.swap_out("a")
    assert len(copies) == 4 and mgr.num_free_host_blocks == 4
    assert mgr.host.pool.num_cached == 4          # the swapped blocks are cached on the host too
    mgr.swap_in("a")
    mgr.take_loads()
    mgr.free("a")
    assert mgr.num_free_host_blocks == 8          # evictable cached host blocks count as free
    mgr.check_invariants()


def test_off_by_default_keeps_todays_swap_space():
    mgr = KVCacheManager(4, B, hash_seed=0, num_host_blocks=8)
    fill(mgr, "a", list(range(16)))
    fill(mgr, "b", list(range(100, 116)))
    assert mgr.take_demotions() == [] and mgr.host.pool.num_cached == 0
    with pytest.raises(ValueError, match="host_cache needs host blocks"):
        KVCacheManager(4, B, host_cache=True)


@pytest.mark.skipif(not (TRACES / "conversation_trace.jsonl").exists(), reason="shared traces are not here")
def test_exclusive_lru_tiers_are_one_lru_stack():
    """Device 10,000 + host 40,000 (exclusive, LRU, promote on hit, no gate) hits exactly what one
    LRU of 50,000 hits, and its device hits are LRU 10,000's (an independent 40-line simulation
    gives 102,290 and 61,046)."""
    from prefixkv.sim.replay import replay
    from prefixkv.sim.traces import load_trace

    trace = load_trace(TRACES / "conversation_trace.jsonl")
    tiers = replay(trace, "lru", 10_000, host_capacity=40_000).as_dict()
    assert tiers["block_hits"] == replay(trace, "lru", 50_000).block_hits == 102_290
    assert tiers["tier_block_hits"]["device"] == replay(trace, "lru", 10_000).block_hits == 61_046
    assert tiers["tier_block_hits"]["host"] == tiers["promotions"] == 41_244


def test_replay_and_compare_report_every_tier(tmp_path, capsys):
    import json

    from prefixkv.cli import main

    assert main(["replay", "--capacity", "200", "--host-capacity", "800", "--cost-params", "h200", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    tiers = r["tier_block_hits"]
    assert tiers["device"] + tiers["host"] == r["block_hits"] and tiers["host"] == r["promotions"] > 0
    assert r["tier_hit_rate"]["host"] == pytest.approx(tiers["host"] / r["block_accesses"])
    assert r["demotions"] > 0 and r["transfer_bytes"] == (r["promotions"] + r["demotions"]) * 16 * 131072
    assert r["transfer_s"] == pytest.approx(r["transfer_bytes"] / (25 * 2**30))
    plot = tmp_path / "host.png"
    assert main(["compare", "--policies", "lru", "--capacities", "200", "--host-capacity", "0,400,800",
                 "--workers", "1", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    rates = [r["block_hit_rate"] for r in rows]
    assert [r.get("host_capacity", 0) for r in rows] == [0, 400, 800]
    assert rates[0] < rates[1] < rates[2] and plot.stat().st_size > 0


def test_replay_models_a_remote_tier_below_the_host_tier():
    from prefixkv.costs import PROFILES, PreemptionCostModel
    from prefixkv.sim.replay import replay
    from prefixkv.sim.workloads import builtin_trace

    trace = builtin_trace("default")
    cost = PreemptionCostModel.from_params(PROFILES["h200"], 131072)
    alone = replay(trace, "lru", 200).as_dict()
    r = replay(trace, "lru", 200, remote_capacity=4000, transfer_cost=cost, remote_bytes_per_s=12.5e9).as_dict()
    tiers = r["tier_block_hits"]
    assert tiers["device"] == alone["block_hits"]          # the tiers below do not change the device's hits
    assert tiers["remote"] > 0 and sum(tiers.values()) == r["block_hits"] > alone["block_hits"]
    assert r["remote_fetches"] >= tiers["remote"] and r["remote_writes"] > 0
    assert r["remote_transfer_s"] == pytest.approx(r["remote_transfer_bytes"] / 12.5e9)
    with pytest.raises(ValueError, match="cache mode only"):
        replay(trace, "lru", 200, remote_capacity=10, mode="concurrent")


def test_replay_remote_capacity_on_the_command_line(capsys):
    import json

    from prefixkv.cli import main

    assert main(["replay", "--capacity", "200", "--remote-capacity", "4000", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tier_block_hits"]["remote"] > 0 and r["remote_transfer_s"] > 0


def test_replay_json_reports_the_replay_time(capsys):
    import json

    from prefixkv.cli import main

    assert main(["replay", "--capacity", "200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replay_s"] > 0


@pytest.mark.parametrize("index", ["dict", "flat"])
def test_a_host_run_with_device_blocks_inside_loads_only_what_the_device_lacks(index):
    """Both tiers hold a prompt (swapped out and back in: swapping publishes on the host too); the
    device then loses its first block only. The host holds the whole chain, but only the first block
    is loaded: the rest are device hits (the check that the device holds none of the host's run)."""
    if index == "flat":
        pytest.importorskip("numba")
    mgr = KVCacheManager(16, 4, hash_seed=0, num_host_blocks=16, host_cache=True, index=index)
    tokens = list(range(16))
    mgr.admit("a", tokens, compute_last_token=False)
    mgr.swap_out("a")
    mgr.swap_in("a")
    mgr.take_demotions()
    mgr.take_loads()
    mgr.free("a")
    first = mgr.pool.lookup(mgr.prompt(tokens).block_hashes()[0])
    mgr.pool.take_cached([first])        # the device forgets its first block (its hash moved nowhere)
    mgr.pool.release([first])
    assert mgr.host.count_leading(mgr.prompt(tokens).block_hashes()) == 4
    m = mgr.match(tokens, compute_last_token=False)
    assert (m.hit_blocks, m.lower_hit_blocks) == (4, 1)
    assert mgr.admit("b", tokens, compute_last_token=False) == 16
    assert len(mgr.take_loads()) == 1
    mgr.check_invariants()


def test_host_tier_events_store_parents_before_children():
    """The device evicts a chain tail first and the host stored the batch in that order, so a
    child's BlockStored(medium="CPU") came before its parent's; consumers are promised parents first."""
    from prefixkv import KVCacheManager
    from prefixkv.events import BlockStored

    mgr = KVCacheManager(8, 4, hash_seed=0, num_host_blocks=16, host_cache=True, record_events=True)
    a = mgr.admit("a", list(range(24)))         # 6 full blocks, one chain
    mgr.free("a")
    mgr.drain_events()
    mgr.admit("b", list(range(100, 132)))       # 8 blocks: the whole chain of a is evicted to the host
    stored = [e for e in mgr.drain_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(stored) == 6
    seen = set()
    for event in stored:
        assert event.parent_hash is None or event.parent_hash in seen, "a child before its parent"
        seen.add(event.block_hash)
    assert a is not None
