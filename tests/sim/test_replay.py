import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace
from prefixkv.sim.traces import TraceRequest as Req




def chained(path):
    """Prefix-chained ids, as Mooncake's hash_ids are: an id names the whole prefix."""
    return [tuple(path[:i + 1]) for i in range(len(path))]


def reference_lru(requests, capacity):
    """A brute-force model of the pool: hits are the leading cached blocks, pinned while the request
    allocates the rest (evicting the least recently released), then all are released tail first."""
    cache = OrderedDict()   # hash -> None, in release order (all evictable between requests)
    hits = 0
    for r in requests:
        hs = r.block_hashes
        if len(hs) > capacity:
            continue
        k = 0
        while k < len(hs) and hs[k] in cache:
            k += 1
        hits += k
        for h in hs[:k]:
            del cache[h]                      # pinned
        for h in hs[k:]:
            if len(cache) + k + (hs.index(h) - k) >= capacity:
                cache.popitem(last=False)
        for h in reversed(hs):
            cache[h] = None
    return hits


paths = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(paths, st.integers(1, 12))
def test_cache_mode_lru_matches_a_brute_force_pool(raw, capacity):
    trace = Trace([Req(i, len(p) * 4, 1, chained(p)) for i, p in enumerate(raw)], block_size=4)
    result = replay(trace, "lru", capacity)
    assert result.block_hits == reference_lru(trace.requests, capacity)
    assert result.block_accesses == sum(len(p) for p in raw)


def test_oversized_requests_are_counted_as_misses():
    trace = Trace([Req(0, 20, 1, chained([1, 2, 3, 4, 5])), Req(1, 8, 1, chained([1, 2])),
                   Req(2, 8, 1, chained([1, 2]))], block_size=4)
    result = replay(trace, "lru", 3)
    assert result.oversized_requests == 1
    assert (result.block_accesses, result.block_hits) == (9, 2)


def test_partial_last_block_tokens_count_when_hit():
    trace = Trace([Req(0, 6, 1, chained([1, 2])), Req(1, 6, 1, chained([1, 2]))], block_size=4)
    result = replay(trace, "lru", 8)
    assert result.block_hit_rate == 0.5
    assert result.hit_tokens == 6 and result.input_tokens == 12


def test_warmup_is_excluded_from_measurement():
    trace = Trace([Req(i, 8, 1, chained([1, 2])) for i in range(10)], block_size=4)
    result = replay(trace, "lru", 4, warmup=0.5)
    assert result.requests == 5 and result.block_hit_rate == 1.0
    assert replay(trace, "lru", 4).block_hit_rate == pytest.approx(0.9)


def test_token_traces_are_hashed_for_real():
    rng = random.Random(0)
    system = [rng.randrange(100) for _ in range(32)]
    reqs = [Req(i, 40, 2, None, system + [rng.randrange(100) for _ in range(8)]) for i in range(5)]
    result = replay(Trace(reqs, 8), "lru", 64)
    assert result.block_accesses == 25
    assert result.block_hits == 16        # four system blocks hit for each of the last four


def test_concurrent_mode_waits_when_the_pool_is_held():
    reqs = [Req(0.0, 16, 40, chained([i, 1, 2, 3])) for i in range(4)]
    result = replay(Trace(reqs, 4), "lru", 30, mode="concurrent", prefill_rate=1e9, decode_rate=10.0)
    # each request holds 4 prompt + 10 output blocks: two run at once, two wait 4 s
    assert result.requests == 4
    assert result.waited_admissions == 2
    assert result.total_wait_s == pytest.approx(8.0)


def test_bad_arguments():
    trace = Trace([Req(0, 4, 1, chained([1]))], 4)
    with pytest.raises(ValueError, match="mode"):
        replay(trace, "lru", 4, mode="bogus")
    with pytest.raises(ValueError, match="warmup"):
        replay(trace, "lru", 4, warmup=1.0)
    with pytest.raises(ValueError, match="capacity"):
        replay(trace, "lru", 0)


