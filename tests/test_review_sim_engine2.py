"""Defects found in the second review of trace replay, its models (remote tier, slot store, lab),
the engine's capacity / sampling seam and the cost model; one test each."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.policies import LRUPolicy, make_policy
from prefixkv.sim.replay import replay, roc_auc
from prefixkv.sim.traces import Trace
from prefixkv.sim.traces import TraceRequest as Req


class ExactForecast(LRUPolicy):
    """LRU that forecasts, from the free, exactly the seconds until its session's next request."""

    name = "exact-forecast"

    def __init__(self, next_arrival: dict):
        super().__init__()
        self.next_arrival = next_arrival      # (session, turn) -> the next request's timestamp

    def on_hint(self, hint):
        pass

    def predict(self, hint):
        nxt = self.next_arrival.get((hint.session, hint.turn))
        return (0.0, 0.0) if nxt is None else (1.0, max(nxt - hint.time, 0.0))


def _two_turns():
    # Session s: turn 0 arrives at 0 s and, at 1 output token/s, finishes at 50 s; turn 1 arrives
    # at 100 s. Session u sends one request. From turn 0's free, s is back in 50 s (cache mode:
    # the free is at the arrival, 100 s).
    return Trace([Req(0.0, 8, 50, [1, 2], session="s"), Req(100.0, 12, 1, [1, 2, 3], session="s"),
                  Req(200.0, 4, 1, [9], session="u")], 4)


@pytest.mark.parametrize("mode", ["cache", "concurrent"])
def test_an_exact_arrival_forecast_scores_no_error_in_either_mode(mode):
    # The forecast is a gap from the free (SessionHint.time); the score measured the actual gap
    # from the request's arrival, so in concurrent mode (free = finish) an exact forecast scored
    # |ln(51 / 101)| = 0.68.
    trace = _two_turns()
    result = replay(trace, ExactForecast({("s", 0): 100.0}), 64, mode=mode, prefill_rate=1e9, decode_rate=1.0)
    assert result.predictions == 3
    assert result.return_auc == 1.0
    assert result.arrival_log_error == 0.0


def test_a_refused_replay_leaves_the_policy_object_unused():
    # belady in concurrent mode was refused after the policy had been bound to the replay's pool,
    # so the same object could not be replayed again (in cache mode, where it works).
    trace = _two_turns()
    policy = make_policy("belady")
    with pytest.raises(ValueError, match="belady"):
        replay(trace, policy, 64, mode="concurrent")
    assert replay(trace, policy, 64).block_hits == 2


@pytest.mark.parametrize("kwargs, argument", [
    (dict(mode="concurrent", prefill_rate=0.0), "prefill_rate"),           # ZeroDivisionError
    (dict(mode="concurrent", decode_rate=-1.0), "decode_rate"),            # time ran backwards
    (dict(mode="concurrent", decode_rate=math.nan), "decode_rate"),        # TypeError from a heap of NaNs
    (dict(prefill_rate="fast"), "prefill_rate"),
    (dict(remote_capacity=math.nan), "remote_capacity"),                   # an unbounded remote model
    (dict(remote_capacity=2.5), "remote_capacity"),
    (dict(remote_capacity=True), "remote_capacity"),                       # one block
    (dict(remote_capacity=-3), "remote_capacity"),
    (dict(remote_capacity=4, remote_bytes_per_s=-1.0), "remote_bytes_per_s"),  # negative seconds
    (dict(remote_capacity=4, remote_bytes_per_s=math.inf), "remote_bytes_per_s"),
    (dict(host_capacity=-1), "host_capacity"),
    (dict(capacity=0), "capacity"),
    (dict(warmup=1.0), "warmup"),
    (dict(mode="bogus"), "mode"),
])
def test_bad_replay_arguments_are_named_before_anything_runs(kwargs, argument):
    kwargs = dict(kwargs)
    capacity = kwargs.pop("capacity", 64)
    policy = make_policy("lru")
    with pytest.raises(InvalidArgument) as info:
        replay(_two_turns(), policy, capacity, **kwargs)
    assert info.value.argument == argument
    assert replay(_two_turns(), policy, 64).block_hits == 2       # the policy object is still unused


