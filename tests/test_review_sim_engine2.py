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
