"""check_policy: every built-in passes; broken policies are caught with a useful message."""

import random
from collections import OrderedDict

import pytest
from ordered_policy import OrderedPolicy

from prefixkv.policies import (LRUPolicy, PolicyCheckFailed, PriorityPolicy, available_policies, check_policy,
                               make_policy)

ONLINE = [n for n in available_policies() if n != "belady"]


@pytest.mark.parametrize("name", ONLINE)
def test_every_builtin_policy_passes(name):
    report = check_policy(lambda: make_policy(name))
    assert report.evictions > 200 and report.hit_tokens > 0
    # leaf-lru equals LRU under plain tail-first release; forks and duplicates here tell them apart
    assert report.differs_from_lru == (name != "lru")


def test_the_priority_wrapper_passes():
    assert check_policy(lambda: PriorityPolicy(make_policy("slru"), min_priority=2)).differs_from_lru


class KeepsHitBlocks(LRUPolicy):
    """Forgets to drop a candidate that a hit took back."""

    def on_hit(self, block, was_evictable):
        pass


class OrderedLRU(OrderedPolicy):
    """LRU over an OrderedDict (LRUPolicy's own layout is internal): the broken variants below
    change one method of it."""

    name = "lru"


class RandomVictim(OrderedLRU):
    """Unseeded randomness: replays are not reproducible."""

    def evict(self):
        block = random.choice(list(self._order))
        del self._order[block]
        return block


class EvictsItsNewest(OrderedLRU):
    """Valid, but pops the wrong end: it must pass (behaviour is the policy's business)."""

    def evict(self):
        return self._order.popitem(last=True)[0]


class NoSnapshot:
    name = "broken"

    def __init__(self):
        self._order = OrderedDict()

    def bind(self, pool):
        pass


def test_a_policy_that_keeps_hit_blocks_as_candidates_fails():
    with pytest.raises(PolicyCheckFailed, match=r"seed \d+, after step \d+ .*active block \d+ is also free or evictable"):
        check_policy(KeepsHitBlocks)


def test_a_nondeterministic_policy_fails():
    random.seed(1)
    with pytest.raises(PolicyCheckFailed, match="two runs of the same workload evicted different blocks"):
        check_policy(RandomVictim)


def test_a_valid_but_different_policy_passes_and_differs():
    assert check_policy(EvictsItsNewest).differs_from_lru


def test_a_class_missing_protocol_methods_fails():
    with pytest.raises(PolicyCheckFailed, match="does not follow the EvictionPolicy protocol; missing: on_cached"):
        check_policy(NoSnapshot)
