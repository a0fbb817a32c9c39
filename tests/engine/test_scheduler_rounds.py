"""The scheduler's rounds, without a model (an echo executor): ``commit`` refuses a round it cannot
apply (or one it already applied) before anything changes; ``when_full="wait"`` preempts only when
nothing else could run; a failed step or round undoes its block moves (demotions, loads, swaps,
copy-on-write copies) and a release whose session hint fails still gives the blocks back; the
executor's tokens and the plans handed back are checked; a one-token re-prefill chunk is not a
decode; bad clock steps, requests and limits are refused; and the Prometheus series of a watched
manager and engine (each once, steps counted when run, host blocks split cached / free)."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.costs import PreemptionCostModel
from prefixkv.engine import (Engine, Request, RequestStatus, Round, Scheduler, SchedulerConfig,
                             SimulatedClock, StepOutput)

B = 4


class EchoExecutor:
    def __init__(self):
        self.plans = []

    def execute(self, plan):
        self.plans.append(plan)
        sampled = {r.request_id: (r.token_ids[-1] * 31 + 7) % 251 for r in plan.requests if r.sample}
        return StepOutput(sampled, 1e-3 * plan.num_tokens)


def make(num_blocks=32, host=0, caching=True, host_cache=False, policy="lru", cost=None, **config):
    mgr = KVCacheManager(num_blocks, B, hash_seed=0, enable_caching=caching, num_host_blocks=host,
                         host_cache=host_cache, policy=policy)
    return mgr, Scheduler(mgr, SchedulerConfig(**config), cost or PreemptionCostModel(kv_bytes_per_token=512))


def snapshot(sched):
    return (sched.mgr.snapshot(), [(r.request_id, r.status, r.num_computed, len(r.tokens)) for r in
                                   sched.running + sched.waiting], sched.step_count)


def step(sched, ex):
    plan = sched.schedule()
    return plan, sched.update(plan, ex.execute(plan))


# -- commit: a round it cannot apply is refused before anything changes -----------------------
def _two_running():
    mgr, sched = make(num_blocks=32, max_num_batched_tokens=64)
    ex = EchoExecutor()
    sched.add(Request("a", tuple(range(10)), max_new_tokens=5))
    sched.add(Request("b", tuple(range(20, 26)), max_new_tokens=5))
    step(sched, ex)
    sched.add(Request("w", tuple(range(40, 45)), max_new_tokens=5))
    return mgr, sched, ex


@pytest.mark.parametrize("rnd", [
    Round(grow=(("a", 0),)),                       # computes nothing
    Round(grow=(("a", 2),)),                       # a decode has 1 token to compute
    Round(grow=(("w", 1),)),                       # not running
    Round(admit=(("a", 1),)),                      # running: admitted twice
    Round(swap_in=(("w", 1),)),                    # not swapped
    Round(preempt=(("w", "recompute"),)),          # not running
    Round(admit=(("w", -3),)),
    Round(grow=(("a", 1.0),)),                     # not an int
    Round(preempt=(("a", "drop"),)),               # no such mode
], ids=["grow-0", "grow-past-end", "grow-waiting", "admit-running", "swap-in-waiting",
        "preempt-waiting", "admit-negative", "grow-float", "preempt-bad-mode"])
def test_commit_refuses_a_round_it_cannot_apply_and_changes_nothing(rnd):
    mgr, sched, _ = _two_running()
    before = snapshot(sched)
    with pytest.raises(ValueError):
        sched.commit(rnd)
    assert snapshot(sched) == before
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    assert sched.requests["w"].status is RequestStatus.WAITING
    mgr.check_invariants()


def test_committing_the_same_round_twice_does_not_admit_twice():
    mgr, sched = make(num_blocks=32, max_num_batched_tokens=64)
    sched.add(Request("a", tuple(range(10)), max_new_tokens=5))
    rnd = sched.propose()
    assert rnd.admit == (("a", 10),)
    sched.commit(rnd)
    before = snapshot(sched)
    with pytest.raises(ValueError):
        sched.commit(rnd)
    assert snapshot(sched) == before
    assert sched.requests["a"].status is RequestStatus.RUNNING


# -- when_full="wait": preemption only when nothing else could run ------------------------------
def test_wait_mode_does_not_preempt_a_request_that_could_run():
    """The oldest running request needs a new block and none is free, but the newer one has room
    in its tail: with when_full="wait" the oldest sits this step out and the newer one runs
    (it used to be preempted because nothing had been scheduled before the oldest)."""
    mgr, sched = make(num_blocks=4, caching=False, when_full="wait", max_num_batched_tokens=64)
    ex = EchoExecutor()
    sched.add(Request("old", tuple(range(8)), max_new_tokens=4))      # 2 full blocks
    sched.add(Request("new", tuple(range(20, 25)), max_new_tokens=2))  # 2 blocks, 3 free slots
    step(sched, ex)
    assert mgr.num_free_blocks == 0 and mgr.blocks_needed_to_append("old", 1) == 1
    assert mgr.blocks_needed_to_append("new", 1) == 0
    plan, finished = step(sched, ex)
    assert plan.preempted == ()
    assert [r.request_id for r in plan.requests] == ["new"]
    assert [r.request_id for r in finished] == ["new"]
    assert sched.requests["old"].status is RequestStatus.RUNNING
    engine = Engine(sched, ex, clock=SimulatedClock())
    engine.requests.update(sched.requests)
    engine.run()
    assert not sched.requests and mgr.stats().active_blocks == 0
    mgr.check_invariants()


# -- a failed step's block moves: the host tier and loaded blocks must not keep unwritten KV -----
class Boom(Exception):
    pass


def _host_tier_engine():
    """A 4-block device with a host tier: "p"'s two full blocks cached; "x" then evicts one
    of them to the host tier (a demotion) in a decode that publishes nothing."""
    mgr, sched = make(num_blocks=4, host=8, host_cache=True, max_num_batched_tokens=64)
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    p = list(range(100, 109))
    engine.add_request(p, max_new_tokens=1, request_id="p")
    engine.run()
    engine.add_request(list(range(200, 208)), max_new_tokens=3, request_id="x")
    engine.step()                                  # x's prompt
    return mgr, sched, ex, engine, p


def _failing_step(engine, ex):
    real = ex.execute

    def explode(plan):
        ex.plans.append(plan)
        raise Boom
    ex.execute = explode
    with pytest.raises(Boom):
        engine.step()
    ex.execute = real
    return ex.plans[-1]


def test_a_failed_step_forgets_the_blocks_it_demoted_to_the_host_tier():
    mgr, sched, ex, engine, p = _host_tier_engine()
    plan = _failing_step(engine, ex)             # x's decode: a demotion, nothing published
    assert plan.blocks_moved("demote") == 1 and all(r.seq_len // B == r.start // B for r in plan.requests)
    mgr.check_invariants()
    # The demotion's copy never ran: the host block holds no KV of p's block, so it is no hit.
    assert mgr.match(mgr.prompt(p)).lower_hit_blocks == 0
    engine.add_request(p, max_new_tokens=1, request_id="again")
    engine.run()
    assert engine.requests["again"].output == [(p[-1] * 31 + 7) % 251]
    mgr.check_invariants()


def test_a_failed_step_forgets_the_blocks_it_loaded_from_the_host_tier():
    mgr, sched, ex, engine, p = _host_tier_engine()
    engine.run()                                   # x finishes; p's second block is on the host
    assert mgr.match(mgr.prompt(p)).lower_hit_blocks == 1
    engine.add_request(p[:8] + [7], max_new_tokens=1, request_id="q")
    plan = _failing_step(engine, ex)             # q loads p's block, computes 1 token: publishes nothing
    assert plan.blocks_moved("load") == 1 and all(r.seq_len // B == r.start // B for r in plan.requests)
    mgr.check_invariants()
    # The load never ran: the device block that took p's second block's hash holds no KV.
    assert mgr.match(mgr.prompt(p)).hit_tokens < 8


def test_a_failed_step_forgets_the_blocks_it_swapped_out_to_the_host_tier():
    mgr, sched = make(num_blocks=11, host=16, host_cache=True, max_num_batched_tokens=64,
                      cost=PreemptionCostModel(kv_bytes_per_token=512, mode="swap"))
    ex = EchoExecutor()
    engine = Engine(sched, ex, clock=SimulatedClock())
    prompts = [list(range(10 * i, 10 * i + 8)) for i in range(4)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, max_new_tokens=6, request_id=f"r{i}")
    engine.step()                                  # 8 blocks taken, every decode needs a new one
    plan = _failing_step(engine, ex)
    assert plan.preempted == (("r3", "swap"),) and plan.blocks_moved("swap_out") == 2
    assert all(r.seq_len // B == r.start // B for r in plan.requests)
    mgr.check_invariants()
    # r3's swap-out copies never ran: its prompt's blocks on the host hold no KV.
    assert mgr.match(mgr.prompt(prompts[3] + [1])).hit_tokens == 0


# -- a release whose session hint fails still gives the blocks back ------------------------------
def test_a_finished_request_whose_hint_is_invalid_does_not_leak_its_blocks():
    """The hint is built when the request finishes; an invalid one (here a negative next arrival,
    which add_request takes) raised before the manager freed anything, while the scheduler dropped
    the request: its blocks stayed active with no owner, for good."""
    mgr, sched = make(num_blocks=8, policy="session", max_num_batched_tokens=64)
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    engine.add_request([1, 2, 3, 4, 5], max_new_tokens=2, session="s", request_id="a")
    engine.requests["a"].next_arrival = -1.0    # add_request refuses it now; a scheduler user may not
    with pytest.raises(ValueError, match="next_arrival"):
        engine.run()
    assert "a" not in sched.requests and "a" not in mgr
    assert mgr.stats().active_blocks == 0
    mgr.check_invariants()


def test_a_policy_raising_on_a_hint_does_not_leak_the_requests_blocks():
    from prefixkv.errors import PolicyError
    from prefixkv.policies import LRUPolicy

    class Broken(LRUPolicy):
        def on_hint(self, hint):
            raise RuntimeError("boom")

    mgr = KVCacheManager(8, B, hash_seed=0, policy=Broken())
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=64))
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    engine.add_request([1, 2, 3, 4, 5], max_new_tokens=3, session="s", request_id="a")
    engine.step()
    with pytest.raises(PolicyError, match="boom"):
        engine.cancel("a")
    assert "a" not in sched.requests and "a" not in mgr
    assert mgr.stats().active_blocks == 0
    mgr.check_invariants()


def test_add_request_refuses_an_invalid_session_hint_up_front():
    mgr, sched = make(num_blocks=8, policy="session")
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    with pytest.raises(ValueError, match="next_arrival"):
        engine.add_request([1, 2, 3], max_new_tokens=1, session="s", next_arrival=-1.0)
    assert not engine.requests and not sched.requests


# -- update: the executor's tokens are checked before anything changes ---------------------------
@pytest.mark.parametrize("bad", [-1, 2**32, 3.7, "7", None])
def test_update_refuses_a_bad_sampled_token_and_changes_nothing(bad):
    """A bad token used to be appended (a float truncated) and only the next commit's append
    raised, mid-round, failing every request of that round and resetting the prefix cache."""
    mgr, sched = make(num_blocks=16, max_num_batched_tokens=64)
    sched.add(Request("a", (1, 2, 3), max_new_tokens=4))
    sched.add(Request("b", (4, 5, 6), max_new_tokens=4))
    plan = sched.schedule()
    before = [(r.request_id, list(r.tokens), r.num_computed) for r in sched.running]
    with pytest.raises(ValueError, match="'b'"):
        sched.update(plan, StepOutput({"a": 9, "b": bad}, 0.0))
    assert [(r.request_id, list(r.tokens), r.num_computed) for r in sched.running] == before
    sched.update(plan, StepOutput({"a": 9, "b": 10}, 0.0))
    assert sched.requests["b"].tokens == [4, 5, 6, 10]


# -- plan: a one-token re-prefill chunk is not a decode ------------------------------------------
def test_a_one_token_re_prefill_chunk_of_generated_tokens_is_not_a_decode():
    mgr, sched = make(num_blocks=16, caching=False, max_num_batched_tokens=64)
    ex = EchoExecutor()
    sched.add(Request("a", (1, 2, 3), max_new_tokens=6))
    for _ in range(3):
        step(sched, ex)
    r = sched.requests["a"]
    assert (len(r.tokens), r.num_computed) == (6, 5)
    sched.commit(Round(preempt=(("a", "recompute"),)))
    plan = sched.commit(Round(admit=(("a", 4),)))         # tokens[0:4]
    sched.update(plan, ex.execute(plan))
    plan = sched.commit(Round(grow=(("a", 1),)))          # tokens[4:5]: a generated token recomputed
    (s,) = plan.requests
    assert (s.start, s.seq_len, s.sample) == (4, 5, False)
    assert not s.is_decode and plan.num_decode_tokens == 0 and plan.num_prefill_tokens == 1
    sched.update(plan, ex.execute(plan))
    plan = sched.commit(Round(grow=(("a", 1),)))          # tokens[5:6]: the last sampled token fed back
    (s,) = plan.requests
    assert s.sample and s.is_decode and plan.num_decode_tokens == 1


# -- Prometheus metrics ---------------------------------------------------------------------------
def _scrape(metrics):
    """Every sample of the registry as {(name, sorted labels): value}; duplicates raise."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = sample.value
    return out


