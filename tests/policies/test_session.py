"""Session hints (free() -> pool -> policy), the session policy's behaviour, and replay's forecasts."""

from __future__ import annotations

import json

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import InvalidArgument, PolicyError
from prefixkv.policies import LRUPolicy, SessionHint, SessionPolicy, check_policy, make_policy
from prefixkv.policies.base import PolicyBase
from prefixkv.sim.replay import replay, roc_auc
from prefixkv.sim.traces import Trace, TraceRequest, load_trace


class Recorder(LRUPolicy):
    """LRU that records what the hint protocol shows it."""

    name = "recorder"

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_hint(self, hint):
        self.seen.append(("hint", hint, self.pool.hint))

    def on_released(self, block):
        super().on_released(block)
        self.seen.append(("released", block, self.pool.hint))


def test_free_hands_the_hint_to_the_policy_before_the_blocks_and_only_during_the_release():
    policy = Recorder()
    mgr = KVCacheManager(8, 2, policy=policy, hash_seed=0)
    mgr.admit("a", [1, 2, 3, 4])
    hint = SessionHint("s1", end="tool_use", time=3.0)
    mgr.free("a", hint=hint)
    assert policy.seen[0] == ("hint", hint, None)          # before any block, pool.hint not yet set
    assert [e[0] for e in policy.seen[1:]] == ["released", "released"]
    assert all(e[2] is hint for e in policy.seen[1:])
    assert mgr.pool.hint is None
    mgr.admit("b", [1, 2, 3, 4, 5])
    mgr.free("b")                                            # no hint: none shown
    assert all(e[2] is None for e in policy.seen[3:]) and not any(e[0] == "hint" for e in policy.seen[3:])


def test_policies_without_hints_are_unchanged_by_them():
    def run(with_hints):
        mgr = KVCacheManager(6, 2, policy="lrfu", hash_seed=0)
        for i in range(30):
            mgr.admit(i, [i % 4, 1, 2, i % 3, 5, i % 5])
            mgr.free(i, hint=SessionHint(i % 3, end="end_turn", time=float(i)) if with_hints else None)
        return mgr.pool.snapshot()
    assert run(True) == run(False)


def test_free_refuses_a_bad_hint_and_a_raising_on_hint_keeps_the_sequence():
    mgr = KVCacheManager(8, 2, hash_seed=0)
    mgr.admit("a", [1, 2, 3])
    before = mgr.snapshot()
    with pytest.raises(InvalidArgument, match="hint"):
        mgr.free("a", hint={"session": 1})
    assert mgr.snapshot() == before

    class Broken(LRUPolicy):
        def on_hint(self, hint):
            raise RuntimeError("boom")

    mgr = KVCacheManager(8, 2, policy=Broken(), hash_seed=0)
    mgr.admit("a", [1, 2, 3])
    before = mgr.snapshot()
    with pytest.raises(PolicyError, match="on_hint.*boom"):
        mgr.free("a", hint=SessionHint("s"))
    assert mgr.snapshot() == before and "a" in mgr
    mgr.free("a")
    mgr.check_invariants()


@pytest.mark.parametrize("kwargs,argument", [
    (dict(session=None), "SessionHint.session"),
    (dict(session=[1]), "SessionHint.session"),
    (dict(session=1, end=3), "SessionHint.end"),
    (dict(session=1, time="now"), "SessionHint.time"),
    (dict(session=1, time=float("nan")), "SessionHint.time"),
    (dict(session=1, next_arrival=-1.0), "SessionHint.next_arrival"),
    (dict(session=1, turn=True), "SessionHint.turn"),
])
def test_session_hint_validates_its_fields(kwargs, argument):
    with pytest.raises(InvalidArgument) as info:
        SessionHint(**kwargs)
    assert info.value.argument == argument


def test_session_policy_without_hints_is_lru():
    def evictions(policy):
        mgr = KVCacheManager(6, 2, policy=policy, hash_seed=0)
        out = []
        for i in range(40):
            mgr.admit(i, [i % 5, 1, i % 7, 2, i % 3, i % 2])
            mgr.free(i)
            out.append(mgr.pool.evictions)
        return out, mgr.stats().hit_tokens
    assert evictions(SessionPolicy()) == evictions(LRUPolicy())


