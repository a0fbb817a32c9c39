"""The classic policies of issue 28 (sieve, clock, 2q, mq, car, lirs, wtinylfu, lecar) under the
paged-cache rules: the conformance checker, random legal event scripts (candidates always the
released cached blocks, victims always candidates), duplicates taking a hash over, blocks taken
up a tier, options refused by name, and each one's characteristic rule on a small script.
Equality with libCacheSim's algorithms is in test_libcachesim_equality.py."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from test_policies_more import FakePool, drive, plan_duplicate_workload, plan_workload, run_workload, scripts

from prefixkv import BlockPool
from prefixkv.errors import InvalidArgument
from prefixkv.policies import (BUILTIN_POLICIES, CARPolicy, ClockPolicy, EvictionPolicy, LeCaRPolicy, LIRSPolicy,
                               MQPolicy, SievePolicy, TwoQPolicy, WTinyLFUPolicy, check_policy, make_policy)

CLASSICS = ["sieve", "clock", "2q", "mq", "car", "lirs", "wtinylfu", "lecar"]
# small settings that make each rule bite within a short script
TIGHT = ["clock:counter_bits=2", "2q:in_fraction=0.5:out_fraction=1.0", "mq:lifetime=3:n_queues=3",
         "lirs:hir_fraction=0.3:nonresident_ratio=0.5", "wtinylfu:window_fraction=0.25:sample_ratio=1",
         "lecar:seed=7:learning_rate=2.0"]


def test_registered_and_in_the_default_sweep():
    for name in CLASSICS:
        assert name in BUILTIN_POLICIES
        policy = make_policy(name)
        assert isinstance(policy, EvictionPolicy) and policy.name == name
        assert len(policy) == 0 and 0 not in policy


@pytest.mark.parametrize("name", CLASSICS + TIGHT)
def test_conformance(name):
    report = check_policy(lambda: make_policy(name))
    assert report.evictions > 100 and report.differs_from_lru


@pytest.mark.parametrize("name", CLASSICS + TIGHT)
@settings(max_examples=60, deadline=None)
@given(script=scripts)
def test_random_event_scripts_keep_the_candidates_exact(name, script):
    # drive() checks after every step that len/in name exactly the released cached blocks and
    # that each victim is one of them
    drive(make_policy(name), script, pool=FakePool(), pick=True)


@pytest.mark.parametrize("name", CLASSICS)
def test_runs_the_real_manager_and_differs_from_lru(name):
    evictions = hits = 0
    victims, lru_victims = [], []
    for seed in range(3):
        ops = plan_workload(seed)
        mgr = run_workload(make_policy(name), ops)
        hits += mgr.stats().hit_tokens
        evictions += mgr.pool.evictions
        victims += [repr(e) for e in mgr.drain_events()]
        lru_victims += [repr(e) for e in run_workload(make_policy("lru"), ops).drain_events()]
    assert evictions > 50 and hits > 0
    # lirs: 16 blocks leave it one HIR slot, and on these short workloads its victims are LRU's
    # (test_conformance shows that it differs from LRU elsewhere)
    assert (victims != lru_victims) or name == "lirs"


@pytest.mark.parametrize("name", CLASSICS)
def test_duplicates_taking_over(name, monkeypatch):
    promotions = []
    original = BlockPool._promote

    def promote(pool, duplicate, block_hash, evicted):
        promotions.append(duplicate)
        original(pool, duplicate, block_hash, evicted)

    monkeypatch.setattr(BlockPool, "_promote", promote)
    for seed in range(8):
        ops = plan_duplicate_workload(seed)
        mgr = run_workload(make_policy(name), ops)
        for op in ops:
            if op[0] == "admit" and op[1] in mgr:
                mgr.free(op[1])
        mgr.check_invariants()
        assert mgr.pool.num_active == 0
    assert promotions


@pytest.mark.parametrize("name", CLASSICS)
def test_blocks_taken_up_a_tier_leave_no_residency(name):
    """take_cached (an exclusive host tier's hit) ends a residency with no event: the next
    on_cached of that block must not leave the old one counted."""
    rng = random.Random(0)
    pool = BlockPool(16, 4, make_policy(name))
    next_hash = iter(range(10**9))
    for _ in range(1500):
        blocks = pool.allocate(rng.randrange(1, 4))
        for depth, block in enumerate(blocks):
            pool.publish(block, next(next_hash), None, depth)
        pool.release(list(reversed(blocks)))
        cached = [b for b, h in enumerate(pool.block_hash) if h is not None and not pool.ref_count[b]]
        if cached and rng.random() < 0.5:
            block = rng.choice(cached)
            pool.take_cached([block])
            pool.release([block])
        evictable = [b for b, h in enumerate(pool.block_hash) if h is not None and not pool.ref_count[b]]
        assert len(pool.policy) == len(evictable) and all(b in pool.policy for b in evictable)
    policy = pool.policy
    sizes = {"2q": lambda p: sum(p._size), "car": lambda p: sum(p._size), "wtinylfu": lambda p: sum(p._size),
             "lirs": lambda p: len(p._block), "mq": lambda p: len(p._queue), "sieve": lambda p: len(p._ticket),
             "clock": lambda p: len(p._ticket), "lecar": lambda p: len(p._freq)}
    assert sizes[name](policy) <= pool.num_blocks


@pytest.mark.parametrize("spec, option", [
    ("clock:counter_bits=0", "counter_bits"), ("clock:init_freq=2", "init_freq"),
    ("2q:in_fraction=1.0", "in_fraction"), ("2q:out_fraction=-1", "out_fraction"),
    ("mq:n_queues=0", "n_queues"), ("mq:lifetime=0", "lifetime"), ("mq:ghost_ratio=nan", "ghost_ratio"),
    ("lirs:hir_fraction=1.5", "hir_fraction"), ("wtinylfu:window_fraction=1", "window_fraction"),
    ("wtinylfu:sample_ratio=0", "sample_ratio"), ("lecar:seed=1.5", "seed"), ("lecar:discount=0", "discount"),
])
def test_bad_options_are_refused_by_name(spec, option):
    with pytest.raises((InvalidArgument, ValueError), match=option):
        make_policy(spec)


def _script(*steps):
    return [(kind, block, h, 0) for kind, block, h in steps]


def test_sieve_keeps_a_visited_block_and_its_hand_moves_on():
    # blocks 0..3 cached in order; 0 and 1 hit: the hand passes them (clearing) and evicts 2, then 3
    script = _script(*[("cache", b, b) for b in range(4)], *[("release", b, b) for b in range(4)],
                     ("hit", 0, 0), ("release", 0, 0), ("hit", 1, 1), ("release", 1, 1),
                     ("evict", 0, 0), ("evict", 0, 0), ("evict", 0, 0))
    assert drive(SievePolicy(), script) == [2, 3, 0]


def test_clock_gives_a_hit_block_a_second_chance_at_the_new_end():
    script = _script(*[("cache", b, b) for b in range(3)], *[("release", b, b) for b in range(3)],
                     ("hit", 0, 0), ("release", 0, 0), ("evict", 0, 0), ("evict", 0, 0), ("evict", 0, 0))
    assert drive(ClockPolicy(), script) == [1, 2, 0]


def test_2q_sends_a_returning_hash_to_am_and_ignores_hits_in_a1in():
    pool = FakePool(4)                      # kin = 1, kout = 2
    script = _script(("cache", 0, 0), ("release", 0, 0), ("cache", 1, 1), ("release", 1, 1),
                     ("hit", 0, 0), ("release", 0, 0),      # a hit in A1in changes nothing
                     ("evict", 0, 0),                       # A1in over kin: its oldest (0) -> A1out
                     ("cache", 0, 0), ("release", 0, 0),    # hash 0 returns: into Am
                     ("cache", 2, 2), ("release", 2, 2), ("evict", 0, 0), ("evict", 0, 0))
    # A1in {1, 2} is over kin: 1 goes; then A1in {2} is not, so Am's block 0 goes before 2
    assert drive(TwoQPolicy(), script, pool=pool) == [0, 1, 0]


def test_mq_keeps_frequent_blocks_in_higher_queues_until_they_expire():
    script = _script(("cache", 0, 0), ("release", 0, 0), *[("hit", 0, 0), ("release", 0, 0)] * 3,
                     ("cache", 1, 1), ("release", 1, 1), ("evict", 0, 0))
    policy = MQPolicy()
    assert drive(policy, script) == [1] and policy._queue[0] == 2     # accessed 4 times: queue 2
    policy = MQPolicy(lifetime=1)
    assert drive(policy, script) == [1] and policy._queue[0] == 1     # idle past its lifetime: one down


def test_car_moves_referenced_t1_blocks_to_t2_and_learns_from_b1():
    policy = CARPolicy()
    pool = FakePool(4)
    script = _script(*[("cache", b, b) for b in range(4)], *[("release", b, b) for b in range(4)],
                     ("hit", 0, 0), ("release", 0, 0), ("evict", 0, 0))
    assert drive(policy, script, pool=pool) == [1]          # 0 was referenced: on to T2
    assert policy._list[0] == 2 and policy.p == 0
    pool.cache(1, 1)                                        # hash 1 comes back from B1
    policy.on_cached(1)
    assert policy.p == 1.0 and policy._list[1] == 2


def test_lirs_never_evicts_a_lir_block_while_an_hir_one_can_go():
    pool = FakePool(4)                                      # 3 LIR slots, 1 HIR
    script = _script(*[("cache", b, b) for b in range(4)], *[("release", b, b) for b in range(4)],
                     ("evict", 0, 0))
    assert drive(LIRSPolicy(), script, pool=pool) == [3]    # the fourth block came in as HIR


def test_wtinylfu_admits_the_window_candidate_only_if_it_is_more_frequent():
    pool = FakePool(4)
    steps = [("cache", b, b) for b in range(4)] + [("release", b, b) for b in range(4)]
    # window of 1: block 3 is the candidate; main's victim is the least recent probation block 0
    assert drive(WTinyLFUPolicy(window_fraction=0.25), _script(*steps, ("evict", 0, 0)), pool=FakePool(4)) == [3]
    steps += [("hit", 3, 3), ("release", 3, 3)]              # now 3 was seen twice: 0 goes
    assert drive(WTinyLFUPolicy(window_fraction=0.25), _script(*steps, ("evict", 0, 0)), pool=pool) == [0]


def test_lecar_is_reproducible_by_seed_and_random_across_seeds():
    ops = plan_workload(1, steps=300)

    def evictions(seed):
        mgr = run_workload(LeCaRPolicy(seed=seed), ops)
        return [e for e in mgr.drain_events()]

    assert evictions(3) == evictions(3)
    assert len({tuple(map(repr, evictions(seed))) for seed in range(6)}) > 1
