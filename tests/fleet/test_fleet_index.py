"""KVIndex and the routers, without ZMQ."""

from __future__ import annotations

import pytest

from prefixkv.events import BlockRemoved
from prefixkv.fleet.index import KVIndex, UnknownWorker
from prefixkv.fleet.router import NoWorkerAvailable, RouterConfig, WorkerLoad, make_router


def _index(*workers):
    index = KVIndex(predict_ttl=10.0)
    for w in workers:
        index.add_worker(w)
    return index


def test_overlap_is_the_leading_run_per_worker_and_tier():
    index = _index("a", "b")
    index.stored("a", [1, 2, 3])
    index.stored("b", [1])
    index.stored("b", [2, 3], medium="CPU")
    assert index.overlaps([1, 2, 3, 4], ["a", "b", "c"]) == [(3, 3), (1, 3), (0, 0)]
    index.removed("a", [2])
    assert index.overlaps([1, 2, 3], ["a"]) == [(1, 1)]


def test_cleared_and_removed_worker_leave_nothing_behind():
    index = _index("a", "b")
    index.stored("a", [1, 2])
    index.stored("a", [3], medium="CPU")
    index.stored("b", [1])
    index.predict("a", [7], now=0.0)
    index.cleared("a")
    assert index.overlaps([1, 2], ["a", "b"]) == [(0, 0), (1, 1)]
    assert index.overlaps([7], ["a"]) == [(0, 0)] and index.blocks_of("a") == set()
    index.remove_worker("b")
    assert index.num_blocks() == 0
    with pytest.raises(UnknownWorker, match="not in the index"):
        index.stored("b", [1])


def test_predictions_count_until_confirmed_removed_or_expired():
    index = _index("a")
    index.predict("a", [1, 2], now=0.0)
    assert index.overlaps([1, 2], ["a"]) == [(2, 2)]
    index.stored("a", [1])                       # confirmed: stays after the deadline
    assert index.expire(100.0) == 1              # block 2 was never confirmed
    assert index.overlaps([1, 2], ["a"]) == [(1, 1)]
    index.predict("a", [5], now=0.0)
    index.predict("a", [5], now=8.0)             # re-routed: the later deadline decides
    assert index.expire(12.0) == 0 and index.overlaps([5], ["a"]) == [(1, 1)]
    index.removed("a", [5])
    assert index.overlaps([5], ["a"]) == [(0, 0)]


def _loads(**queued):
    return [WorkerLoad(w, q) for w, q in queued.items()]


def test_prefix_router_piles_onto_one_worker_the_guard_does_not():
    shared = list(range(4))
    index = _index("a", "b", "c", "d")
    index.stored("a", shared)
    cfg = RouterConfig(block_size=16)
    prefix, guarded = make_router("prefix", index, cfg), make_router("kv-aware+guard", index, cfg)
    busy = _loads(a=16 * 4 * 100, b=0, c=0, d=0)      # a: a hundred requests' worth queued
    assert prefix.pick(shared, busy).worker_id == "a"
    decision = guarded.pick(shared, busy)
    assert decision.worker_id != "a" and decision.reason == "guard"
    calm = _loads(a=16, b=0, c=0, d=0)                 # within the slack: affinity wins
    assert guarded.pick(shared, calm).worker_id == "a"


def test_misses_go_to_the_least_loaded_with_random_ties():
    index = _index("a", "b", "c")
    router = make_router("kv-aware+guard", index, RouterConfig(block_size=16, seed=1))
    picks = {router.pick([99], _loads(a=0, b=0, c=500)).worker_id for _ in range(50)}
    assert picks == {"a", "b"}
    assert router.pick([99], _loads(a=0, b=0, c=500)).reason == "miss"


def test_round_robin_turns_and_other_fingerprints_are_refused():
    index = _index("a", "b")
    rr = make_router("round-robin", index, RouterConfig(block_size=16, fingerprint="m1"))
    ws = [WorkerLoad("a", fingerprint="m1"), WorkerLoad("b", fingerprint="m1"), WorkerLoad("x", fingerprint="m2")]
    assert [rr.pick([], ws).worker_id for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(NoWorkerAvailable, match="fingerprint 'm1'"):
        rr.pick([], [WorkerLoad("x", fingerprint="m2")])
    with pytest.raises(ValueError, match="unknown router"):
        make_router("nearest", index, RouterConfig(block_size=16))


def test_apply_keeps_each_core_events_tier():
    """Host-tier events (medium "CPU") go to the lower tier, not the device, as on the wire."""
    from prefixkv import KVCacheManager

    mgr = KVCacheManager(4, 4, hash_seed=0, num_host_blocks=8, host_cache=True, record_events=True)
    a, b = mgr.prompt(list(range(16))), mgr.prompt(list(range(100, 116)))
    for seq, prompt in (("a", a), ("b", b)):
        mgr.admit(seq, prompt, compute_last_token=False)
        mgr.free(seq)                          # b evicts a's blocks from the device to the host
    index = _index("w")
    index.apply("w", mgr.drain_events())
    assert index.overlaps(a.block_hashes(), ["w"]) == [(0, 4)]     # on the host only
    assert index.overlaps(b.block_hashes(), ["w"]) == [(4, 4)]
    assert index.blocks_of("w", "CPU") == set(a.block_hashes())
    assert index.blocks_of("w") == set(b.block_hashes())
    index.apply("w", [BlockRemoved(h, 0, "CPU") for h in a.block_hashes()])
    assert index.overlaps(a.block_hashes(), ["w"]) == [(0, 0)]
    assert index.overlaps(b.block_hashes(), ["w"]) == [(4, 4)]


def test_apply_refusing_a_non_event_changes_nothing():
    from prefixkv.events import BlockStored

    index = _index("w")
    index.stored("w", [1])
    with pytest.raises(TypeError, match="not a prefixkv KV event: str"):
        index.apply("w", [BlockStored(2, 1, 4, None, 0), BlockRemoved(1, 0), "junk"])
    assert index.blocks_of("w") == {1} and index.overlaps([1, 2], ["w"]) == [(1, 1)]