def test_watching_a_manager_and_its_engine_exports_each_series_once():
    """The module's own example watches the manager and the engine with one worker label; the
    manager's series came out twice (a scrape Prometheus rejects)."""
    pytest.importorskip("prometheus_client")
    from prefixkv.metrics import Metrics

    mgr, sched = make(num_blocks=8)
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=2)
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    metrics.watch_engine(engine, worker="w0")
    samples = _scrape(metrics)
    assert samples[("prefixkv_queries_total", (("worker", "w0"),))] == 1.0


def test_two_managers_under_one_worker_label_are_refused():
    pytest.importorskip("prometheus_client")
    from prefixkv.metrics import Metrics

    metrics = Metrics()
    metrics.watch_manager(make()[0], worker="w0")
    with pytest.raises(ValueError, match="w0"):
        metrics.watch_manager(make()[0], worker="w0")
    metrics.watch_manager(make()[0], worker="w1")
    _scrape(metrics)


def test_engine_steps_counter_counts_steps_run_not_idle_polls():
    pytest.importorskip("prometheus_client")
    from prefixkv.metrics import Metrics

    mgr, sched = make(num_blocks=8)
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    metrics = Metrics()
    metrics.watch_engine(engine, worker="w0")
    for _ in range(5):
        assert engine.step().plan.is_empty            # nothing to run: no step
    engine.add_request([1, 2, 3], max_new_tokens=2)
    engine.run()
    assert engine.run_metrics.steps == 2
    assert _scrape(metrics)[("prefixkv_engine_steps_total", (("worker", "w0"),))] == 2.0


