"""The remote tier's replay model (``prefixkv.sim.remote_model``) and what replay stages from it: a
request too long for the cache fetches nothing; staging never evicts the host blocks of the chain it
continues; the model holds at most its capacity (a positive count); the remote counters leave out the
warm-up."""

from __future__ import annotations

import math

import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.sim.replay import replay
from prefixkv.sim.sweep import TraceSource
from prefixkv.sim.traces import Trace
from prefixkv.sim.traces import TraceRequest as Req
from prefixkv.sim.workloads import builtin_trace


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    trace = builtin_trace("default", tmp_path_factory.mktemp("traces"))
    return TraceSource("default", (str(trace.path),), "tokens")


# -- what replay stages from the remote tier ---------------------------------------------------------

def test_a_request_too_long_for_the_cache_fetches_nothing_from_the_remote_tier():
    # [1, 2] is written through to the remote tier; [5, 6, 7] pushes it out of the device (and the
    # one-block host tier keeps only one of its blocks); [1, 2, 3, 4] can never be admitted into a
    # 3-block device pool, so staging its chain from the remote moved bytes for nothing (counted
    # as remote fetches with no remote hit) and evicted host blocks for it.
    reqs = [Req(0.0, 8, 1, [1, 2]), Req(1.0, 12, 1, [5, 6, 7]), Req(2.0, 16, 1, [1, 2, 3, 4])]
    result = replay(Trace(reqs, 4), "lru", 3, host_capacity=1, remote_capacity=16)
    assert result.oversized_requests == 1
    assert result.extra["remote_fetches"] == 0
    assert result.remote_block_hits == 0


# -- the remote tier's model ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, 2.5, True, 0, -1, "8", None])
def test_remote_model_refuses_a_capacity_that_is_not_a_positive_count(bad):
    from prefixkv.sim.remote_model import RemoteModel

    with pytest.raises(InvalidArgument, match="capacity"):
        RemoteModel(bad)


def test_remote_model_holds_at_most_its_capacity():
    from prefixkv.sim.remote_model import RemoteModel

    model = RemoteModel(3)
    model.write(range(10))
    assert model.leading([7, 8, 9], 0) == 3 and model.leading([6], 0) == 0
    assert (model.written, model.evictions) == (10, 7)


def test_staging_from_the_remote_tier_never_evicts_the_chain_it_continues():
    # [5, 6, 9, 10] is cached and written through; [1, 2, 3, 4] pushes it out of the 4-block device,
    # and the 2-block host tier keeps 5 and 6. When [5, 6, 9, 10] comes back, 5 and 6 are host hits
    # and 9, 10 continue them in the remote tier. The real tier (tiers.remote) holds the chain's
    # host blocks while it stages: with no host block left, it stages nothing and the request
    # loads its two host hits. The model staged 9 and 10 over 5 and 6: no hit at all, two fetches.
    reqs = [Req(0.0, 16, 1, [5, 6, 9, 10]), Req(1.0, 16, 1, [1, 2, 3, 4]), Req(2.0, 16, 1, [5, 6, 9, 10])]
    result = replay(Trace(reqs, 4), "lru", 4, host_capacity=2, remote_capacity=64)
    assert (result.block_hits, result.host_block_hits, result.remote_block_hits) == (2, 2, 0)
    assert result.extra["remote_fetches"] == 0


# -- the remote tier's counters ------------------------------------------------------------------

def test_remote_counters_leave_out_the_warmup(source):
    from prefixkv.sim.replay import replay

    trace = source.load()
    whole = replay(trace, "lru", 100, host_capacity=50, remote_capacity=500).as_dict()
    measured = replay(trace, "lru", 100, host_capacity=50, remote_capacity=500, warmup=0.5).as_dict()
    assert measured["tier_block_hits"]["remote"] < whole["tier_block_hits"]["remote"]   # windowed
    assert measured["remote_fetches"] < whole["remote_fetches"]
