"""A manager's tier stack: ``tiers=[HostTier(...), ...]`` and the host shorthand build the same
stack (identical state after every operation, for every index and policy kind), and stacks that
cannot work are refused naming the problem before anything is built."""

from __future__ import annotations

import random

import pytest

from prefixkv import KVCacheManager
from prefixkv.errors import InvalidArgument
from prefixkv.host_tier import HostTier
from prefixkv.policies import LRUPolicy


def _drive(mgr, seed: int) -> list:
    """Admissions, decodes, frees, swaps and prefix sharing at random; the state after each step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    live: list[str] = []
    swapped: set[str] = set()
    states = []
    for step in range(300):
        op = rng.random()
        if op < 0.45 or not live:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            try:
                mgr.admit(rid, tokens)
                live.append(rid)
            except Exception as exc:          # out of blocks: the same refusal on both
                states.append(type(exc).__name__)
        elif op < 0.7:
            rid = rng.choice(live)
            if rid not in swapped:
                try:
                    mgr.append(rid, [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
                except Exception as exc:
                    states.append(type(exc).__name__)
        elif op < 0.8 and mgr.num_host_blocks:
            rid = rng.choice(live)
            try:
                if rid in swapped:
                    mgr.swap_in(rid)
                    swapped.discard(rid)
                else:
                    mgr.swap_out(rid)
                    swapped.add(rid)
            except Exception as exc:
                states.append(type(exc).__name__)
        else:
            rid = live.pop(rng.randrange(len(live)))
            swapped.discard(rid)
            mgr.free(rid)
        moves = [list(map(tuple, mgr.take_demotions())), list(map(tuple, mgr.take_loads()))]
        states.append((moves, mgr.snapshot()))
        mgr.check_invariants()
    return states


@pytest.mark.parametrize("index", ["dict", "flat"])
@pytest.mark.parametrize("host", [dict(), dict(host_cache=True), dict(host_cache=True, host_inclusive=True),
                                  dict(host_cache=True, host_policy="fifo")])
def test_the_shorthand_and_an_explicit_host_tier_are_one_stack(index, host):
    if index == "flat":
        pytest.importorskip("numba")
    shorthand = KVCacheManager(24, 4, hash_seed=0, index=index, num_host_blocks=16, **host)
    explicit = KVCacheManager(24, 4, hash_seed=0, index=index, tiers=[
        HostTier(16, cache=host.get("host_cache", False), inclusive=host.get("host_inclusive", False),
                 policy=host.get("host_policy", "lru"))])
    assert type(shorthand.host.pool) is type(explicit.host.pool)
    assert _drive(shorthand, 1) == _drive(explicit, 1)
    assert shorthand.stats() == explicit.stats()


def test_a_policy_object_orders_the_host_tier():
    policy = LRUPolicy()
    mgr = KVCacheManager(16, 4, hash_seed=0, index="dict", tiers=[HostTier(8, policy=policy)])
    assert mgr.host.pool.policy is policy and [t.name for t in mgr.tiers] == ["CPU"]


class _Lower:
    name = "DISK"

    def bind(self, *a, **k):
        raise AssertionError("not reached")


@pytest.mark.parametrize("build, problem", [
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8)], num_host_blocks=8), "not both"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8)], host_cache=True), "not both"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8), HostTier(8)]), "one HostTier, first"),
    (lambda: KVCacheManager(16, 4, tiers=[_Lower(), HostTier(8)]), "one HostTier, first"),
    (lambda: KVCacheManager(16, 4, tiers=[_Lower()]), "put a caching HostTier above it"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8, cache=False), _Lower()]), "put a caching HostTier"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8), _Lower()], enable_caching=False), "needs prefix caching"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8), object()]), "is not a tier"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(8, policy="belady")]), "belady"),
    (lambda: KVCacheManager(16, 4, tiers=[HostTier(0)]), "num_blocks"),
])
def test_stacks_that_cannot_work_are_refused_naming_the_problem(build, problem):
    with pytest.raises(InvalidArgument, match=problem):
        build()


def test_a_host_tier_serves_one_manager():
    host = HostTier(8)
    KVCacheManager(16, 4, tiers=[host])
    with pytest.raises(InvalidArgument, match="serves another manager"):
        KVCacheManager(16, 4, tiers=[host])


def test_a_policy_object_of_the_device_pool_is_refused_for_the_host_tier():
    policy = LRUPolicy()
    with pytest.raises(InvalidArgument, match="already serves the device pool"):
        KVCacheManager(16, 4, policy=policy, tiers=[HostTier(8, policy=policy)])
