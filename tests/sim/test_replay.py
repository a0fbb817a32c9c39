"""Trace replay (``prefixkv.sim.replay``): cache-mode LRU against a brute-force pool, misses,
partial blocks, warm-up and the measured window, concurrent mode, policy objects used once;
arrival forecasts scored, ROC AUC against its pairwise definition, and bad arguments (a host
policy among them) refused before anything runs or binds."""

import json
import math
import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.errors import InvalidArgument
from prefixkv.policies import LRUPolicy, make_policy
from prefixkv.sim.replay import replay, roc_auc
from prefixkv.sim.traces import Trace, load_trace
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


# -- forecasts, refusals before anything runs, ROC AUC -----------------------------------------------

class ExactForecast(LRUPolicy):
    """LRU that forecasts, from the free, exactly the seconds until its session's next request."""

    name = "exact-forecast"

    def __init__(self, next_arrival: dict):
        super().__init__()
        self.next_arrival = next_arrival      # (session, turn) -> the next request's timestamp

    def on_hint(self, hint):
        pass

    def predict(self, hint):
        nxt = self.next_arrival.get((hint.session, hint.turn))
        return (0.0, 0.0) if nxt is None else (1.0, max(nxt - hint.time, 0.0))


def _two_turns():
    # Session s: turn 0 arrives at 0 s and, at 1 output token/s, finishes at 50 s; turn 1 arrives
    # at 100 s. Session u sends one request. From turn 0's free, s is back in 50 s (cache mode:
    # the free is at the arrival, 100 s).
    return Trace([Req(0.0, 8, 50, [1, 2], session="s"), Req(100.0, 12, 1, [1, 2, 3], session="s"),
                  Req(200.0, 4, 1, [9], session="u")], 4)


@pytest.mark.parametrize("mode", ["cache", "concurrent"])
def test_an_exact_arrival_forecast_scores_no_error_in_either_mode(mode):
    # The forecast is a gap from the free (SessionHint.time); the score measured the actual gap
    # from the request's arrival, so in concurrent mode (free = finish) an exact forecast scored
    # |ln(51 / 101)| = 0.68.
    trace = _two_turns()
    result = replay(trace, ExactForecast({("s", 0): 100.0}), 64, mode=mode, prefill_rate=1e9, decode_rate=1.0)
    assert result.predictions == 3
    assert result.return_auc == 1.0
    assert result.arrival_log_error == 0.0


def test_a_refused_replay_leaves_the_policy_object_unused():
    # belady in concurrent mode was refused after the policy had been bound to the replay's pool,
    # so the same object could not be replayed again (in cache mode, where it works).
    trace = _two_turns()
    policy = make_policy("belady")
    with pytest.raises(ValueError, match="belady"):
        replay(trace, policy, 64, mode="concurrent")
    assert replay(trace, policy, 64).block_hits == 2


@pytest.mark.parametrize("kwargs, argument", [
    (dict(mode="concurrent", prefill_rate=0.0), "prefill_rate"),           # ZeroDivisionError
    (dict(mode="concurrent", decode_rate=-1.0), "decode_rate"),            # time ran backwards
    (dict(mode="concurrent", decode_rate=math.nan), "decode_rate"),        # TypeError from a heap of NaNs
    (dict(prefill_rate="fast"), "prefill_rate"),
    (dict(remote_capacity=math.nan), "remote_capacity"),                   # an unbounded remote model
    (dict(remote_capacity=2.5), "remote_capacity"),
    (dict(remote_capacity=True), "remote_capacity"),                       # one block
    (dict(remote_capacity=-3), "remote_capacity"),
    (dict(remote_capacity=4, remote_bytes_per_s=-1.0), "remote_bytes_per_s"),  # negative seconds
    (dict(remote_capacity=4, remote_bytes_per_s=math.inf), "remote_bytes_per_s"),
    (dict(host_capacity=-1), "host_capacity"),
    (dict(capacity=0), "capacity"),
    (dict(warmup=1.0), "warmup"),
    (dict(mode="bogus"), "mode"),
])
def test_bad_replay_arguments_are_named_before_anything_runs(kwargs, argument):
    kwargs = dict(kwargs)
    capacity = kwargs.pop("capacity", 64)
    policy = make_policy("lru")
    with pytest.raises(InvalidArgument) as info:
        replay(_two_turns(), policy, capacity, **kwargs)
    assert info.value.argument == argument
    assert replay(_two_turns(), policy, 64).block_hits == 2       # the policy object is still unused


def _brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def test_roc_auc_agrees_with_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        scores = [float(x) for x in rng.integers(0, 4, n) / 4]
        labels = [bool(x) for x in rng.integers(0, 2, n)]
        if all(labels) or not any(labels):
            assert roc_auc(scores, labels) is None
        else:
            assert roc_auc(scores, labels) == pytest.approx(_brute_auc(scores, labels))


@pytest.mark.parametrize("scores, labels", [
    ([0.1, 0.2], [True, False, True]),            # came back as -1.0, an impossible AUC
    ([0.1, 0.2, 0.3], [True, False]),             # IndexError
    ([math.nan, 0.2, 0.5], [True, False, True]),  # NaN breaks the sort: a silent wrong figure
])
def test_roc_auc_refuses_what_it_cannot_score(scores, labels):
    with pytest.raises(InvalidArgument):
        roc_auc(scores, labels)


def test_an_unknown_host_policy_is_refused_before_the_device_policy_is_bound():
    policy = make_policy("lru")
    with pytest.raises(ValueError, match="bogus"):
        replay(_two_turns(), policy, 64, host_capacity=4, host_policy="bogus")
    assert replay(_two_turns(), policy, 64).block_hits == 2


# -- kv-cache-tester hits cover full blocks only --------------------------------------------------------

def _write(path, text):
    path.write_text(text)
    return path


def test_kvcache_tester_token_hits_never_count_the_unhashed_tail(tmp_path):
    # kv-cache-tester hash_ids cover the full blocks only: a 100-token request at block size 64
    # has one hashed block (64 tokens) and a 36-token tail that no cache can serve. The second,
    # identical request hits its one block: 64 tokens, not 100.
    doc = {"id": "c1", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 100, "out": 5, "hash_ids": [1]},
        {"t": 1.0, "type": "n", "in": 100, "out": 5, "hash_ids": [1]}]}
    trace = load_trace(_write(tmp_path / "c1.json", json.dumps(doc)))
    for mode in ("cache", "concurrent"):
        r = replay(trace, "lru", 10, mode=mode)
        assert (r.block_accesses, r.block_hits) == (2, 1)
        assert r.hit_tokens == 64, mode
        assert r.token_hit_rate == pytest.approx(64 / 200)
