"""The policy registry, policy specs and options (refused naming the option, whatever the spelling:
NaN, infinities, fractions for counts, strings), and LRU / FIFO against a reference."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.errors import InvalidArgument
from prefixkv.policies import (EvictionPolicy, FIFOPolicy, LRUPolicy, PolicyRegistry, PriorityPolicy,
                               S3FIFOPolicy, SLRUPolicy, available_policies, make_policy)


def test_registry_names_and_errors():
    assert {"lru", "fifo"} <= set(available_policies())
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'.*lru"):
        make_policy("nope")


def test_register_a_custom_policy():
    registry = PolicyRegistry({})

    @registry.register("mru")
    class MRU(LRUPolicy):
        name = "mru"

        def evict(self):
            return self._order.popitem(last=True)[0]

    assert registry.names() == ["mru"]
    assert isinstance(registry.make("mru"), MRU)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mru", LRUPolicy)


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_builtin_policies_follow_the_protocol(name):
    assert isinstance(make_policy(name), EvictionPolicy)


# Events a pool can send for one block: cached (once, while active) -> released -> hit -> released ...
events = st.lists(st.tuples(st.sampled_from(["cache", "release", "hit", "evict"]), st.integers(0, 7)),
                  max_size=80)


def replay(policy, script):
    """Drive a policy with a legal event sequence; mirror it in a plain-list reference."""
    state = {}          # block -> "active" | "evictable"
    cached_order = []   # FIFO reference: publish order of cached blocks
    released_order = []  # LRU reference: release order of evictable blocks
    victims = []
    for kind, block in script:
        s = state.get(block)
        if kind == "cache" and s is None:
            state[block] = "active"
            policy.on_cached(block)
            cached_order.append(block)
        elif kind == "release" and s == "active":
            state[block] = "evictable"
            policy.on_released(block)
            released_order.append(block)
        elif kind == "hit" and s is not None:
            policy.on_hit(block, s == "evictable")
            if s == "evictable":
                released_order.remove(block)
            state[block] = "active"
        elif kind == "evict" and len(policy):
            victim = policy.evict()
            expected = (released_order[0] if isinstance(policy, LRUPolicy)
                        else next(b for b in cached_order if state.get(b) == "evictable"))
            assert victim == expected
            released_order.remove(victim)
            cached_order.remove(victim)
            del state[victim]
            victims.append(victim)
        assert len(policy) == sum(1 for v in state.values() if v == "evictable")
        for b, v in state.items():
            assert (b in policy) == (v == "evictable")
    return victims


@settings(max_examples=300, deadline=None)
@given(events)
def test_lru_matches_a_reference(script):
    replay(LRUPolicy(), script)


@settings(max_examples=300, deadline=None)
@given(events)
def test_fifo_matches_a_reference(script):
    replay(FIFOPolicy(), script)


def test_fifo_differs_from_lru_when_a_block_is_reused():
    script = [("cache", 1), ("cache", 2), ("release", 1), ("release", 2), ("hit", 1), ("release", 1), ("evict", 0)]
    assert replay(LRUPolicy(), script) == [2]
    assert replay(FIFOPolicy(), script) == [1]


def test_third_party_policy_through_an_entry_point(tmp_path, monkeypatch):
    (tmp_path / "mru_plugin.py").write_text(
        "from prefixkv.policies import LRUPolicy\n"
        "class MRU(LRUPolicy):\n"
        "    name = 'mru'\n"
        "    def evict(self):\n"
        "        block = self.snapshot()[-1]   # most recent first (slow, but only public calls)\n"
        "        self.on_hit(block, True)\n"
        "        return block\n")
    dist = tmp_path / "mru_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mru-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prefixkv.policies]\nmru = mru_plugin:MRU\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = PolicyRegistry({"lru": LRUPolicy})
    assert registry.names() == ["lru", "mru"]
    policy = registry.make("mru")
    for block in (1, 2, 3):
        policy.on_released(block)
    assert policy.evict() == 3


def test_policy_specs_carry_options():
    from prefixkv.policies import parse_policy_spec

    assert parse_policy_spec("lrfu:half_life=4:ghost=0.5:leaf_penalty=false:reuse_distance=none") == (
        "lrfu", {"half_life": 4, "ghost": 0.5, "leaf_penalty": False, "reuse_distance": None})
    policy = make_policy("lrfu:half_life=4:leaf_penalty=False")
    assert (policy.half_life, policy.leaf_penalty) == (4, False)
    assert make_policy("workload:by_depth=true").by_depth is True
    # keyword options given beside a spec win over the spec's
    assert make_policy("lrfu:half_life=4", half_life=8).half_life == 8


@pytest.mark.parametrize("spec,message", [
    ("lrfu:halflife=4", "has no option 'halflife'; its options: half_life, ghost"),
    ("lrfu:half_life", "expected key=value"),
    ("lrfu:half_life=1:half_life=2", "given twice"),
    ("lrfu:half_life=-1", "eviction policy 'lrfu' with half_life=-1: need half_life"),
    ("lru:size=3", "'lru' has no option 'size'; its options: none"),
    ("nope:x=1", "unknown eviction policy 'nope'"),
])
def test_bad_policy_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_policy(spec)


@pytest.mark.parametrize("spec,message", [
    ("gdsf:inherit=off", "option inherit='off' should be true/false"),
    ("workload:by_depth=nope", "option by_depth='nope' should be true/false"),
    ("lfu:half_life=2.5", "option half_life=2.5 should be an integer or none"),
    ("lrfu:half_life=abc", "option half_life='abc' should be a number"),
])
def test_policy_spec_values_are_checked_against_the_option_types(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_policy(spec)


def test_lfu_refuses_a_fractional_half_life_given_as_a_keyword():
    with pytest.raises(ValueError, match="positive int"):
        make_policy("lfu", half_life=2.5)


# -- options: NaN, infinity, fractional counts and strings are refused, naming the option -----------------
# A NaN passes every ``if x <= 0: raise`` check, and an infinity passed most: both were taken, then broke the
# policy mid-run (lrfu: OverflowError from int(inf) at construction, escaping make_policy's ValueError
# wrapper; workload / gdsf: NaN or -inf sort keys, then "not in list" inside evict, reported as PolicyError
# after evictions had begun). Fractional counts and strings were taken as well.
@pytest.mark.parametrize("name,options,argument", [
    ("lrfu", {"half_life": float("inf")}, "half_life"),
    ("lrfu", {"ghost": float("inf")}, "ghost"),
    ("lrfu", {"step": float("nan")}, "step"),
    ("lrfu", {"step": 50.0}, "step"),
    ("lrfu", {"reuse_distance": float("inf")}, "reuse_distance"),
    ("workload", {"horizon": float("inf")}, "horizon"),
    ("workload", {"horizon": float("nan")}, "horizon"),
    ("workload", {"window": float("nan")}, "window"),
    ("gdsf", {"depth_cost": float("nan")}, "depth_cost"),
    ("gdsf", {"depth_cost": float("inf")}, "depth_cost"),
    ("s3fifo", {"move_threshold": 1.5}, "move_threshold"),
    ("s3fifo", {"max_freq": "3"}, "max_freq"),
    ("s3fifo", {"small_fraction": 0.0}, "small_fraction"),
    ("slru", {"protected_size": 2.5}, "protected_size"),
    ("slru", {"protected_fraction": float("nan")}, "protected_fraction"),
    ("lfu", {"half_life": True}, "half_life"),
])
def test_bad_policy_options_are_refused_naming_them(name, options, argument):
    from prefixkv.errors import InvalidArgument
    from prefixkv.policies import make_policy

    with pytest.raises(InvalidArgument) as info:
        make_policy(name, **options)
    assert info.value.argument == argument


def test_lrfu_huge_half_life_from_a_spec_is_refused_as_a_value_error():
    from prefixkv.policies import make_policy

    # "1e999" is a float literal: inf. It raised OverflowError, which the spec's ValueError wrapper let out.
    with pytest.raises(ValueError, match="half_life"):
        make_policy("lrfu:half_life=1e999")


def test_numpy_and_plain_numbers_are_still_taken():
    import numpy as np
    from prefixkv.policies import make_policy

    assert make_policy("s3fifo", move_threshold=np.int64(2), max_freq=3).move_threshold == 2
    assert make_policy("slru", protected_size=np.int32(3)).protected_size == 3
    assert make_policy("lfu", half_life=np.int64(8)).half_life == 8
    assert make_policy("gdsf", depth_cost=0).depth_cost == 0
    assert make_policy("workload", horizon=1, window=np.float64(0.5)).window == 0.5


def test_a_bad_option_in_a_spec_string_stays_an_invalid_argument_naming_it():
    """make_policy turned the option's InvalidArgument into a plain ValueError for spec strings, so a
    caller could not tell which option was refused."""
    from prefixkv.errors import InvalidArgument
    from prefixkv.policies import make_policy

    with pytest.raises(InvalidArgument) as info:
        make_policy("gdsf:depth_cost=1e999")
    assert info.value.argument == "depth_cost" and "gdsf" in str(info.value)
    with pytest.raises(ValueError):         # what callers caught before
        make_policy("s3fifo:max_freq=1e999")


# -- integer policy options given as integral floats ----------------------------------------------

def test_integer_policy_options_take_integral_floats():
    """s3fifo move_threshold / max_freq, slru protected_size and PriorityPolicy min_priority refuse
    fractions, but take an integral float such as 2.0 and run it as the int 2."""
    s3 = S3FIFOPolicy(move_threshold=2.0, max_freq=3.0)
    assert (s3.move_threshold, s3.max_freq) == (2, 3) and type(s3.move_threshold) is int
    slru = SLRUPolicy(protected_size=4.0)
    assert slru.protected_size == 4 and type(slru.protected_size) is int
    prio = PriorityPolicy(make_policy("lru"), min_priority=1.0)
    assert prio.min_priority == 1 and type(prio.min_priority) is int
    assert make_policy("s3fifo", move_threshold=np.int64(2)).move_threshold == 2


@pytest.mark.parametrize("make", [lambda: S3FIFOPolicy(move_threshold=1.5), lambda: S3FIFOPolicy(max_freq=2.5),
                                  lambda: SLRUPolicy(protected_size=0.5), lambda: SLRUPolicy(protected_size="4"),
                                  lambda: PriorityPolicy(make_policy("lru"), min_priority=0.5),
                                  lambda: S3FIFOPolicy(move_threshold=float("inf"))])
def test_integer_policy_options_still_refuse_fractions(make):
    with pytest.raises(InvalidArgument):
        make()
