"""Issue 28: the compiled cache-mode replay (``prefixkv.sim.fastreplay``) against the manager's
(``engine="general"``), in lockstep: every figure of the result equal, on random hashed traces
(prefix chains and free-form ids, so duplicates after a miss and oversized requests occur), on
token traces with partial last blocks, with warm-up, for every compiled policy and some options;
which replays take which path, and the trace's conversion to arrays."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.policies import LRUPolicy  # noqa: E402
from prefixkv.sim.blockarrays import block_arrays  # noqa: E402
from prefixkv.sim.fastreplay import COMPILED  # noqa: E402
from prefixkv.sim.replay import replay  # noqa: E402
from prefixkv.sim.traces import Trace  # noqa: E402
from prefixkv.sim.traces import TraceRequest as Req  # noqa: E402

# every compiled policy, and options that change its parameters
SPECS = ["lru", "fifo", "slru", "s3fifo", "arc", "lfu",
         "slru:protected_size=2", "slru:protected_fraction=0.9", "s3fifo:move_threshold=2:max_freq=2",
         "s3fifo:small_fraction=0.5", "lfu:half_life=3",
         "clock", "sieve", "2q", "mq", "clock:counter_bits=2", "clock:counter_bits=2:init_freq=1",
         "2q:in_fraction=0.5:out_fraction=0.1", "2q:out_fraction=0", "2q:in_fraction=0:out_fraction=2",
         "mq:n_queues=3:lifetime=4", "mq:lifetime=1:ghost_ratio=0", "mq:n_queues=1", "mq:n_queues=12:lifetime=2:ghost_ratio=0.5",
         "leaf-lru", "gdsf", "gdsf:orphan_factor=0.5", "gdsf:inherit=false:depth_cost=0.25", "gdsf:depth_cost=0:orphan_factor=1",
         "car", "lrfu", "lrfu:half_life=0.01:ghost=0:step=0.5:memory=0.5", "lrfu:leaf_penalty=false:window=0.01:rate=1",
         "lrfu:reuse_distance=3:step=0", "lrfu:ghost=3:rate=0.5:half_life=0.2",
         "lirs", "lirs:hir_fraction=0.5:nonresident_ratio=0.5", "lirs:nonresident_ratio=0", "lirs:hir_fraction=0:nonresident_ratio=5",
         "wtinylfu", "wtinylfu:window_fraction=0.3:protected_fraction=0.5:sample_ratio=0.5",
         "wtinylfu:protected_fraction=0:sample_ratio=0.1", "wtinylfu:window_fraction=0.9:protected_fraction=1",
         "lecar", "lecar:seed=7", "lecar:learning_rate=2:discount=0.5:seed=3", "lecar:learning_rate=0:discount=1",
         "belady", "workload", "workload:rate=0.5:prior=0.1:horizon=2:window=0.5", "workload:horizon=0.01:window=5"]


def both(trace, policy, capacity, **kwargs):
    general = replay(trace, policy, capacity, engine="general", **kwargs)
    compiled = replay(trace, policy, capacity, engine="compiled", **kwargs)
    assert compiled.engine == "compiled" and general.engine == "general"
    return compiled, general


def assert_same(compiled, general):
    assert compiled.as_dict() == general.as_dict()
    assert compiled == general


def chained(path):
    return [tuple(path[:i + 1]) for i in range(len(path))]


# a request: a prefix path over a small alphabet (prefix-chained ids, as Mooncake's), or a set of
# free ids (an id cached further down a chain that missed leaves a duplicate block)
chain_requests = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=7), min_size=1, max_size=40)
free_requests = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=7, unique=True), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(chain_requests.map(lambda raw: [chained(p) for p in raw]), free_requests),
       st.integers(1, 14), st.sampled_from(SPECS), st.sampled_from([0.0, 0.0, 0.3]), st.integers(1, 3))
def test_compiled_and_general_replays_agree_on_random_hashed_traces(chains, capacity, policy, warmup, tail):
    # ``tail``: tokens of each request's last block (a Mooncake request's last block is partly filled)
    reqs = [Req(float(i), max(0, (len(c) - 1) * 4 + tail) if c else 0, 1, list(c)) for i, c in enumerate(chains)]
    assert_same(*both(Trace(reqs, 4), policy, capacity, warmup=warmup))


token_requests = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=0, max_size=14)),
                          min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_requests, st.integers(1, 10), st.sampled_from(SPECS))
def test_compiled_and_general_replays_agree_on_token_traces(raw, capacity, policy):
    # a shared system prompt of 0-2 blocks, then a few random tokens: partial last blocks, which
    # are held while admitted but never cached
    system = list(range(100, 108))
    reqs = [Req(float(i), 4 * s + len(t), 1, None, system[:4 * s] + t) for i, (s, t) in enumerate(raw)]
    assert_same(*both(Trace(reqs, 4), policy, capacity))


@pytest.mark.parametrize("policy", sorted(COMPILED))
def test_agree_on_a_long_random_trace_at_several_capacities(policy):
    # conversations that grow turn by turn and come back after others, as in a chat trace
    rng = random.Random(7)
    sessions = {s: [rng.randrange(50) for _ in range(rng.randrange(1, 6))] for s in range(60)}
    reqs = []
    for i in range(1500):
        s = rng.randrange(60) if rng.random() < 0.8 else rng.randrange(3)
        sessions[s] += [rng.randrange(50) for _ in range(rng.randrange(0, 4))]
        ids = [("sys", k) for k in range(rng.randrange(0, 3))] + chained([s, *sessions[s][-20:]])
        reqs.append(Req(float(i), 4 * len(ids), 1, ids))
    trace = Trace(reqs, 4)
    for capacity in (8, 40, 150, 600, 5000):
        assert_same(*both(trace, policy, capacity, warmup=0.2))


def test_auto_runs_the_compiled_loop_where_it_can():
    trace = Trace([Req(0.0, 8, 1, chained([1, 2])), Req(1.0, 8, 1, chained([1, 2]))], 4)
    assert replay(trace, "lru", 4).engine == "compiled"
    assert replay(trace, "slru:protected_size=1", 4).engine == "compiled"
    # not compiled: a policy object, another policy, concurrent mode, a host tier
    assert replay(trace, LRUPolicy(), 4).engine == "general"
    assert replay(trace, "session", 4).engine == "general"
    assert replay(trace, "workload:by_depth=true", 4).engine == "general"
    assert replay(trace, "lru", 4, mode="concurrent").engine == "general"
    assert replay(trace, "lru", 4, host_capacity=4).engine == "general"
    for policy, kwargs in ((LRUPolicy(), {}), ("session", {}), ("workload:by_depth=true", {}), ("lru", {"mode": "concurrent"}), ("lru", {"host_capacity": 4})):
        with pytest.raises(ValueError, match="compiled replay cannot run"):
            replay(trace, policy, 4, engine="compiled", **kwargs)
    with pytest.raises(InvalidArgument, match="engine"):
        replay(trace, "lru", 4, engine="fast")


def test_without_numba_the_general_path_runs(monkeypatch):
    import prefixkv.flat as flat

    monkeypatch.setattr(flat, "_AVAILABLE", False)
    trace = Trace([Req(0.0, 8, 1, chained([1, 2])), Req(1.0, 8, 1, chained([1, 2]))], 4)
    result = replay(trace, "lru", 4)
    assert result.engine == "general" and result.block_hits == 2


def test_bad_ids_are_refused_as_the_manager_refuses_them():
    for ids in ([1, None], [1, 1], [[1], 2]):
        trace = Trace([Req(0.0, 4 * len(ids), 1, ids)], 4)
        with pytest.raises(Exception) as general:
            replay(trace, "lru", 8, engine="general")
        with pytest.raises(type(general.value)):
            replay(trace, "lru", 8, engine="compiled")


def test_block_arrays_number_ids_by_first_reference():
    trace = Trace([Req(0.0, 12, 1, [50, 7, 9]), Req(1.0, 6, 1, [7, 3]), Req(2.0, 0, 1, [])], 4)
    arrays = block_arrays(trace)
    assert arrays.offsets.tolist() == [0, 3, 5, 5]
    assert arrays.ids.tolist() == [0, 1, 2, 1, 3] and arrays.num_ids == 4
    assert arrays.total_blocks.tolist() == [3, 2, 0]
    assert arrays.last_block_tokens.tolist() == [4, 2, 0]
    # other hashables take the dict's way to the same numbering
    tuples = Trace([Req(0.0, 8, 1, [("a",), ("b",)]), Req(1.0, 4, 1, [("b",)])], 4)
    assert block_arrays(tuples).ids.tolist() == [0, 1, 1]


def test_a_loaded_trace_is_converted_once(tmp_path):
    from prefixkv.sim.traces import load_trace

    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n'
                    '{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n')
    trace = load_trace(path)
    first = replay(trace, "lru", 4)
    cached = trace.block_arrays_cache[None]
    assert replay(trace, "fifo", 4).block_hits == first.block_hits == 2
    assert trace.block_arrays_cache[None] is cached and isinstance(cached.ids, np.ndarray)
    # a trace built by hand may change between replays: converted each time
    hand = Trace(list(trace.requests), trace.block_size)
    replay(hand, "lru", 4)
    assert not hand.block_arrays_cache


def test_a_sweep_worker_converts_its_trace_once(tmp_path, monkeypatch):
    import prefixkv.sim.blockarrays as blockarrays_mod
    from prefixkv.sim import sweep as sweep_mod
    from prefixkv.sim.sweep import TraceSource, sweep
    from prefixkv.sim.workloads import WorkloadConfig, generate_requests
    from prefixkv.sim.traces import write_token_trace

    path = tmp_path / "tokens.jsonl"
    write_token_trace(path, generate_requests(WorkloadConfig(num_requests=40)), block_size=16)
    calls = []
    convert = blockarrays_mod.block_arrays
    monkeypatch.setattr(blockarrays_mod, "block_arrays", lambda *a, **k: calls.append(1) or convert(*a, **k))
    source = TraceSource("tokens", (str(path),), "tokens")
    results = sweep([source], ["lru", "fifo", "arc"], {"tokens": [16, 64, 256]}, workers=1)
    assert len(results) == 9 and len(calls) == 1          # a token trace: hashed once for nine cells
    held = sweep_mod._held[1]
    assert held.frozen and list(held.block_arrays_cache) == [0]
    # the general path gives the same cells
    general = [replay(held, r["policy"], r["capacity"], engine="general").as_dict() for r in results]
    assert [{k: v for k, v in r.items() if k != "trace"} for r in results] == general


@pytest.mark.parametrize("spec", ["lirs", "lirs:hir_fraction=0.5"])
def test_lirs_replays_at_capacity_one_and_two(spec):
    # At capacity 1 LIRS has no LIR slot: making a block LIR demotes it again at once. Both paths
    # used to raise KeyError there (S's bottom was a hash pushed while no LIR block existed).
    trace = Trace([Req(float(i), 4 * len(ids), 1, chained(ids)) for i, ids in
                   enumerate([[1], [1], [2], [1], [2, 3], [2], [2], [1]])], 4)
    for capacity in (1, 2):
        compiled, general = both(trace, spec, capacity)
        assert_same(compiled, general)
        assert general.as_dict()["block_hits"] > 0
