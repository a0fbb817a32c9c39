"""The scheduler without a model: capacity checks, preemption, the cost model, the executor seam."""

from __future__ import annotations

import math
import random

import pytest

from prefixkv import KVCacheManager, OutOfBlocks, SequenceTooLong
from prefixkv.engine import (Engine, Request, RequestStatus, Round, Scheduler,
                             SchedulerConfig, SimulatedClock, StepOutput, round_capacity)
from prefixkv.engine.capacity import exclusive_blocks
from prefixkv.costs import GiB, MiB, PreemptionCostModel

B = 4


class EchoExecutor:
    """A stand-in executor: the next token is a fixed function of the last one; time is modelled."""

    def __init__(self, seconds_per_token: float = 1e-3, seconds_per_step: float = 0.0):
        self.per_token = seconds_per_token
        self.per_step = seconds_per_step
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        sampled = {r.request_id: (r.token_ids[-1] * 31 + 7) % 251 for r in plan.requests if r.sample}
        return StepOutput(sampled, self.per_step + self.per_token * plan.num_tokens)


def echo_reference(prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last * 31 + 7) % 251
        out.append(last)
    return out


def make(num_blocks=32, host=0, caching=True, cost=None, policy="lru", **config):
    mgr = KVCacheManager(num_blocks, B, hash_seed=0, enable_caching=caching, num_host_blocks=host, policy=policy)
    return mgr, Scheduler(mgr, SchedulerConfig(**config), cost or PreemptionCostModel(kv_bytes_per_token=512))