def test_session_policy_passes_the_conformance_check_and_differs_from_lru():
    report = check_policy(lambda: make_policy("session"))
    assert report.differs_from_lru and report.evictions > 200


def _agent_trace():
    """Two agent sessions: A ends with tool_use and is back in 10 s, B ends its turn and is back in 300 s.
    Between them, one-off requests fill the cache."""
    reqs = []
    t = 0.0
    for k in range(6):
        reqs.append(TraceRequest(t, 4 * 64, 1, [100 * k + 1, 100 * k + 2, 100 * k + 3, 100 * k + 4],
                                 session=f"a{k}", stop="tool_use"))
        reqs.append(TraceRequest(t + 1, 4 * 64, 1, [100 * k + 51, 100 * k + 52, 100 * k + 53, 100 * k + 54],
                                 session=f"b{k}", stop="end_turn"))
        for j in range(3):   # fillers, never reused
            reqs.append(TraceRequest(t + 2 + j, 2 * 64, 1, [10_000 + 10 * (3 * k + j), 10_001 + 10 * (3 * k + j)],
                                     session=f"x{k}.{j}", stop="end_turn"))
        reqs.append(TraceRequest(t + 10, 5 * 64, 1, [100 * k + 1, 100 * k + 2, 100 * k + 3, 100 * k + 4,
                                                     100 * k + 5], session=f"a{k}", stop="end_turn"))
        t += 400.0
    return Trace(reqs, 64)


def test_session_policy_keeps_the_tool_use_session_that_lru_evicts():
    trace = _agent_trace()
    lru = replay(trace, "lru", 8)
    session = replay(trace, "session", 8)
    assert session.block_hit_rate > lru.block_hit_rate
    assert lru.return_auc is None and session.predictions == len(trace)


def test_session_policy_learns_gaps_and_return_rates_per_end_reason():
    """Tool calls come back after 10 s, always; user turns after 300 s, half of them never."""
    events = []
    for i in range(200):
        start = 50.0 * i
        events += [(start + 10.0 * k, f"tool{i}", "tool_use") for k in range(5)]
        events += [(start + 300.0 * k, f"user{i}", "end_turn") for k in range(1 + i % 2)]
    policy = SessionPolicy()
    mgr = KVCacheManager(64, 2, policy=policy, hash_seed=0)
    for n, (t, session, end) in enumerate(sorted(events)):
        mgr.admit(n, [n % 50, 1])
        mgr.free(n, hint=SessionHint(session, end=end, time=t))
    p_tool, gap_tool = policy.predict(SessionHint("new", end="tool_use"))
    p_user, gap_user = policy.predict(SessionHint("new", end="end_turn"))
    assert 5.0 < gap_tool < 20.0 and 150.0 < gap_user < 600.0
    assert p_tool > 0.6 and p_user < 0.5   # true rates: 4 in 5, 1 in 3


def test_session_policy_forgets_sessions_beyond_its_limit():
    policy = SessionPolicy(max_sessions=3)
    mgr = KVCacheManager(16, 2, policy=policy, hash_seed=0)
    for i in range(10):
        mgr.admit(i, [i, 1])
        mgr.free(i, hint=SessionHint(i, end="tool_use", time=float(i)))
    assert len(policy._sessions) == 3 and len(policy._deadlines) == 3


def test_an_explicit_next_arrival_overrides_the_forecast():
    policy = SessionPolicy()
    KVCacheManager(8, 2, policy=policy, hash_seed=0)
    assert policy.predict(SessionHint("s", end="end_turn", next_arrival=5.0)) == (1.0, 5.0)


def test_replay_builds_hints_from_the_past_only():
    """The hint of each request carries its own stop reason, turn and timestamp, nothing of the next."""
    seen = []

    class Spy(LRUPolicy):
        name = "spy"

        def on_hint(self, hint):
            seen.append(hint)

    reqs = [TraceRequest(0.0, 128, 1, [1, 2], session="s", stop="tool_use"),
            TraceRequest(5.0, 128, 1, [7, 8], session="u", stop=None),
            TraceRequest(17.0, 192, 1, [1, 2, 3], session="s", stop="end_turn"),
            TraceRequest(20.0, 64, 1, [9])]                       # no session: no hint
    replay(Trace(reqs, 64), Spy(), 10)
    assert [(h.session, h.end, h.time, h.turn, h.next_arrival) for h in seen] == [
        ("s", "tool_use", 0.0, 0, None), ("u", None, 5.0, 0, None), ("s", "end_turn", 17.0, 1, None)]