def test_host_block_gauges_split_cached_from_free():
    """With a host tier, the host pool's cached (evictable) blocks were reported as free."""
    pytest.importorskip("prometheus_client")
    from prefixkv.metrics import Metrics

    mgr, sched, ex, engine, p = _host_tier_engine()
    engine.run()
    s = mgr.stats()
    assert s.host_evictable_blocks > 0
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    samples = _scrape(metrics)

    def host(state):
        return samples.get(("prefixkv_blocks", (("state", state), ("tier", "host"), ("worker", "w0"))))
    assert (host("active"), host("cached"), host("free")) == (
        s.host_active_blocks, s.host_evictable_blocks, s.host_free_uncached_blocks)
    assert host("active") + host("cached") + host("free") == mgr.num_host_blocks


# -- bad input refused: clock steps, requests, limits ---------------------------------------------
@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0])
def test_simulated_clock_refuses_a_step_that_is_not_a_finite_duration(seconds):
    """NaN passed the ``seconds < 0`` check and turned the clock (and every later time) into NaN."""
    clock = SimulatedClock(2.0)
    with pytest.raises(ValueError):
        clock.advance(seconds)
    with pytest.raises(ValueError):
        clock.on_step(seconds)
    assert clock.now() == 2.0


@pytest.mark.parametrize("max_new", [2.5, "3", True, None])
def test_request_refuses_a_max_new_tokens_that_is_not_an_int(max_new):
    """2.5 was taken: max_tokens became fractional and the request ran for 3 tokens."""
    with pytest.raises((TypeError, ValueError)):
        Request("a", (1, 2, 3), max_new_tokens=max_new)


