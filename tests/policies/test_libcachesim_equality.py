"""prefixkv's policies against libCacheSim's algorithms of the same name, on one-block requests.

With every request a single block there is no prefix: a leading hit is a hit, and the pool's
events reduce to a plain cache's (a hit, or an eviction then an insertion). Where prefixkv
follows libCacheSim's algorithm, the hit counts must be equal on every stream; where it is a
variant (named so in its docstring and the README), the measured counts of both are pinned
here, so a change to either side shows up. Skipped, with the reason, where libcachesim is not
installed (the test extra installs it).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

lcs = pytest.importorskip("libcachesim", reason="libcachesim is not installed (pip install -e '.[test]')")

from prefixkv.sim.replay import replay  # noqa: E402
from prefixkv.sim.traces import Trace, TraceRequest  # noqa: E402

CAPACITIES = (5, 37, 200)


def one_block_trace(ids) -> Trace:
    return Trace([TraceRequest(timestamp=float(t), input_length=1, output_length=0, block_hashes=[x])
                  for t, x in enumerate(ids)], block_size=1)


def prefixkv_hits(policy: str, ids, capacity: int) -> int:
    return replay(one_block_trace(ids), policy, capacity).block_hits


def libcachesim_hits(make, ids, capacity: int) -> int:
    cache = make(capacity)
    return sum(cache.get(lcs.Request(obj_size=1, obj_id=x, clock_time=t)) for t, x in enumerate(ids))


def skewed_stream(seed: int, n: int = 3000, core: int = 800) -> list[int]:
    """A Pareto-popular core of ``core`` ids with 20 % noise: reuse at every distance."""
    rng = random.Random(seed)
    return [min(int(rng.paretovariate(0.7)), core) + (rng.randrange(4 * core) if rng.random() < 0.2 else 0)
            for _ in range(n)]


STREAM = skewed_stream(1)

# prefixkv name -> libCacheSim cache for a capacity: the same algorithm, so equal hit counts
EQUAL = {
    "lru": lambda c: lcs.LRU(c),
    "fifo": lambda c: lcs.FIFO(c),
    "sieve": lambda c: lcs.Sieve(c),
    "clock": lambda c: lcs.Clock(c),
    "clock:counter_bits=2": lambda c: lcs.Clock(c, n_bit_counter=2),
    "2q": lambda c: lcs.TwoQ(c),
    "2q:in_fraction=0.5:out_fraction=1.0": lambda c: lcs.TwoQ(c, a_in_size_ratio=0.5, a_out_size_ratio=1.0),
    "mq": lambda c: lcs.MQ(c),
    "mq:lifetime=40:n_queues=4": lambda c: lcs.MQ(c, lifetime=40, n_queue=4),
}


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("policy", list(EQUAL))
def test_equal_to_libcachesim_on_a_skewed_stream(policy, capacity):
    ours = prefixkv_hits(policy, STREAM, capacity)
    assert ours == libcachesim_hits(EQUAL[policy], STREAM, capacity)
    assert 0 < ours < len(STREAM)


@pytest.mark.parametrize("policy", ["sieve", "clock", "2q", "mq:lifetime=5:n_queues=3"])
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 24), min_size=1, max_size=250), capacity=st.integers(4, 16))
def test_equal_to_libcachesim_on_any_stream(policy, ids, capacity):
    make = (lambda c: lcs.MQ(c, lifetime=5, n_queue=3)) if policy.startswith("mq:") else EQUAL[policy]
    assert prefixkv_hits(policy, ids, capacity) == libcachesim_hits(make, ids, capacity)


# The variants: (prefixkv hits, libCacheSim hits) on VARIANT_STREAM at VARIANT_CAPACITIES, measured with
# libcachesim 0.3.5. README "Policies and libCacheSim" explains each difference. Capacities of at
# least 10: below, libCacheSim's S3FIFO aborts the process (a small FIFO of 0 bytes), and below 100
# its WTinyLFU hits nothing (a window of int(0.01 x c) = 0 bytes).
VARIANT_CAPACITIES = (10, 100, 400)
VARIANT_STREAM = skewed_stream(2, 8000, core=4000)
VARIANTS = {
    "s3fifo": (lambda c: lcs.S3FIFO(c), {}),
    "arc": (lambda c: lcs.ARC(c), {}),
    "slru": (lambda c: lcs.SLRU(c), {}),
    "lfu": (lambda c: lcs.LFU(c), {}),
    "lirs": (lambda c: lcs.LIRS(c), {}),
    "wtinylfu": (lambda c: lcs.WTinyLFU(c), {}),
    "lecar": (lambda c: lcs.LeCaR(c), {}),
}
PINNED: dict[str, dict[int, tuple[int, int]]] = {
    's3fifo': {10: (5090, 0), 100: (5997, 5984), 400: (6114, 6102)},
    'arc': {10: (4972, 4970), 100: (5981, 5981), 400: (6111, 6111)},
    'slru': {10: (4636, 4749), 100: (5957, 5931), 400: (6111, 6096)},
    'lfu': {10: (4415, 4939), 100: (5761, 5963), 400: (6081, 6111)},
    'lirs': {10: (4987, 5011), 100: (6015, 5994), 400: (6117, 6111)},
    'wtinylfu': {10: (5068, 0), 100: (5987, 5975), 400: (6113, 6109)},
    'lecar': {10: (4851, 4400), 100: (5854, 5763), 400: (6073, 6074)},
}
# libCacheSim's LeCaR draws from a process-wide generator, so its count depends on what ran
# before in the process (a fresh process gives the pinned one): it is held to 2 % of the pin.
UNSEEDED = {"lecar"}


@pytest.mark.parametrize("policy", list(VARIANTS))
def test_variants_differ_from_libcachesim_by_the_measured_counts(policy):
    make, _ = VARIANTS[policy]
    measured = {c: (prefixkv_hits(policy, VARIANT_STREAM, c), libcachesim_hits(make, VARIANT_STREAM, c))
                for c in VARIANT_CAPACITIES}
    if policy in UNSEEDED:
        assert {c: ours for c, (ours, _) in measured.items()} == {c: ours for c, (ours, _) in PINNED[policy].items()}
        for c, (_, theirs) in measured.items():
            assert abs(theirs - PINNED[policy][c][1]) <= 0.02 * PINNED[policy][c][1]
    else:
        assert measured == PINNED[policy]
    assert any(ours != theirs for ours, theirs in measured.values()), f"{policy} now equals libCacheSim: move it to EQUAL"