def assert_plan_addresses_valid(plan, mgr):
    """Every slot lies in a block of its own request's table, inside the pool; lengths fit the tables."""
    capacity = mgr.pool.num_blocks
    for row, r in enumerate(plan.requests):
        table = plan.block_tables[row]
        used = -(-r.seq_len // B)
        assert used <= table.shape[0]
        assert all(0 <= b < capacity for b in table[:used])
        for pos, slot in zip(range(r.start, r.seq_len), r.slot_mapping):
            assert slot // B == table[pos // B] and slot % B == pos % B


def assert_clean(mgr, sched):
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.active_blocks == 0 and len(mgr) == 0
    assert stats.evictable_blocks + stats.free_uncached_blocks == stats.capacity
    assert mgr.num_free_host_blocks == mgr.num_host_blocks
    assert not sched.requests and not sched.running and not sched.waiting


# -- the cost model: the design notes' numbers ------------------------------------------
def test_seed_recompute_time():
    cost = PreemptionCostModel(prefill_tokens_per_s=20_000)
    assert cost.recompute_s(4_000) == 0.2


def test_seed_swap_times():
    cost = PreemptionCostModel(link_bytes_per_s=25 * GiB)
    one_way = cost.swap_one_way_s(500 * MiB)
    assert one_way == 500 / 25 / 1024
    assert round(one_way * 1e3, 1) == 19.5
    assert round(cost.swap_round_trip_s(500 * MiB) * 1e3, 1) == 39.1


def test_cost_model_chooses():
    # The notes' request: 4,000 tokens of 128 KiB each (500 MiB): swap (39.1 ms) beats recompute (200 ms).
    cost = PreemptionCostModel()
    choice = cost.choose(tokens=4000, blocks=250, block_size=16, host_blocks_free=1000)
    assert choice.mode == "swap" and choice.recompute_s == 0.2
    assert round(choice.swap_s * 1e3, 1) == 39.1
    # ... unless host memory is short, or the link is slow, or a mode is forced.
    assert cost.choose(tokens=4000, blocks=250, block_size=16, host_blocks_free=249).mode == "recompute"
    slow = PreemptionCostModel(link_bytes_per_s=2 * GiB)
    assert slow.choose(tokens=4000, blocks=250, block_size=16, host_blocks_free=1000).mode == "recompute"
    forced = PreemptionCostModel(mode="recompute")
    assert forced.choose(tokens=4000, blocks=250, block_size=16, host_blocks_free=1000).mode == "recompute"
    no_host = PreemptionCostModel(mode="swap").choose(tokens=10, blocks=2, block_size=16, host_blocks_free=0)
    assert no_host.mode == "recompute" and math.isinf(no_host.swap_s)
    with pytest.raises(ValueError):
        PreemptionCostModel(prefill_tokens_per_s=0)


# -- the seed's case: 3 free blocks, 4 requests crossing a block boundary -----------------
def four_at_a_boundary(when_full, host=0):
    """Four running requests, each with 8 tokens cached (2 full blocks) and one sampled token to
    feed back: every decode needs a new block, and only 3 are free."""
    mgr, sched = make(num_blocks=11, host=host, caching=False, when_full=when_full, max_num_batched_tokens=64)
    ex = EchoExecutor()
    for i in range(4):
        sched.add(Request(f"r{i}", tuple(range(10 * i, 10 * i + 8)), max_new_tokens=6))
    plan = sched.schedule()
    assert [r.num_tokens for r in plan.requests] == [8, 8, 8, 8]
    sched.update(plan, ex.execute(plan))
    assert mgr.num_free_blocks == 3
    assert all(mgr.blocks_needed_to_append(f"r{i}", 1) == 1 for i in range(4))
    return mgr, sched, ex


def test_seed_case_runs_three_and_lets_one_wait():
    mgr, sched, ex = four_at_a_boundary("wait")
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["r0", "r1", "r2"]
    assert not plan.preempted
    assert_plan_addresses_valid(plan, mgr)
    assert sched.requests["r3"].status is RequestStatus.RUNNING      # kept its blocks, sat out
    assert mgr.num_tokens("r3") == 8
    mgr.check_invariants()
    engine = Engine(sched, ex, clock=SimulatedClock())
    engine.requests.update(sched.requests)
    sched.update(plan, ex.execute(plan))
    engine.run()
    for i in range(4):
        assert engine.requests[f"r{i}"].output == echo_reference(list(range(10 * i, 10 * i + 8)), 6)
    assert_clean(mgr, sched)


def test_seed_case_preempts_one_that_frees_enough():
    mgr, sched, ex = four_at_a_boundary("preempt")
    plan = sched.schedule()
    assert [r.request_id for r in plan.requests] == ["r0", "r1", "r2"]
    assert plan.preempted == (("r3", "recompute"),)
    assert_plan_addresses_valid(plan, mgr)
    assert sched.requests["r3"].status is RequestStatus.PREEMPTED and mgr.is_preempted("r3")
    mgr.check_invariants()
    engine = Engine(sched, ex, clock=SimulatedClock())
    engine.requests.update(sched.requests)
    sched.update(plan, ex.execute(plan))
    engine.run()
    for i in range(4):
        assert engine.requests[f"r{i}"].output == echo_reference(list(range(10 * i, 10 * i + 8)), 6)
    assert engine.requests["r3"].metrics.preemptions >= 1
    assert_clean(mgr, sched)


def test_seed_case_preempts_by_swap_when_host_memory_allows():
    mgr, sched, ex = four_at_a_boundary("preempt", host=8)
    plan = sched.schedule()
    assert plan.preempted == (("r3", "swap"),)
    assert plan.blocks_moved("swap_out") == 2
    assert sched.requests["r3"].status is RequestStatus.SWAPPED
    assert mgr.num_free_host_blocks == 6


def snapshot(sched):
    return (sched.mgr.snapshot(), [(r.request_id, r.status, r.num_computed, len(r.tokens)) for r in
                                   sched.running + sched.waiting], sched.step_count)


def test_a_round_that_does_not_fit_is_refused_and_changes_nothing():
    mgr, sched, _ = four_at_a_boundary("wait")
    before = snapshot(sched)
    all_four = Round(grow=tuple((f"r{i}", 1) for i in range(4)))
    cap = round_capacity(mgr, all_four, sched.requests)
    assert (cap.needed, cap.available, cap.fits) == (4, 3, False)
    with pytest.raises(OutOfBlocks) as info:
        sched.commit(all_four)
    assert info.value.needed == 4 and info.value.available == 3
    assert snapshot(sched) == before
    mgr.check_invariants()
    # A new admission on top of three decodes does not fit either, and changes nothing.
    sched.add(Request("late", tuple(range(200, 205)), max_new_tokens=2))
    before = snapshot(sched)
    with pytest.raises(OutOfBlocks):
        sched.commit(Round(grow=(("r0", 1), ("r1", 1), ("r2", 1)), admit=(("late", 5),)))
    assert snapshot(sched) == before
    # The scheduler's own proposal fits.
    rnd = sched.propose()
    assert round_capacity(mgr, rnd, sched.requests).fits
    assert rnd.admit == ()


def test_round_validation():
    mgr, sched, _ = four_at_a_boundary("wait")
    sched.add(Request("new", (1, 2, 3), max_new_tokens=1))
    with pytest.raises(ValueError, match="preemptions"):
        sched.commit(Round(preempt=(("r3", "recompute"),), admit=(("new", 3),)))
    with pytest.raises(ValueError, match="twice"):
        sched.commit(Round(grow=(("r0", 1), ("r0", 1))))
    with pytest.raises(ValueError, match="not live"):
        sched.commit(Round(grow=(("nobody", 1),)))
    with pytest.raises(OutOfBlocks):   # 2 host blocks needed, none configured
        sched.commit(Round(preempt=(("r3", "swap"),)))
    mgr.check_invariants()


def test_request_that_can_never_fit_is_refused():
    mgr, sched = make(num_blocks=4)
    with pytest.raises(SequenceTooLong):
        sched.add(Request("big", tuple(range(14)), max_new_tokens=4))   # 17 tokens > 16 slots
    sched.add(Request("ok", tuple(range(14)), max_new_tokens=3))         # 16 tokens fit
    with pytest.raises(ValueError):
        sched.add(Request("ok", (1,), max_new_tokens=1))


# -- shared blocks survive a preemption ---------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_never_frees_blocks_others_reference(mode):
    mgr, sched = make(num_blocks=32, host=16, max_num_batched_tokens=64)
    ex = EchoExecutor()
    shared = tuple(range(100, 112))                       # 3 full blocks
    sched.add(Request("a", shared + (1, 2), max_new_tokens=4))
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    sched.add(Request("b", shared + (3, 4, 5), max_new_tokens=4))
    plan = sched.schedule()
    assert [(r.request_id, r.cached_tokens) for r in plan.requests] == [("a", 0), ("b", 12)]
    sched.update(plan, ex.execute(plan))
    shared_blocks = mgr.block_ids("a")[:3]
    assert mgr.block_ids("b")[:3] == shared_blocks
    ref = mgr.pool.ref_count
    assert [ref[b] for b in shared_blocks] == [2, 2, 2]
    own = exclusive_blocks(mgr, "b")
    assert own == len(mgr.block_ids("b")) - 3
    free = mgr.num_free_blocks
    sched.commit(Round(preempt=(("b", mode),), grow=(("a", 1),)))
    assert mgr.num_free_blocks == free + own - mgr.blocks_needed_to_append("a", 0)
    assert [ref[b] for b in shared_blocks] == [1, 1, 1]       # still a's
    assert mgr.block_ids("a")[:3] == shared_blocks
    mgr.check_invariants()
    assert sched.requests["b"].status is (RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED)


# -- budget, concurrency, chunking ----------------------------------------------------------
def test_budget_and_concurrency_limits_hold_every_step():
    rng = random.Random(1)
    mgr, sched = make(num_blocks=40, max_num_batched_tokens=12, max_num_seqs=3, max_prefill_chunk=8)
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    prompts = {}
    for i in range(8):
        prompt = [rng.randrange(251) for _ in range(rng.randrange(3, 30))]
        prompts[engine.add_request(prompt, max_new_tokens=rng.randrange(1, 8))] = prompt
    while engine.has_unfinished:
        result = engine.step()
        plan = result.plan
        assert plan.num_tokens <= 12
        assert all(r.num_tokens <= 8 for r in plan.requests)
        assert len(sched.running) <= 3
        assert_plan_addresses_valid(plan, mgr)
        mgr.check_invariants()
    for rid, prompt in prompts.items():
        r = engine.requests[rid]
        assert r.output == echo_reference(prompt, r.max_new_tokens)
    assert any(p.num_prefill_tokens and p.num_decode_tokens for p in ex.plans)
    assert_clean(mgr, sched)


def test_prefix_hit_admits_only_hit_plus_first_chunk():
    mgr, sched = make(num_blocks=64, max_num_batched_tokens=6)
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    system = list(range(50, 70))                          # 5 full blocks
    engine.add_request(system + [1, 2, 3], max_new_tokens=1, request_id="first")
    engine.run()
    engine.add_request(system + list(range(5, 15)), max_new_tokens=2, request_id="second")
    plan = engine.step().plan
    (s,) = plan.requests
    assert (s.cached_tokens, s.start, s.num_tokens) == (20, 20, 6)
    assert mgr.num_tokens("second") == 26                 # prompt[:hit + chunk], not the whole prompt
    engine.run()
    assert engine.requests["second"].metrics.prefix_hit_tokens == 20
    assert_clean(mgr, sched)


# -- cancellation on every path ------------------------------------------------------------
def test_cancel_in_every_state_releases_everything():
    mgr, sched = make(num_blocks=11, host=16, caching=True, max_num_batched_tokens=64, max_num_seqs=4)
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    for i in range(4):
        engine.add_request(list(range(10 * i, 10 * i + 8)), max_new_tokens=8, request_id=f"r{i}")
    engine.add_request([7, 7, 7], max_new_tokens=3, request_id="waiting")
    engine.step()
    engine.step()                       # r3 is swapped out to make room
    assert sched.requests["r3"].status is RequestStatus.SWAPPED
    assert mgr.num_free_host_blocks < 16
    assert engine.cancel("r3") and engine.cancel("waiting") and engine.cancel("r0")
    assert not engine.cancel("r0") and not engine.cancel("nobody")
    assert mgr.num_free_host_blocks == 16
    mgr.check_invariants()
    engine.run()
    assert engine.requests["r1"].output == echo_reference(list(range(10, 18)), 8)
    assert {engine.requests[i].status for i in ("r0", "r3", "waiting")} == {RequestStatus.CANCELLED}
    assert_clean(mgr, sched)


def test_cancel_a_recompute_preempted_request():
    mgr, sched, ex = four_at_a_boundary("preempt")
    sched.update(*(lambda p: (p, ex.execute(p)))(sched.schedule()))
    assert sched.requests["r3"].status is RequestStatus.PREEMPTED and "r3" in mgr
    assert sched.cancel("r3")
    assert "r3" not in mgr
    sched.abort_all()
    assert_clean(mgr, sched)


def test_executor_failure_releases_blocks_and_drops_unwritten_cache_entries():
    mgr, sched = make(num_blocks=32, max_num_batched_tokens=64)
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    engine.add_request(list(range(100, 112)) + [1], max_new_tokens=6, request_id="ok")
    engine.step()
    engine.step()

    class Boom(Exception):
        pass

    def explode(plan):
        raise Boom
    engine.add_request(list(range(200, 216)), max_new_tokens=3, request_id="new")
    ex.execute, real = explode, ex.execute
    with pytest.raises(Boom):
        engine.step()
    ex.execute = real
    assert engine.requests["new"].status is RequestStatus.FAILED
    assert engine.requests["ok"].status is RequestStatus.FAILED     # it was in the failed step too
    mgr.check_invariants()
    assert mgr.stats().active_blocks == 0
    # "new" published 4 full blocks whose KV was never written: they must not be served.
    assert mgr.match(mgr.prompt(list(range(200, 216)) + [0])).hit_tokens == 0
    engine.add_request(list(range(200, 216)), max_new_tokens=3, request_id="again")
    engine.run()
    assert engine.requests["again"].metrics.prefix_hit_tokens == 0
    assert_clean(mgr, sched)


# -- the seam: a modelled executor on a simulated clock ---------------------------------------
def run_simulated(seed):
    rng = random.Random(seed)
    clock = SimulatedClock()
    mgr, sched = make(num_blocks=24, host=8, max_num_batched_tokens=16, max_num_seqs=4)
    engine = Engine(sched, EchoExecutor(seconds_per_token=1e-3, seconds_per_step=5e-3), clock=clock)
    system = [rng.randrange(251) for _ in range(12)]
    for i in range(10):
        engine.add_request(system + [rng.randrange(251) for _ in range(rng.randrange(1, 12))],
                           max_new_tokens=rng.randrange(2, 10), arrival_time=0.02 * i)
    engine.run()
    assert_clean(mgr, sched)
    return engine.summary(), [(r.output, r.metrics.ttft, r.metrics.itl) for r in engine.requests.values()]


def test_simulated_runs_are_deterministic_and_arrivals_wait_for_the_clock():
    first, second = run_simulated(3), run_simulated(3)
    assert first == second
    summary, per_request = first
    assert summary["finished"] == 10 and summary["prefix_hit_tokens"] > 0
    assert summary["seconds"] > 0.18        # the last request arrived at 0.18 s
    assert all(ttft > 0 for _, ttft, _ in per_request)


def test_metrics_from_an_injected_clock_are_exact():
    clock = SimulatedClock(start=10.0)
    mgr, sched = make(num_blocks=32, max_num_batched_tokens=4)
    engine = Engine(sched, EchoExecutor(seconds_per_token=0.0, seconds_per_step=0.5), clock=clock)
    engine.add_request(list(range(10)), max_new_tokens=3, request_id="a")     # 3 prefill steps
    engine.step()
    engine.add_request([1, 2], max_new_tokens=2, request_id="b")              # arrives at 10.5
    engine.run()
    a, b = engine.requests["a"].metrics, engine.requests["b"].metrics
    assert a.ttft == 1.5 and a.itl == [0.5, 0.5] and a.token_times == [11.5, 12.0, 12.5]
    assert b.arrival == 10.5 and b.first_scheduled == 11.0       # budget: a's chunk of 4 filled step 2
    assert b.ttft is not None and b.ttft > 0
    assert engine.summary()["ttft_p50_s"] is not None


# -- random workloads: every step fits, every address is valid, nothing leaks ----------------
# Policies other than LRU evict a chain's root before its tail, leaving cached blocks cut off from
# their prefix, which an admission can reconnect in the middle of a round.
@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo", "arc"])
@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_never_overcommit(seed, policy):
    rng = random.Random(seed)
    host = rng.choice([0, 0, 8, 32])
    cost = PreemptionCostModel(kv_bytes_per_token=512, mode=rng.choice(["auto", "recompute", "swap"]))
    mgr, sched = make(num_blocks=rng.randrange(8, 30), host=host, caching=rng.random() < 0.7, cost=cost,
                      policy=policy,
                      max_num_batched_tokens=rng.randrange(1, 40), max_num_seqs=rng.randrange(1, 8),
                      max_prefill_chunk=rng.choice([None, 3, 8]), when_full=rng.choice(["preempt", "wait"]))
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    capacity_tokens = mgr.pool.num_blocks * B
    systems = [[rng.randrange(251) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    prompts = {}
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            prompt = rng.choice(systems) + [rng.randrange(251) for _ in range(rng.randrange(1, 16))]
            max_new = rng.randrange(1, 12)
            if len(prompt) + max_new - 1 <= capacity_tokens:
                prompts[engine.add_request(prompt, max_new_tokens=max_new)] = prompt
        if sched.requests and rng.random() < 0.05:
            engine.cancel(rng.choice(list(sched.requests)))
        if not engine.has_unfinished and step >= 60:
            break
        plan = engine.step().plan
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        assert_plan_addresses_valid(plan, mgr)
        mgr.check_invariants()
    assert not engine.has_unfinished
    for rid, prompt in prompts.items():
        r = engine.requests[rid]
        if r.status is RequestStatus.FINISHED:
            assert r.output == echo_reference(prompt, r.max_new_tokens)
        else:
            assert r.status is RequestStatus.CANCELLED
    assert_clean(mgr, sched)


def _root_first_engine():
    """An engine whose pool holds a prompt's blocks B C D with its root A evicted."""
    from ordered_policy import OrderedPolicy

    class RootFirst(OrderedPolicy):
        """Evicts a chain's root before anything else: the rest stays cached, cut off."""

        name = "root-first"

        def evict(self):
            for block in self._order:
                if self.pool.depth[block] == 0:
                    del self._order[block]
                    return block
            return self._order.popitem(last=False)[0]

    mgr = KVCacheManager(8, B, hash_seed=0, policy=RootFirst())
    sched = Scheduler(mgr, SchedulerConfig(), PreemptionCostModel(kv_bytes_per_token=512))
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    p = list(range(16))                                # blocks A B C D
    engine.generate([p], max_new_tokens=1)
    engine.generate([list(range(100, 117))], max_new_tokens=1)   # evicts A: B C D stay, cut off
    return mgr, sched, engine, p


def test_a_published_duplicate_of_a_cut_off_block_is_charged_to_the_admission_that_hits_it():
    mgr, sched, engine, p = _root_first_engine()       # p's root A evicted, B C D cached, cut off
    # r1 recomputes A and B; its B is a duplicate (B's hash is still cached, cut off), so r2's
    # lookup finds the old, evictable B: pinning it costs a free block r2's plan must count.
    r1 = engine.add_request(p[:8] + [200, 201, 202, 203, 204], max_new_tokens=1)
    r2 = engine.add_request(p + list(range(210, 219)), max_new_tokens=1)
    plan = engine.step().plan
    assert {r.request_id for r in plan.requests} <= {r1, r2} and r1 in {r.request_id for r in plan.requests}
    assert_plan_addresses_valid(plan, mgr)
    while engine.has_unfinished:
        engine.step()
    assert engine.requests[r2].output == echo_reference(p + list(range(210, 219)), 1)
    assert_clean(mgr, sched)


def test_an_admission_reconnecting_cut_off_blocks_stays_within_its_planned_blocks():
    mgr, sched, engine, p = _root_first_engine()       # p's root A evicted, B C D cached, cut off
    # One round: r1 publishes A again, which reconnects B and C for r2 (D goes to r1's allocation).
    # r2 was planned with one hit block (A, from r1); pinning B and C on top would overcommit.
    r1 = engine.add_request(p[:4] + [200, 201, 202, 203, 204], max_new_tokens=1)
    r2 = engine.add_request(p + list(range(210, 219)), max_new_tokens=1)
    plan = engine.step().plan
    assert [r.request_id for r in plan.requests] == [r1, r2]
    assert_plan_addresses_valid(plan, mgr)
    mgr.check_invariants()
    while engine.has_unfinished:
        engine.step()
    assert engine.requests[r2].output == echo_reference(p + list(range(210, 219)), 1)
    assert engine.requests[r2].metrics.prefix_hit_tokens == 12     # A (from r1), B and C
    assert_clean(mgr, sched)


def test_salts_isolate_requests_in_the_engine():
    mgr, sched = make(num_blocks=32)
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    prompt = list(range(20))
    first = engine.add_request(prompt, max_new_tokens=1, salt="tenant-a")
    engine.run()
    other = engine.add_request(prompt, max_new_tokens=1, salt="tenant-b")
    same = engine.add_request(prompt, max_new_tokens=1, salt="tenant-a")
    engine.run()
    hits = {rid: engine.requests[rid].metrics.prefix_hit_tokens for rid in (first, other, same)}
    assert hits == {first: 0, other: 0, same: 16}
    assert engine.requests[other].output == engine.requests[same].output == echo_reference(prompt, 1)
    assert_clean(mgr, sched)