def test_blocks_never_reused():
    # capacity 2: A=[1,2] cached; B=[3,4] evicts both unused; A again misses (re-inserted); A hits.
    reqs = [Req(0, 8, 1, chained([1, 2])), Req(1, 8, 1, chained([3, 4])),
            Req(2, 8, 1, chained([1, 2])), Req(3, 8, 1, chained([1, 2]))]
    result = replay(Trace(reqs, 4), "lru", 2)
    assert result.block_insertions == 6
    # A's first residency and B's (left at the end) were never hit; A's second one was.
    assert result.blocks_never_reused == 4
    assert result.block_hits == 2


def test_cache_traffic_counts_only_the_measured_window():
    # capacity 2, four requests of two blocks: [1,2] [3,4] [1,2] [1,2]; warm-up = the first two.
    reqs = [Req(0, 8, 1, chained([1, 2])), Req(1, 8, 1, chained([3, 4])),
            Req(2, 8, 1, chained([1, 2])), Req(3, 8, 1, chained([1, 2]))]
    whole = replay(Trace(reqs, 4), "lru", 2)
    measured = replay(Trace(reqs, 4), "lru", 2, warmup=0.5)
    assert (whole.evictions, whole.block_insertions) == (4, 6)
    # after the warm-up only request 2 misses: it evicts [3,4] (unused) and inserts [1,2] again
    assert (measured.requests, measured.block_accesses, measured.block_hits) == (2, 4, 2)
    assert (measured.evictions, measured.block_insertions, measured.blocks_never_reused) == (2, 2, 2)


def test_a_miss_on_an_orphaned_cached_block_is_not_an_insertion():
    from ordered_policy import OrderedPolicy

    class MostRecentFirst(OrderedPolicy):   # evicts a chain's root before its tail: orphans
        name = "mru"

        def evict(self):
            return self._order.popitem(last=True)[0]

    # capacity 3. [1,2]; [7,8] evicts 1 (2 stays cached, orphaned); [1,2] misses both: 1 is
    # inserted again, but 2's hash is still cached, so its new copy is a duplicate, not an insertion.
    reqs = [Req(0, 8, 1, chained([1, 2])), Req(1, 8, 1, chained([7, 8])), Req(2, 8, 1, chained([1, 2]))]
    result = replay(Trace(reqs, 4), MostRecentFirst(), 3)
    assert result.block_hits == 0
    assert (result.block_insertions, result.evictions) == (5, 3)


@pytest.mark.parametrize("mode", ["cache", "concurrent"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "lrfu"])
def test_insertions_minus_evictions_never_exceed_the_capacity(mode, policy, tmp_path):
    from prefixkv.sim.workloads import BUILTIN_WORKLOADS, generate_trace
    from prefixkv.sim.traces import load_token_trace
    from dataclasses import replace as dc_replace

    path = generate_trace(tmp_path / "w.jsonl", dc_replace(BUILTIN_WORKLOADS["default"], num_requests=120))
    result = replay(load_token_trace(path), policy, 120, mode=mode)
    assert result.evictions > 0
    assert 0 <= result.block_insertions - result.evictions <= 120
    assert result.blocks_never_reused <= result.block_insertions


def test_a_used_policy_object_is_refused():
    from prefixkv.policies import make_policy

    reqs = [Req(0, 8, 1, chained([1, 2]))]
    policy = make_policy("lru")
    replay(Trace(reqs, 4), policy, 4)
    with pytest.raises(ValueError, match="already serves another pool"):
        replay(Trace(reqs, 4), policy, 4)


def test_sweep_refuses_policy_objects_and_clashing_labels(tmp_path):
    from prefixkv.sim.sweep import TraceSource, sweep
    from prefixkv.policies import make_policy

    source = TraceSource("t", ("unused.jsonl",))
    with pytest.raises(TypeError, match="sweep takes policy names, not LRUPolicy objects"):
        sweep([source], [make_policy("lru")], {"t": [4]})
    with pytest.raises(ValueError, match="two traces share the label 't'"):
        sweep([source, TraceSource("t", ("other.jsonl",))], ["lru"], {"t": [4]})