def test_replay_scores_the_forecasts():
    trace = _agent_trace()
    result = replay(trace, "session", 8)
    out = result.as_dict()
    assert {"return_auc", "arrival_log_error", "predictions"} <= set(out)
    assert 0.0 <= out["return_auc"] <= 1.0 and out["arrival_log_error"] >= 0.0
    json.dumps(out)
    assert replay(trace, "lru", 8).as_dict()["return_auc"] is None


def test_roc_auc():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert roc_auc([0.5, 0.5, 0.5, 0.5], [False, True, False, True]) == 0.5
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert roc_auc([0.3], [True]) is None


def test_policies_that_ignore_hints_replay_as_before():
    """A policy object without on_hint / predict: hints change nothing in its replay."""

    class Plain(PolicyBase):
        name = "plain"

        def __init__(self):
            self.inner = LRUPolicy()

        def bind(self, pool):
            super().bind(pool)
            self.inner.bind(pool)

        def on_released(self, block):
            self.inner.on_released(block)

        def on_hit(self, block, was_evictable):
            self.inner.on_hit(block, was_evictable)

        def evict(self):
            return self.inner.evict()

        def clear(self):
            self.inner.clear()

        def __len__(self):
            return len(self.inner)

        def __contains__(self, block):
            return block in self.inner

        def snapshot(self):
            return self.inner.snapshot()

    trace = _agent_trace()
    assert replay(trace, Plain(), 8).block_hit_rate == replay(trace, "lru", 8).block_hit_rate


def test_session_policy_on_the_shared_weka_sample_beats_lru(weka_sample):
    trace = load_trace(weka_sample)
    capacity = round(trace.distinct_blocks() * 0.05)
    assert replay(trace, "session", capacity).block_hit_rate > replay(trace, "lru", capacity).block_hit_rate


@pytest.fixture
def weka_sample():
    from pathlib import Path
    path = Path(__file__).resolve().parents[3] / "shared" / "traces" / "weka-kv-cache-tester"
    if not path.is_dir():
        pytest.skip(f"{path} is not here")
    return path


def test_the_priority_wrapper_passes_hints_to_its_inner_policy():
    from prefixkv.policies import PriorityPolicy

    inner = SessionPolicy()
    policy = PriorityPolicy(inner, min_priority=5)
    mgr = KVCacheManager(16, 2, policy=policy, hash_seed=0)
    for i, t in enumerate((0.0, 30.0, 60.0)):
        mgr.admit(i, [1, 2, 3, 4 + i])
        mgr.free(i, hint=SessionHint("s", end="tool_use", time=t))
    assert policy.predict(SessionHint("s", end="tool_use")) == inner.predict(SessionHint("s", end="tool_use"))
    assert 20.0 < inner.predict(SessionHint("s", end="tool_use"))[1] < 40.0
    mgr.check_invariants()
    assert PriorityPolicy(LRUPolicy()).predict(SessionHint("s")) is None


