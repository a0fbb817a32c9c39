"""Second review of the seventh session's changes to pools, policies, manager and sim: regressions
and error paths that changed state before raising."""

from __future__ import annotations

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.manager import KVCacheManager
from prefixkv.policies import PriorityPolicy, S3FIFOPolicy, SLRUPolicy, make_policy


# -- sweep: fractions as numpy numbers ------------------------------------------------------------

def _trace():
    from prefixkv.sim.traces import Trace, TraceRequest

    return Trace([TraceRequest(float(i), 64, 1, list(range(i * 10, i * 10 + 4))) for i in range(50)], 16)


@pytest.mark.parametrize("fractions", [np.array([0.05, 0.1], dtype=np.float32), (np.float32(0.05), 0.1),
                                       np.array([0.05, 0.1])])
def test_auto_capacities_takes_numpy_fractions(fractions):
    """0cdeb25 checked fractions as Python ints/floats only: a numpy float32 (a fractions array read
    with numpy) was refused as InvalidArgument, which auto_capacities took before."""
    from prefixkv.sim.sweep import auto_capacities

    assert auto_capacities(_trace(), fractions) == auto_capacities(_trace(), (0.05, 0.1))


@pytest.mark.parametrize("bad", [(np.float32("nan"),), (np.float64(0.0),), (np.int64(-1),), ("0.1",)])
def test_auto_capacities_still_refuses_bad_numpy_fractions(bad):
    from prefixkv.sim.sweep import auto_capacities

    with pytest.raises(InvalidArgument, match="fractions"):
        auto_capacities(_trace(), bad)


# -- trace loaders: a numpy integer block size ----------------------------------------------------

def _mooncake_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [0, 1, 2]}\n'
                    '{"timestamp": 5, "input_length": 30, "output_length": 1, "hash_ids": [0, 1]}\n')
    return path


def test_trace_loaders_take_a_numpy_integer_block_size(tmp_path):
    """1c17c6c refused a block size that is not exactly an int: np.int64(16), which every loader
    took before (a block size read with numpy), became InvalidArgument."""
    from prefixkv.sim.traces import TraceRequest, load_mooncake, load_token_trace, load_trace, write_token_trace

    path = _mooncake_file(tmp_path)
    for trace in (load_mooncake(path, block_size=np.int64(16)), load_trace(path, block_size=np.int32(16))):
        assert trace.block_size == 16 and type(trace.block_size) is int
    tokens = tmp_path / "t.jsonl"
    write_token_trace(tokens, [TraceRequest(0.0, 4, 1, tokens=[1, 2, 3, 4])], block_size=np.int64(2))
    assert load_token_trace(tokens).block_size == 2
    trace = load_token_trace(tokens, block_size=np.int64(4))
    assert trace.block_size == 4 and type(trace.block_size) is int


@pytest.mark.parametrize("bad", [16.0, True, np.bool_(True), "16", 0, np.int64(-4)])
def test_trace_loaders_still_refuse_other_block_sizes(tmp_path, bad):
    from prefixkv.sim.traces import load_mooncake

    with pytest.raises(InvalidArgument, match="block_size"):
        load_mooncake(_mooncake_file(tmp_path), block_size=bad)