def test_request_refuses_a_nan_arrival_time():
    """NaN compares false with every clock: the request ran at once and its latencies were NaN."""
    with pytest.raises(ValueError):
        Request("a", (1, 2, 3), max_new_tokens=1, arrival_time=float("nan"))


def test_abort_all_releases_every_request_even_when_one_release_raises():
    """close() / abort_all stopped at the first release that raised (a bad session hint), leaving
    the later requests live and holding blocks."""
    mgr, sched = make(num_blocks=16, policy="session", max_num_batched_tokens=64)
    engine = Engine(sched, EchoExecutor(), clock=SimulatedClock())
    engine.add_request([1, 2, 3, 4, 5], max_new_tokens=4, session="s", request_id="bad")
    engine.requests["bad"].next_arrival = -1.0  # (add_request refuses it up front)
    engine.add_request([6, 7, 8], max_new_tokens=4, request_id="ok")
    engine.add_request([9, 9], max_new_tokens=4, request_id="waiting", arrival_time=100.0)
    engine.step()
    with pytest.raises(ValueError, match="next_arrival"):
        engine.close()
    assert all(engine.requests[i].metrics.finished is not None for i in ("bad", "ok", "waiting"))
    assert not sched.requests and not sched.running and not sched.waiting
    assert len(mgr) == 0 and mgr.stats().active_blocks == 0
    assert {engine.requests[i].status for i in ("bad", "ok", "waiting")} == {RequestStatus.CANCELLED}
    mgr.check_invariants()