def _brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def test_roc_auc_agrees_with_the_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        scores = [float(x) for x in rng.integers(0, 4, n) / 4]
        labels = [bool(x) for x in rng.integers(0, 2, n)]
        if all(labels) or not any(labels):
            assert roc_auc(scores, labels) is None
        else:
            assert roc_auc(scores, labels) == pytest.approx(_brute_auc(scores, labels))


@pytest.mark.parametrize("scores, labels", [
    ([0.1, 0.2], [True, False, True]),            # came back as -1.0, an impossible AUC
    ([0.1, 0.2, 0.3], [True, False]),             # IndexError
    ([math.nan, 0.2, 0.5], [True, False, True]),  # NaN breaks the sort: a silent wrong figure
])
def test_roc_auc_refuses_what_it_cannot_score(scores, labels):
    with pytest.raises(InvalidArgument):
        roc_auc(scores, labels)


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


def test_an_unknown_host_policy_is_refused_before_the_device_policy_is_bound():
    policy = make_policy("lru")
    with pytest.raises(ValueError, match="bogus"):
        replay(_two_turns(), policy, 64, host_capacity=4, host_policy="bogus")
    assert replay(_two_turns(), policy, 64).block_hits == 2


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


# -- the slot store ------------------------------------------------------------------------------

def test_slot_store_copies_nothing_when_one_copy_of_the_batch_is_outside_the_store():
    # The copies ran one by one: a bad pair after good ones left the good ones applied.
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(4, 2)
    store.write(np.arange(8), range(8))
    before = store.slots.copy()
    with pytest.raises(IndexError, match="block 9"):
        store.copy_blocks([(0, 1), (2, 9)])
    assert np.array_equal(store.slots, before)


def test_slot_store_copies_run_in_order():
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(3, 2)
    store.write(np.arange(6), range(6))
    store.copy_blocks([(0, 1), (1, 2)])        # block 2 gets block 0's tokens, through block 1
    assert store.slots.tolist() == [[0, 1], [0, 1], [0, 1]]


@pytest.mark.parametrize("num_blocks, block_size, argument", [
    (-1, 4, "num_blocks"), (4, 0, "block_size"), (2.5, 4, "num_blocks"), (4, True, "block_size"),
    (4, "4", "block_size")])
def test_slot_store_refuses_a_shape_that_is_not_a_count(num_blocks, block_size, argument):
    from prefixkv.sim.slotstore import SlotStore

    with pytest.raises(InvalidArgument) as info:
        SlotStore(num_blocks, block_size)
    assert info.value.argument == argument


# -- the lab -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16.0, "16", None, 1, True])
def test_lab_names_a_bad_block_size(block_size):
    # 16.0 was refused as "num_blocks: must be an int, got float 1.0", a name the caller never gave.
    from prefixkv.sim.lab import run_lab

    with pytest.raises(InvalidArgument) as info:
        run_lab(block_size, [3])
    assert info.value.argument == "block_size"


# -- sampling ------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-310])
def test_a_positive_infinite_logit_is_drawn_instead_of_failing_the_step(temperature):
    # A half-precision overflow gives a +inf logit: greedy takes it, but a temperature draw put
    # NaN into softmax and multinomial raised inside the step, failing every request of it.
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import SamplingParams
    from prefixkv.engine.sampling import sample

    one = torch.tensor([1.0, math.inf, 2.0, -math.inf], dtype=torch.float16)
    two = torch.tensor([math.inf, 0.0, math.inf, 5.0])
    drawn = set()
    for i in range(16):
        params = SamplingParams(temperature=temperature, seed=i)
        assert sample(one, params, i) == 1
        drawn.add(sample(two, params, i))
    assert drawn == {0, 2}


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