def test_the_batched_release_is_the_same_events_as_one_by_one():
    """The pool's fast path (on_released_batch) against the protocol's per-block on_released."""

    class OneByOne(SessionPolicy):
        on_released_batch = None     # the pool then calls on_released per block
        reads_chain = False          # as SessionPolicy declares (a class attribute is not inherited)

    import random

    def run(policy):
        rng = random.Random(7)
        mgr = KVCacheManager(24, 2, policy=policy, hash_seed=0)
        evicted = []
        for i in range(400):
            session = rng.randrange(6)
            prompt = [session, 1, 2, 3] + [rng.randrange(3) for _ in range(rng.randrange(8))]
            if rng.random() < 0.2:
                prompt = [9, 9] + prompt          # shared by sessions: a common prefix
            before = mgr.pool.evictions
            mgr.admit(i, prompt)
            evicted.append(mgr.pool.evictions - before)
            hint = None if rng.random() < 0.2 else SessionHint(
                session, end=rng.choice(["tool_use", "end_turn", None]), time=float(i // 3), turn=i // 6)
            mgr.free(i, hint=hint)
            mgr.check_invariants()
        return evicted, mgr.pool.snapshot()

    assert run(SessionPolicy()) == run(OneByOne())


def _chat_trace(n_sessions=300, seed=3):
    """Chat without end reasons: each request is a shared prompt block, the session's history and a new
    partly filled tail (never reused). A third of the sessions come back (after 40-90 s, up to 4 turns)."""
    import random

    rng = random.Random(seed)
    events = []
    for k in range(n_sessions):
        start = 2.0 * k
        turns = 1 + (3 if k % 3 == 0 else 0)
        history = []
        for turn in range(turns):
            history = history + [1_000_000 * (k + 1) + 10 * turn + j for j in range(3)]
            events.append((start, k, [7] + history + [10 ** 9 + 100 * k + turn]))
            start += rng.uniform(40.0, 90.0)
    events.sort(key=lambda e: e[0])
    return Trace([TraceRequest(t, len(ids) * 64, 1, ids) for t, _, ids in events], 64)


def test_the_chat_fallback_learns_reuse_tables_and_beats_lru():
    from prefixkv.sim.traces import infer_sessions

    trace = _chat_trace()
    infer_sessions(trace.requests, 64)
    assert all(r.stop is None and r.session is not None for r in trace.requests)
    capacity = 120
    policy = SessionPolicy()
    session = replay(trace, policy, capacity)
    lru = replay(trace, "lru", capacity)
    assert session.block_hit_rate > lru.block_hit_rate
    tables = {q.klass: q.table for q in policy._queues.values()}
    leaf = tables[("leaf",)]
    private = [t for k, t in tables.items() if k[0] == "private"]
    assert private and leaf[0] < 0.1 * max(t[0] for t in private)   # dead tails rank far below returning history
    mgr_policy = SessionPolicy()
    check = replay(trace, mgr_policy, capacity)
    assert check.block_hit_rate == session.block_hit_rate          # deterministic


class _OneByOneSession(SessionPolicy):
    """The session policy with its batch events hidden: the pool calls evict / on_hit /
    on_released per block (a subclass that defines the single events only)."""

    reads_chain = False              # as SessionPolicy declares (a class attribute is not inherited)

    def evict(self) -> int:
        return super().evict()

    def on_hit(self, block: int, was_evictable: bool) -> None:
        super().on_hit(block, was_evictable)

    def on_released(self, block: int) -> None:
        super().on_released(block)


@pytest.mark.parametrize("seed", range(12))
def test_the_session_batches_evict_hit_and_release_as_one_by_one(seed):
    """evict_many, on_hit_batch and on_released_batch (the pool's fast paths, with victims it
    does not re-check: valid_victims) end in the same pool and policy state as the single events,
    with end reasons, chat hints without one, shared prefixes and unhinted frees."""
    import random

    rng = random.Random(seed)
    managers = [KVCacheManager(48, 4, policy=policy, hash_seed=0)
                for policy in (SessionPolicy(), _OneByOneSession())]
    prefix = [rng.randrange(50) for _ in range(8)]
    contexts: dict[int, list[int]] = {}
    now = 0.0
    for step in range(150):
        session = rng.randrange(6)
        grown = contexts.get(session, prefix if rng.random() < 0.5 else []) + \
            [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        contexts[session] = grown if len(grown) < 120 else prefix[:]
        now += rng.expovariate(0.5)
        end = rng.choice(["tool_use", "end_turn", None, "unhinted"])
        hint = None if end == "unhinted" else SessionHint(session, end=end, time=now, turn=step)
        for mgr in managers:
            mgr.admit(step, mgr.prompt(contexts[session]), compute_last_token=False)
            mgr.free(step, hint=hint)
        batched, single = managers
        assert batched.pool.snapshot()[:-2] == single.pool.snapshot()[:-2]
        assert batched.pool.policy.eviction_order() == single.pool.policy.eviction_order()
    batched.check_invariants()
    assert batched.pool.policy.snapshot() == single.pool.policy.snapshot()
    assert batched.pool.evictions == single.pool.evictions > 0


def test_an_empty_release_batch_leaves_nothing_for_eviction_to_choose():
    """The pool sends no empty batch, but a policy driven directly may get one: it must not open a
    run that a later evict() picks empty ('dictionary is empty')."""
    policy = SessionPolicy()
    mgr = KVCacheManager(8, 4, policy=policy)
    policy.on_released_batch([])
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    assert policy.evict() in (0, 1)
