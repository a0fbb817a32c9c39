"""The reuse tables behind session's chat fallback, against a from-scratch recount.

``ReuseTables`` keeps its per-bucket reuses and exposure incrementally (experiments move between
age buckets as the clock passes their edges; open ones count their time so far). Here every
experiment is also logged whole, and after each step the counts are recomputed from the log:
they must agree for any sequence of releases, accesses and clock steps.
"""

from __future__ import annotations

from bisect import bisect_right

import pytest
from hypothesis import given, strategies as st

from prefixkv.policies.reuse_tables import BUCKETS, EDGES, WIDTH, ClassStats, ReuseTables

LAST_EDGE = EDGES[-1]
CLASSES = (("private", 1, 0, 0), ("private", 2, 1, 1), ("shared",))
steps = st.lists(st.one_of(
    st.tuples(st.just("start"), st.integers(0, len(CLASSES) - 1), st.integers(0, 7), st.sampled_from((1.0, 0.5, 0.25))),
    st.tuples(st.just("touch"), st.integers(0, 7)),
    st.tuples(st.just("advance"), st.sampled_from((0.0, 0.5, 1.0, 3.0, 10.0, 100.0, 1000.0, 5000.0))),
), min_size=1, max_size=80)


class Recount:
    """Every experiment as a record; the counts are sums over the records."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.latest: dict = {}         # hash -> its record still open to an access

    def start(self, klass, now, h, w):
        previous = self.latest.get(h)
        if previous is not None and previous["end"] is None and not previous["pending"]:
            previous["end"] = now      # released again before any access: ends without a reuse
        self.latest[h] = record = dict(klass=klass, t0=now, w=w, end=None, hit=None, pending=False)
        self.records.append(record)

    def touch(self, h):
        record = self.latest.pop(h, None)
        if record is not None and record["end"] is None:
            record["pending"] = True

    def advance(self, now):
        for record in self.records:
            if record["end"] is None and now - record["t0"] >= LAST_EDGE:
                record["end"] = record["t0"] + LAST_EDGE     # not reused within the last edge
        for record in self.records:
            if record["end"] is None and record["pending"]:
                record["end"] = now
                record["hit"] = bisect_right(EDGES, now - record["t0"]) - 1

    def counts(self, klass, now):
        hits, expo = [0.0] * BUCKETS, [0.0] * BUCKETS
        for r in self.records:
            if r["klass"] != klass:
                continue
            age = (now if r["end"] is None else r["end"]) - r["t0"]
            for b in range(BUCKETS):
                expo[b] += r["w"] * min(max(age - EDGES[b], 0.0), WIDTH[b])
            if r["hit"] is not None:
                hits[r["hit"]] += r["w"]
        return hits, expo


@given(steps)
def test_incremental_counts_equal_a_recount_of_every_experiment(script):
    tables, recount = ReuseTables(), Recount()
    stats = {klass: ClassStats(klass) for klass in CLASSES}
    now = 0.0
    for step in script:
        if step[0] == "start":
            _, c, h, w = step
            tables.start(stats[CLASSES[c]], now, h, w)
            recount.start(CLASSES[c], now, h, w)
        elif step[0] == "touch":
            tables.touch(step[1])
            recount.touch(step[1])
        else:
            now += step[1]
            tables.age_out(now)       # as the session policy moves its clock: experiments age first,
            tables.resolve(now)       # then the accesses since the last move are reuses at that age
            recount.advance(now)
        for klass, s in stats.items():
            hits, expo = recount.counts(klass, now)
            assert s.hits == pytest.approx(hits, abs=1e-6), (klass, now)
            assert ReuseTables.exposure(s, now) == pytest.approx(expo, abs=1e-6), (klass, now)
    assert tables.evidence == sum(1 for step in script if step[0] == "start")


def test_access_counts_start_at_one_and_count_every_touch():
    tables = ReuseTables()
    assert tables.accesses("h") == 1
    for _ in range(3):
        tables.touch("h")
    assert tables.accesses("h") == 3


def _class_with_hazard(klass, hazard):
    stats = ClassStats(klass)
    stats.expo = [1e7 * WIDTH[b] for b in range(BUCKETS)]     # so much evidence that no prior matters
    stats.hits = [h * x for h, x in zip(hazard, stats.expo)]
    stats.total = 1.0
    return stats


@pytest.mark.parametrize("rate", [1e-4, 1e-3, 1e-2])
def test_a_constant_hazard_is_worth_that_rate_at_every_age_the_midpoint_rule_covers(rate):
    """Memoryless reuse: keeping a block longer never pays more or less per block-second. The index
    places a bucket's reuses at its midpoint, which holds while a bucket is short against the mean
    reuse time (rate x width <= 0.5); past that it undervalues old blocks of fast classes."""
    stats = _class_with_hazard(("private", 1, 0, 0), [rate] * BUCKETS)
    ReuseTables.compute([stats], 0.0)
    covered = [b for b in range(BUCKETS) if rate * WIDTH[b] <= 0.5]
    assert covered, "every rate here covers the youngest buckets"
    for b in covered:
        assert stats.table[b] == pytest.approx(rate, rel=0.03), b
    assert all(value <= rate * 1.05 for value in stats.table)


def test_a_higher_hazard_ranks_higher_at_every_age_and_a_dead_class_is_worth_nothing():
    shape = [0.02 / (1 + b) for b in range(BUCKETS)]
    low = _class_with_hazard(("private", 1, 0, 0), shape)
    high = _class_with_hazard(("private", 2, 0, 0), [3 * x for x in shape])
    dead = _class_with_hazard(("shared",), [0.0] * BUCKETS)
    ReuseTables.compute([low, high, dead], 0.0)
    assert all(h > l > 0.0 for h, l in zip(high.table, low.table))
    assert max(dead.table) < 1e-9