def test_updating_with_the_same_plan_twice_is_refused():
    """A second update of one plan appended a second sampled token whose KV was never computed
    (the next step then ran a two-token 'decode')."""
    mgr, sched = make(num_blocks=16, max_num_batched_tokens=64)
    ex = EchoExecutor()
    sched.add(Request("a", (1, 2, 3), max_new_tokens=4))
    plan = sched.schedule()
    out = ex.execute(plan)
    sched.update(plan, out)
    before = (list(sched.requests["a"].tokens), sched.requests["a"].num_computed)
    with pytest.raises(ValueError, match="'a'"):
        sched.update(plan, out)
    assert (list(sched.requests["a"].tokens), sched.requests["a"].num_computed) == before
    plan = sched.schedule()
    assert [(r.start, r.num_tokens) for r in plan.requests] == [(3, 1)]


@pytest.mark.parametrize("kwargs", [dict(max_num_batched_tokens=8.5), dict(max_num_seqs=2.5),
                                    dict(max_prefill_chunk=3.5), dict(max_num_batched_tokens="64"),
                                    dict(max_num_seqs=True)])
def test_scheduler_config_refuses_limits_that_are_not_ints(kwargs):
    """8.5 was taken: chunk sizes came out fractional and every step's commit failed."""
    with pytest.raises((TypeError, ValueError)):
        SchedulerConfig(**kwargs)


# -- a failed round's block moves never run later ----------------------------------------------
def test_a_failed_round_drops_its_copy_on_write_copies():
    """Demotions and loads of a round that failed midway were dropped, its copy-on-write copies were
    not: the next round ran the stale copy into a block that may have been handed out again."""
    mgr, sched = make(num_blocks=16, caching=False, max_num_batched_tokens=64)
    ex = EchoExecutor()
    sched.add(Request("a", (1, 2, 3, 4, 5, 6), max_new_tokens=4))
    step(sched, ex)                       # a: 7 tokens, its tail block partly filled
    mgr.fork("a", "x")                    # a caller's fork shares a's partial tail
    sched.add(Request("b", (7, 8, 9), max_new_tokens=1))

    def lost(*args):
        raise RuntimeError("executor lost")

    sched._admit = lost                   # a's grow (its copy on write) is applied, then the round fails
    with pytest.raises(RuntimeError):
        sched.commit(Round(grow=(("a", 1),), admit=(("b", 3),)))
    del sched._admit
    sched.add(Request("c", (1, 2, 3, 4, 5, 6, 7, 8), max_new_tokens=1))
    plan = sched.schedule()
    assert not [op for op in plan.block_ops if op.kind == "copy"]
    mgr.check_invariants()
